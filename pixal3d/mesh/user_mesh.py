"""A user's mesh to texture (``--mesh``): read, checked, and placed in the cascade's frame.

``read_mesh`` takes a GLB/glTF, OBJ or PLY file (a scene's meshes joined, each with its node transform), keeping its
UVs when it has one set for every vertex, and refuses in one line (``MeshError``) what cannot be textured: a file
that is not a mesh, no faces (a point cloud), NaN or infinite vertices, a degenerate extent, more faces than
``MAX_FACES``, more than ``NON_MANIFOLD_SHARE`` of its edges non-manifold (shared by more than two faces: a triangle
soup, not a surface). It reads only the file: no weight is touched.

Frames: the file's coordinates are glTF's (+Y up, as the exports of this project and Blender's glTF exporter).
The cascade's grid has +Y up too, and this project's export writes it turned half about +Y (``pixal3d.mesh.glb``'s
``INTERNAL_TO_GLB``: ``(x, y, z) -> (-x, y, -z)``, Pixal3D's own output frame); ``to_grid`` undoes that, so this
project's own GLB comes back in the frame it was decoded in. (TRELLIS.2's ``preprocess_mesh`` swaps ``(x, -z, y)``
instead: its grid is +Z up, and it centres and scales every mesh, which a pixel-aligned flow cannot: the mesh must
stay where the image sees it.) ``MeshPose`` maps the user's (grid-frame) vertices into the cascade's unit cube: the identity for
``aligned`` (the mesh already is in the image's frame, as a shape-only output of this project is), a similarity for
``estimate`` (``pixal3d.mesh.register``).
"""
from __future__ import annotations

import hashlib
import io
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pixal3d.models.preprocess import ImageError

from .glb import INTERNAL_TO_GLB

logger = logging.getLogger(__name__)

MESH_SUFFIXES = (".glb", ".gltf", ".obj", ".ply")
MAX_FACES = 20_000_000
"""More faces than this are refused (a 1024 grid's decoded surface has about 9M; the bake reads every face)."""
CUBE = 0.5
"""The cascade's grid spans ``[-CUBE, CUBE]`` per axis."""
NON_MANIFOLD_SHARE = 0.01
"""A mesh with more than this share of non-manifold edges (more than two faces on one edge) is refused as a triangle
soup; fewer are textured as they are (with a warning): the dual grid takes any surface, and the export's own meshes
may have a few where two sheets touch."""


class MeshError(ImageError):
    """A mesh that cannot be textured; the message is one line naming the file and what to do. An ``ImageError``:
    every front end reports an unusable input of a run the same way, an image or its mesh."""


@dataclass
class UserMesh:
    """A user's mesh in the cascade's grid frame (+Z up): ``vertices [V, 3]`` float64, ``faces [F, 3]`` int64,
    ``uvs [V, 2]`` float32 (glTF's and the baker's: v = 0 at the image's top row) or None, ``source`` (the file's name)."""

    vertices: np.ndarray
    faces: np.ndarray
    uvs: np.ndarray | None
    source: str
    extras: dict = field(default_factory=dict)  # ``note``: a shape-only GLB's latent note (``latent_note``)
    pose: str = "aligned"                        # how the run places it: ``aligned`` or ``estimate`` (``MeshPose``)

    def digest(self) -> str:
        """sha256 of the geometry and UVs as read (what keys a run on it)."""
        h = hashlib.sha256()
        for part in (self.vertices, self.faces, self.uvs):
            if part is not None:
                h.update(np.ascontiguousarray(part).tobytes())
        return h.hexdigest()

    def extent(self) -> tuple[np.ndarray, np.ndarray]:
        return self.vertices.min(axis=0), self.vertices.max(axis=0)


def to_grid(points: np.ndarray) -> np.ndarray:
    """The file's glTF frame -> the grid's: ``(x, y, z) -> (-x, y, -z)``, the inverse of the export's
    ``INTERNAL_TO_GLB`` (its own inverse: a half turn about +Y)."""
    return points @ INTERNAL_TO_GLB.T


