"""``--mesh-pose estimate``: the registration of MoGe-2-like points to a mesh recovers a known pose, and refuses a
scene that is not the mesh (pixal3d.mesh.register)."""
from __future__ import annotations

import numpy as np
import pytest
import trimesh

from pixal3d.mesh.register import estimate_pose, surface_samples
from pixal3d.mesh.user_mesh import MeshError
from tests.support.meshes import DISTANCE, lamp, rotation, scene_points


def test_a_known_pose_is_recovered_and_places_the_mesh_on_the_points():
    mesh = lamp()
    turn, scale, offset = rotation(0.7, 0.25), 0.9, np.array([0.03, -0.02, 0.01])
    pose = estimate_pose(np.asarray(mesh.vertices), np.asarray(mesh.faces), scene_points(mesh, turn, scale, offset),
                         DISTANCE)
    assert pose.kind == "estimate" and pose.residual < 2.0  # voxels of the 1024 grid
    truth = scale * mesh.vertices @ turn.T + offset
    # the scene's depth was rescaled to the cube's centre: the pose is the truth up to that similarity about the
    # camera, so compare shapes as placed, after removing a common scale about the camera centre
    placed = pose.apply(np.asarray(mesh.vertices))
    eye = np.array([0.0, -DISTANCE, 0.0])
    k = np.linalg.norm(truth - eye, axis=1).mean() / np.linalg.norm(placed - eye, axis=1).mean()
    error = np.linalg.norm((placed - eye) * k - (truth - eye), axis=1).max()
    assert error < 0.01, error


def test_another_shape_is_refused_naming_the_residual():
    mesh = lamp()
    ball = trimesh.creation.icosphere(subdivisions=3, radius=0.45)
    scene = scene_points(ball, np.eye(3), 1.0, np.zeros(3))
    with pytest.raises(MeshError, match=r"residual \d+\.\d voxels"):
        estimate_pose(np.asarray(mesh.vertices), np.asarray(mesh.faces), scene, DISTANCE, max_residual=4.0)


def test_surface_samples_lie_on_the_faces():
    mesh = trimesh.creation.box((1.0, 1.0, 1.0))
    points = surface_samples(np.asarray(mesh.vertices), np.asarray(mesh.faces), 500)
    assert np.allclose(np.abs(points).max(axis=1), 0.5)
