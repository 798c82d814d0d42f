"""``--mesh-pose estimate``: the registration of MoGe-2-like points to a mesh recovers a known pose, and refuses a
scene that is not the mesh (pixal3d.mesh.register)."""
from __future__ import annotations

import numpy as np
import pytest
import trimesh

from pixal3d.mesh.register import ScenePoints, estimate_pose, surface_samples
from pixal3d.mesh.user_mesh import MeshError

DISTANCE = 1.1  # the cascade's camera distance for a ~49 degree field of view (camera_from_fov)


def _lamp() -> trimesh.Trimesh:
    """An asymmetric shape (a box with a post and an arm): one pose fits its visible side."""
    base = trimesh.creation.box((0.6, 0.4, 0.1))
    post = trimesh.creation.box((0.08, 0.08, 0.6))
    post.apply_translation((0.2, 0.1, 0.35))
    arm = trimesh.creation.box((0.4, 0.06, 0.06))
    arm.apply_translation((0.0, 0.1, 0.62))
    return trimesh.util.concatenate([base, post, arm])


def _rotation(yaw: float, pitch: float) -> np.ndarray:
    cy, sy, cp, sp = np.cos(yaw), np.sin(yaw), np.cos(pitch), np.sin(pitch)
    rz = np.array([[cy, -sy, 0], [sy, cy, 0], [0, 0, 1]])
    rx = np.array([[1, 0, 0], [0, cp, -sp], [0, sp, cp]])
    return rz @ rx


def _scene(mesh: trimesh.Trimesh, rotation: np.ndarray, scale: float, offset: np.ndarray,
           metric: float = 2.7) -> ScenePoints:
    """What a depth camera at world (0, -DISTANCE, 0) looking along +y sees of the placed mesh (front-facing
    samples), in OpenCV camera coordinates at another metric scale."""
    placed = trimesh.Trimesh(scale * mesh.vertices @ rotation.T + offset, mesh.faces, process=False)
    points, face = trimesh.sample.sample_surface(placed, 20000, seed=3)
    eye = np.array([0.0, -DISTANCE, 0.0])
    facing = (placed.face_normals[face] * (eye - points)).sum(axis=1) > 0
    world = points[facing]
    cam = np.stack([world[:, 0], -world[:, 2], world[:, 1] + DISTANCE], axis=1) * metric
    return ScenePoints(cam.astype(np.float32))


def test_a_known_pose_is_recovered_and_places_the_mesh_on_the_points():
    mesh = _lamp()
    rotation, scale, offset = _rotation(0.7, 0.25), 0.9, np.array([0.03, -0.02, 0.01])
    pose = estimate_pose(np.asarray(mesh.vertices), np.asarray(mesh.faces), _scene(mesh, rotation, scale, offset),
                         DISTANCE)
    assert pose.kind == "estimate" and pose.residual < 2.0  # voxels of the 1024 grid
    truth = scale * mesh.vertices @ rotation.T + offset
    # the scene's depth was rescaled to the cube's centre: the pose is the truth up to that similarity about the
    # camera, so compare shapes as placed, after removing a common scale about the camera centre
    placed = pose.apply(np.asarray(mesh.vertices))
    eye = np.array([0.0, -DISTANCE, 0.0])
    k = np.linalg.norm(truth - eye, axis=1).mean() / np.linalg.norm(placed - eye, axis=1).mean()
    error = np.linalg.norm((placed - eye) * k - (truth - eye), axis=1).max()
    assert error < 0.01, error


def test_another_shape_is_refused_naming_the_residual():
    mesh = _lamp()
    ball = trimesh.creation.icosphere(subdivisions=3, radius=0.45)
    scene = _scene(ball, np.eye(3), 1.0, np.zeros(3))
    with pytest.raises(MeshError, match=r"residual \d+\.\d voxels"):
        estimate_pose(np.asarray(mesh.vertices), np.asarray(mesh.faces), scene, DISTANCE, max_residual=4.0)


def test_surface_samples_lie_on_the_faces():
    mesh = trimesh.creation.box((1.0, 1.0, 1.0))
    points = surface_samples(np.asarray(mesh.vertices), np.asarray(mesh.faces), 500)
    assert np.allclose(np.abs(points).max(axis=1), 0.5)
