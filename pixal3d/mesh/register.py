"""``--mesh-pose estimate``: place a user's mesh in the image's frame by registering it to MoGe-2's point map.

The cascade's camera (``pixal3d.models.camera``) sits at world ``(0, -d, 0)`` looking along ``+y`` with ``+z`` up, so a
point MoGe-2 sees at camera coordinates ``(x, y, z)`` (OpenCV's: right, down, forward) lies along world
``(x, z, -y)`` from the camera. Its metric scale means nothing to the cube, so the points are scaled to put their
median depth at the cube's centre (and, once fitted, the fit is scaled about the camera so that the mesh's own centre
is: the image does not change); what is left is a similarity (rotation, scale, offset) of the mesh, found by
one-sided ICP from the visible points to samples of the mesh's surface, started from 48 rotations about the mesh's
centre (each of its six axes up, eight turns about it; the bounding box's centre, scaled into the cube as TRELLIS.2's
``preprocess_mesh`` does), the best start then refined on denser samples. The residual (RMS distance of the points to the placed surface) is reported in voxels of
the 1024 grid; a fit above ``MAX_RESIDUAL_VOXELS`` is refused in one line naming it.

This is this project's own method (the public fork that textures external meshes estimates the pose from MoGe-2's
points too); it needs the object's visible surface to pin the pose, so a symmetric shape (a sphere, a plain box) fits
many poses equally: the residual is then low and the pose one of them.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from .user_mesh import CUBE, MeshError, MeshPose

MAX_RESIDUAL_VOXELS = 24.0
"""A fit whose RMS point-to-surface distance exceeds this many voxels of the 1024 grid (2.3 % of the cube) is
refused: the points do not look like this mesh from any pose found."""
SURFACE_SAMPLES = 6_000           # the search from each of the 48 starts
FINE_SAMPLES = 200_000            # the refinement of the best start (their spacing bounds the fit: ~1 voxel)
SCENE_POINTS = 4_000
ICP_ITERATIONS = 12
GRID = 1024


@dataclass(frozen=True)
class ScenePoints:
    """MoGe-2's points of the object, in its camera frame: ``points [K, 3]`` float32 (only valid object pixels)."""

    points: np.ndarray


def world_points(scene: ScenePoints, distance: float) -> np.ndarray:
    """The scene's points in the cascade's world frame, their median depth put at the cube's centre."""
    p = np.asarray(scene.points, dtype=np.float64)
    depth = np.median(p[:, 2])
    if not (np.isfinite(depth) and depth > 0):
        raise MeshError("--mesh-pose estimate: MoGe-2 saw no object points in front of the camera; pass "
                        "--mesh-pose aligned with a mesh in the image's frame")
    k = distance / depth
    return np.stack([p[:, 0] * k, p[:, 2] * k - distance, -p[:, 1] * k], axis=1)


def start_rotations(yaw_steps: int = 8) -> list[np.ndarray]:
    """The ICP's starts: each of the six axes of the mesh turned to the cascade's up (+z), then ``yaw_steps`` turns
    about it (48 rotations, 45 degrees apart about the up axis)."""
    ups = []
    for axis, sign in itertools.product(range(3), (1.0, -1.0)):
        r = np.zeros((3, 3))
        r[2, axis] = sign                       # the mesh's axis goes to +z
        r[0, (axis + 1) % 3] = 1.0
        r[1] = np.cross(r[2], r[0])
        ups.append(r)
    out = []
    for up in ups:
        for k in range(yaw_steps):
            a = 2 * math.pi * k / yaw_steps
            yaw = np.array([[math.cos(a), -math.sin(a), 0.0], [math.sin(a), math.cos(a), 0.0], [0.0, 0.0, 1.0]])
            out.append(yaw @ up)
    return out


def umeyama(source: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, float, np.ndarray]:
    """The similarity ``(R, s, t)`` minimising ``Σ |s R source_i + t - target_i|²`` (Umeyama 1991)."""
    mu_s, mu_t = source.mean(axis=0), target.mean(axis=0)
    a, b = source - mu_s, target - mu_t
    cov = b.T @ a / len(source)
    u, sigma, vt = np.linalg.svd(cov)
    d = np.ones(3)
    if np.linalg.det(u) * np.linalg.det(vt) < 0:
        d[2] = -1.0
    rotation = u @ np.diag(d) @ vt
    variance = (a ** 2).sum() / len(source)
    scale = float((sigma * d).sum() / variance) if variance > 0 else 1.0
    return rotation, scale, mu_t - scale * rotation @ mu_s


def surface_samples(vertices: np.ndarray, faces: np.ndarray, count: int, seed: int = 0) -> np.ndarray:
    """``count`` points on the mesh, area-weighted (a fixed generator: the same mesh gives the same points)."""
    rng = np.random.default_rng(seed)
    tri = vertices[faces]
    area = 0.5 * np.linalg.norm(np.cross(tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0]), axis=1)
    chosen = rng.choice(len(faces), size=count, p=area / area.sum()) if area.sum() > 0 else \
        rng.integers(0, len(faces), count)
    u, v = rng.random(count), rng.random(count)
    flip = u + v > 1
    u[flip], v[flip] = 1 - u[flip], 1 - v[flip]
    t = tri[chosen]
    return t[:, 0] + u[:, None] * (t[:, 1] - t[:, 0]) + v[:, None] * (t[:, 2] - t[:, 0])


