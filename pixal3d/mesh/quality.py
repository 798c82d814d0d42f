"""Export quality metrics: what a viewer and a 3D printer would notice, measured on the output mesh.

* boundary / non-manifold edges: undirected edges used by 1 / more than 2 faces (a closed 2-manifold has none);
* components: connected sets of faces (sharing vertices);
* UV charts: connected sets of faces in the seam-split (UV) mesh, i.e. separate islands in the atlas;
* two-sided Hausdorff and Chamfer distance to the decoded (reference) surface, from ``samples`` points
  drawn uniformly by area on each surface (fixed seed), each measured to the other surface
  (``SurfaceDistance``). Hausdorff = the largest of those distances; Chamfer = the mean of the two
  one-sided means. Both are given in voxels of the decode grid.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import connected_components

from .cleanup import edge_statistics, face_areas
from .distance import SurfaceDistance


@dataclass(frozen=True)
class MeshQuality:
    """The metrics of one exported mesh (see the module docstring); distances in decode voxels."""

    faces: int
    boundary_edges: int
    non_manifold_edges: int
    components: int
    uv_charts: int
    hausdorff_vox: float
    chamfer_vox: float
    samples: int

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return asdict(self)


def edge_counts(faces: np.ndarray) -> tuple[int, int]:
    """``(boundary, non_manifold)`` undirected edge counts."""
    stats = edge_statistics(np.asarray(faces))
    return stats["boundary"], stats["non_manifold"]


def count_components(n_vertices: int, faces: np.ndarray) -> int:
    """Connected components of the faces (two faces connect through a shared vertex)."""
    faces = np.asarray(faces, dtype=np.int64)
    if len(faces) == 0:
        return 0
    rows = np.concatenate([faces[:, 0], faces[:, 1]])
    cols = np.concatenate([faces[:, 1], faces[:, 2]])
    graph = sp.coo_matrix((np.ones(len(rows), np.int8), (rows, cols)), shape=(n_vertices, n_vertices))
    _, label = connected_components(graph, directed=False)
    return len(np.unique(label[faces[:, 0]]))


def count_uv_charts(uv_faces: np.ndarray, n_uv_vertices: int) -> int:
    """Islands of a seam-split mesh: its faces' components (charts share no vertex across a seam)."""
    return count_components(n_uv_vertices, uv_faces)


def _area_cdf_chunks(vertices: np.ndarray, faces: np.ndarray, chunk: int):
    """``(start, cdf)`` of each chunk of faces: the faces' cumulative area, summed in face order from the first face
    (each chunk's sum starts from the last one's end, so the values are ``np.cumsum`` of all the areas, bit for bit)."""
    carry = 0.0
    for s in range(0, len(faces), chunk):
        cdf = np.cumsum(np.r_[carry, face_areas(vertices, faces[s : s + chunk])])[1:]
        carry = cdf[-1]
        yield s, cdf


def sample_surface(vertices: np.ndarray, faces: np.ndarray, count: int, rng: np.random.Generator, *,
                   chunk: int = 1 << 20) -> np.ndarray:
    """``count`` points ``[count, 3]`` (float64) uniform by area on the mesh. The area CDF is walked a chunk of faces
    at a time, twice (its total, then the faces the draws land on): never a face-sized array (0.15 GB at 18M faces),
    the same faces as ``searchsorted`` over the whole CDF."""
    total = 0.0
    for _, cdf in _area_cdf_chunks(vertices, faces, chunk):
        total = cdf[-1]
    draws = rng.uniform(0, total, count)
    face = np.full(count, len(faces) - 1, np.int64)  # a draw past the last face's end (rounding) takes the last
    below = -np.inf
    for s, cdf in _area_cdf_chunks(vertices, faces, chunk):
        here = (draws > below) & (draws <= cdf[-1])  # the first face whose cdf >= the draw is in this chunk
        face[here] = s + np.searchsorted(cdf, draws[here])
        below = cdf[-1]
    u, v = rng.uniform(size=(2, count))
    flip = u + v > 1
    u, v = np.where(flip, 1 - u, u), np.where(flip, 1 - v, v)
    a, b, c = (vertices[faces[face, k]].astype(np.float64) for k in range(3))
    return a + u[:, None] * (b - a) + v[:, None] * (c - a)


def surface_distances(
    vertices: np.ndarray, faces: np.ndarray, reference: SurfaceDistance, *, samples: int, seed: int = 0
) -> tuple[float, float]:
    """Two-sided ``(hausdorff, chamfer)`` in world units between a mesh and ``reference``'s surface."""
    rng = np.random.default_rng(seed)
    to_reference = reference.distance(sample_surface(vertices, faces, samples, rng))
    from_reference = SurfaceDistance(vertices, faces).distance(
        sample_surface(reference.vertices, reference.faces, samples, rng))
    hausdorff = max(float(to_reference.max()), float(from_reference.max()))
    return hausdorff, 0.5 * (float(to_reference.mean()) + float(from_reference.mean()))


def mesh_quality(
    vertices: np.ndarray,
    faces: np.ndarray,
    uv_faces: np.ndarray,
    n_uv_vertices: int,
    reference: SurfaceDistance,
    resolution: int,
    *,
    samples: int = 100_000,
    seed: int = 0,
) -> MeshQuality:
    """All metrics of the output ``(vertices, faces)`` (its atlas: ``uv_faces`` over ``n_uv_vertices``)."""
    boundary, non_manifold = edge_counts(faces)
    hausdorff, chamfer = surface_distances(vertices, faces, reference, samples=samples, seed=seed)
    return MeshQuality(
        faces=len(faces), boundary_edges=boundary, non_manifold_edges=non_manifold,
        components=count_components(len(vertices), faces), uv_charts=count_uv_charts(uv_faces, n_uv_vertices),
        hausdorff_vox=round(hausdorff * resolution, 4), chamfer_vox=round(chamfer * resolution, 4), samples=samples,
    )