def read_mesh(path: str | Path) -> UserMesh:
    """The mesh in ``path`` in the grid's frame, checked (``MeshError``: one line)."""
    path = Path(path)
    name = path.name
    if path.suffix.lower() not in MESH_SUFFIXES:
        raise MeshError(f"--mesh {name}: not a mesh file this reads ({', '.join(MESH_SUFFIXES)})")
    if not path.is_file():
        raise MeshError(f"--mesh {name}: {'is a folder' if path.exists() else 'does not exist'}")
    import trimesh

    glb = path.read_bytes() if path.suffix.lower() == ".glb" else None  # read once: the mesh and its note
    try:
        loaded = trimesh.load(io.BytesIO(glb), file_type="glb", process=False, force=None) if glb is not None \
            else trimesh.load(str(path), process=False, force=None)
    except Exception as err:  # noqa: BLE001 - trimesh raises many kinds for a broken file
        raise MeshError(f"--mesh {name}: cannot be read as a mesh ({type(err).__name__}: "
                        f"{str(err).splitlines()[0][:120] if str(err) else 'no detail'})") from None
    extras = {}
    if glb is not None:  # a shape-only output of this project carries its latent
        from .latent_note import read_note

        note = read_note(glb)
        if note is not None:
            extras["note"] = note
    if isinstance(loaded, trimesh.Scene):
        geometries = [g for g in loaded.dump(concatenate=False) if isinstance(g, trimesh.Trimesh)]
        points = [g for g in loaded.geometry.values() if isinstance(g, trimesh.PointCloud)]
        if not geometries:
            kind = "a point cloud" if points else "no mesh"
            raise MeshError(f"--mesh {name}: holds {kind}, no faces to texture; give a triangle mesh")
        mesh = geometries[0] if len(geometries) == 1 else _joined(geometries)
    elif isinstance(loaded, trimesh.Trimesh):
        mesh = loaded
    elif isinstance(loaded, trimesh.PointCloud):
        raise MeshError(f"--mesh {name}: is a point cloud (no faces); give a triangle mesh")
    else:
        raise MeshError(f"--mesh {name}: holds no triangle mesh ({type(loaded).__name__})")
    vertices = np.asarray(mesh.vertices, dtype=np.float64)
    faces = np.asarray(mesh.faces, dtype=np.int64)
    uvs = _uvs(mesh, len(vertices))
    check_mesh(vertices, faces, name)
    return UserMesh(to_grid(vertices), faces, uvs, name, extras)


def check_mesh(vertices: np.ndarray, faces: np.ndarray, name: str) -> None:
    """``MeshError`` (one line) for a mesh that cannot be textured (see the module's docstring)."""
    if len(faces) == 0:
        raise MeshError(f"--mesh {name}: has no faces ({len(vertices)} vertices: a point cloud?); give a triangle mesh")
    if len(faces) > MAX_FACES:
        raise MeshError(f"--mesh {name}: has {len(faces):,} faces, more than {MAX_FACES:,}; simplify it first")
    if not np.isfinite(vertices).all():
        bad = int((~np.isfinite(vertices)).any(axis=1).sum())
        raise MeshError(f"--mesh {name}: {bad} vertices are NaN or infinite; fix or remove them")
    if faces.min() < 0 or faces.max() >= len(vertices):
        raise MeshError(f"--mesh {name}: faces index vertices that do not exist (0..{len(vertices) - 1})")
    used = vertices[np.unique(faces)]
    extent = used.max(axis=0) - used.min(axis=0)
    if not (extent.max() > 0):
        raise MeshError(f"--mesh {name}: its faces span no volume (every vertex in one point)")
    edges = np.sort(faces[:, [0, 1, 1, 2, 2, 0]].reshape(-1, 2), axis=1)
    _, counts = np.unique(edges[:, 0] * len(vertices) + edges[:, 1], return_counts=True)
    shared = int((counts > 2).sum())
    if shared > NON_MANIFOLD_SHARE * len(counts):
        raise MeshError(f"--mesh {name}: {shared} of its {len(counts)} edges are non-manifold (shared by more than two "
                        f"faces): not one surface; make it manifold first (e.g. Blender: Select > All by Trait > Non "
                        f"Manifold, then split or delete)")
    if shared:
        logger.warning("--mesh %s: %d non-manifold edges (of %d); textured as they are", name, shared, len(counts))