def _icp(base: np.ndarray, target: np.ndarray, pose: tuple, iterations: int, trim: float = 1.0) -> tuple:
    """One-sided ICP from ``target`` to the similarity-moved ``base`` samples (``trim``: the share of the closest
    pairs each fit keeps); -> ``(rms distance, R, s, t)``."""
    from scipy.spatial import cKDTree

    rotation, scale, offset = pose
    for _ in range(iterations):
        dist, nearest = cKDTree(scale * base @ rotation.T + offset).query(target, workers=-1)
        keep = dist <= np.quantile(dist, trim)
        rotation, scale, offset = umeyama(base[nearest[keep]], target[keep])
    dist, _ = cKDTree(scale * base @ rotation.T + offset).query(target, workers=-1)
    return float(np.sqrt((dist ** 2).mean())), rotation, scale, offset


def _surface_residual(vertices: np.ndarray, faces: np.ndarray, centre: np.ndarray, size: float,
                      rotation: np.ndarray, scale: float, offset: np.ndarray, target: np.ndarray) -> float:
    """RMS distance (voxels of the 1024 grid) of the points to the placed mesh's faces (not to its samples)."""
    from .distance import SurfaceDistance

    placed = scale * ((vertices - centre) * (2 * CUBE * 0.99999 / size)) @ rotation.T + offset
    dist = SurfaceDistance(placed, faces, neighbours=min(8, len(vertices))).distance(target)
    return float(np.sqrt((dist ** 2).mean())) * GRID / (2 * CUBE)


def estimate_pose(vertices: np.ndarray, faces: np.ndarray, scene: ScenePoints, distance: float, *,
                  name: str = "mesh", max_residual: float = MAX_RESIDUAL_VOXELS) -> MeshPose:
    """The pose placing the mesh (grid frame) so MoGe-2's points lie on it, or ``MeshError`` naming the residual."""
    target = world_points(scene, distance)
    rng = np.random.default_rng(1)
    if len(target) > SCENE_POINTS:
        target = target[rng.choice(len(target), SCENE_POINTS, replace=False)]
    if len(target) < 16:
        raise MeshError(f"--mesh {name}: MoGe-2 gave {len(target)} object points, too few to estimate a pose; pass "
                        f"--mesh-pose aligned with a mesh in the image's frame")
    low, high = vertices.min(axis=0), vertices.max(axis=0)
    centre, size = (low + high) / 2, float((high - low).max())
    base = (surface_samples(vertices, faces, SURFACE_SAMPLES) - centre) * (2 * CUBE * 0.99999 / size)
    spread = float(np.sqrt(((target - target.mean(axis=0)) ** 2).sum(axis=1).mean()))
    best = None
    for start in start_rotations():
        placed = base @ start.T
        s0 = spread / max(float(np.sqrt((placed ** 2).sum(axis=1).mean())), 1e-12)
        pose = _icp(base, target, (start, s0, target.mean(axis=0) - s0 * placed.mean(axis=0)), ICP_ITERATIONS)
        if best is None or pose[0] < best[0]:
            best = pose
    fine = (surface_samples(vertices, faces, FINE_SAMPLES, seed=2) - centre) * (2 * CUBE * 0.99999 / size)
    _, rotation, scale, offset = _icp(fine, target, best[1:], 2 * ICP_ITERATIONS, trim=0.95)
    residual = _surface_residual(vertices, faces, centre, size, rotation, scale, offset, target)
    if not math.isfinite(residual) or residual > max_residual:
        raise MeshError(f"--mesh {name}: its pose could not be estimated from the image (residual {residual:.1f} "
                        f"voxels, more than {max_residual:g}): the image may not show this mesh; pass --mesh-pose "
                        f"aligned with a mesh in the image's frame")
    # the samples were centred and scaled first: fold that into the pose of the raw vertices
    pre = 2 * CUBE * 0.99999 / size
    total_scale = scale * pre
    total_offset = offset - total_scale * rotation @ centre
    # the points' depth scale was a guess (their median at the cube's centre): scale the whole fit about the camera,
    # which moves nothing in the image, so that the placed mesh's own centre is at the cube's centre depth
    placed = total_scale * vertices @ rotation.T + total_offset
    eye = np.array([0.0, -distance, 0.0])
    depth = ((placed.min(axis=0) + placed.max(axis=0)) / 2)[1] + distance
    factor = distance / depth if depth > 0 else 1.0
    total_scale, total_offset = factor * total_scale, eye + factor * (total_offset - eye)
    return MeshPose("estimate", tuple(map(tuple, rotation.tolist())), float(total_scale),
                    tuple(float(x) for x in total_offset), residual * factor)
