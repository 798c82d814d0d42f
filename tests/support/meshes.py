"""Small meshes for the export's tests, and what a depth camera sees of one (the pose estimate's tests)."""
from __future__ import annotations

import numpy as np
import trimesh

from pixal3d.mesh.register import ScenePoints


def grid_mesh(n: int) -> tuple[np.ndarray, np.ndarray]:
    """A wavy n×n grid of 2(n-1)² triangles."""
    x, y = np.meshgrid(np.arange(n, dtype=np.float32), np.arange(n, dtype=np.float32))
    v = np.stack([x.ravel(), y.ravel(), np.sin(x.ravel() * 0.3) * np.cos(y.ravel() * 0.2)], 1)
    i = (np.arange(n - 1)[:, None] * n + np.arange(n - 1)[None, :]).ravel()
    f = np.concatenate([np.stack([i, i + 1, i + n], 1), np.stack([i + 1, i + n + 1, i + n], 1)]).astype(np.int32)
    return v, f


DISTANCE = 1.1  # the cascade's camera distance for a ~49 degree field of view (camera_from_fov)


def lamp() -> trimesh.Trimesh:
    """An asymmetric shape (a box with a post and an arm): one pose fits its visible side."""
    base = trimesh.creation.box((0.6, 0.4, 0.1))
    post = trimesh.creation.box((0.08, 0.08, 0.6))
    post.apply_translation((0.2, 0.1, 0.35))
    arm = trimesh.creation.box((0.4, 0.06, 0.06))
    arm.apply_translation((0.0, 0.1, 0.62))
    return trimesh.util.concatenate([base, post, arm])


def rotation(yaw: float, pitch: float) -> np.ndarray:
    cy, sy, cp, sp = np.cos(yaw), np.sin(yaw), np.cos(pitch), np.sin(pitch)
    rz = np.array([[cy, -sy, 0], [sy, cy, 0], [0, 0, 1]])
    rx = np.array([[1, 0, 0], [0, cp, -sp], [0, sp, cp]])
    return rz @ rx


def scene_points(mesh: trimesh.Trimesh, rotation: np.ndarray, scale: float, offset: np.ndarray,
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