def _uvs(mesh, count: int) -> np.ndarray | None:
    uv = getattr(getattr(mesh, "visual", None), "uv", None)
    if uv is None:
        return None
    uv = np.asarray(uv, dtype=np.float32)
    if uv.shape != (count, 2) or not np.isfinite(uv).all():
        return None
    return np.stack([uv[:, 0], 1 - uv[:, 1]], axis=1)  # trimesh's v up -> the baker's (row 0 at v = 0, glTF's)


def _joined(meshes: list) -> object:
    """Several meshes as one (UVs kept only when every part has them)."""
    import trimesh

    offsets = np.cumsum([0] + [len(m.vertices) for m in meshes[:-1]])
    vertices = np.concatenate([np.asarray(m.vertices) for m in meshes])
    faces = np.concatenate([np.asarray(m.faces) + o for m, o in zip(meshes, offsets)])
    uvs = [_uvs(m, len(m.vertices)) for m in meshes]
    joined = trimesh.Trimesh(vertices=vertices, faces=faces, process=False)
    if all(u is not None for u in uvs):
        joined.visual = trimesh.visual.TextureVisuals(uv=np.concatenate(uvs))
    return joined


@dataclass(frozen=True)
class MeshPose:
    """How the user's vertices (grid frame) map into the cascade's cube: ``grid = scale · rotation @ v + offset``.
    ``kind``: ``aligned`` (the identity), ``estimate`` (registered to the image) or ``normalize`` (centred and scaled
    into the cube); ``residual``: the registration's RMS distance in voxels of the 1024 grid (0 otherwise)."""

    kind: str = "aligned"
    rotation: tuple[tuple[float, ...], ...] = ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))
    scale: float = 1.0
    offset: tuple[float, float, float] = (0.0, 0.0, 0.0)
    residual: float = 0.0

    def fingerprint_parts(self) -> dict:
        """The pose as numbers (the run's fingerprints): its kind's index (aligned, estimate, normalize) and the
        similarity."""
        return {"kind": ("aligned", "estimate", "normalize").index(self.kind), "rotation": np.asarray(self.rotation, dtype=np.float64),
                "scale": float(self.scale), "offset": np.asarray(self.offset, dtype=np.float64),
                "residual": float(self.residual)}

    def apply(self, points: np.ndarray) -> np.ndarray:
        if self.kind == "aligned":
            return points
        return self.scale * points @ np.asarray(self.rotation).T + np.asarray(self.offset)


def check_in_cube(points: np.ndarray, name: str, pose: str, tolerance: float = 0.0) -> None:
    """``MeshError`` unless the mesh, placed, lies in the cascade's cube (give or take ``tolerance``: a decoded
    surface's dual vertices may lie up to half a voxel outside it)."""
    low, high = points.min(axis=0), points.max(axis=0)
    if low.min() < -CUBE - tolerance or high.max() > CUBE + tolerance:
        span = ", ".join(f"{a:.3f}..{b:.3f}" for a, b in zip(low, high))
        hint = ("its coordinates are used as they are (--mesh-pose aligned): give a mesh in the image's frame, as "
                "--shape-only writes it, or pass --mesh-pose estimate") if pose == "aligned" else \
            "the pose estimated places it outside the grid; crop the image tighter around the object"
        raise MeshError(f"--mesh {name}: spans x/y/z {span} (grid frame), outside the [-0.5, 0.5] cube; {hint}")
