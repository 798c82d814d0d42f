"""UV atlas: near-flat clusters of faces, xatlas charting per cluster, one global packing.

xatlas on a whole 10⁵–10⁶-face mesh takes tens of minutes; on many small near-flat clusters its
cost stays small (CuMesh's recipe). A cluster is a connected set of faces (across manifold edges)
sharing a coarse grid cell and the nearest of the 6 axis directions to their normal (normal cone
≤ 54.7° half-angle); clusters below ``min_faces`` join a neighbour.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import xatlas
from scipy.sparse.csgraph import connected_components

from .cleanup import EdgeTable

log = logging.getLogger(__name__)

_TARGET_FILL = 0.5  # charts' share of the atlas assumed when choosing the texel density


@dataclass(frozen=True)
class UvMesh:
    """A mesh split along UV seams: ``vertex_map [V']`` (source vertex of each new vertex, int64),
    ``faces [F, 3]`` int32 (same face order as the input), ``uvs [V', 2]`` float32 in [0, 1]."""

    vertex_map: np.ndarray
    faces: np.ndarray
    uvs: np.ndarray
    atlas_size: tuple[int, int]
    chart_count: int


def face_normals(vertices: np.ndarray, faces: np.ndarray) -> np.ndarray:
    """Unit face normals (float64); zero for degenerate faces."""
    v = vertices.astype(np.float64, copy=False)
    n = np.cross(v[faces[:, 1]] - v[faces[:, 0]], v[faces[:, 2]] - v[faces[:, 0]])
    return n / np.maximum(np.linalg.norm(n, axis=1, keepdims=True), 1e-30)


def _face_pairs(faces: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    table = EdgeTable.build(faces)
    pairs = table.half_edges_of(2)
    return table.face_of(pairs[:, 0]), table.face_of(pairs[:, 1])


def cluster_faces(vertices: np.ndarray, faces: np.ndarray, *, cell: float, min_faces: int = 16) -> np.ndarray:
    """Cluster id per face (int64, 0..C-1): connected faces with the same cell and axis direction."""
    nf = len(faces)
    n = face_normals(vertices, faces)
    axis = np.abs(n).argmax(1)
    direction = axis * 2 + (n[np.arange(nf), axis] < 0)
    centroid = vertices[faces].mean(1)
    g = np.floor((centroid - centroid.min(0)) / cell).astype(np.int64)
    dims = g.max(0) + 1
    label = ((g[:, 0] * dims[1] + g[:, 1]) * dims[2] + g[:, 2]) * 6 + direction
    a, b = _face_pairs(faces)
    same = label[a] == label[b]
    graph = sp.coo_matrix((np.ones(int(same.sum()), np.int8), (a[same], b[same])), shape=(nf, nf))
    _, comp = connected_components(graph, directed=False)
    # Small clusters join the cluster across one of their manifold edges (a few rounds settle chains).
    for _ in range(4):
        size = np.bincount(comp)
        small_a = (size[comp[a]] < min_faces) & (comp[a] != comp[b])
        small_b = (size[comp[b]] < min_faces) & (comp[a] != comp[b])
        if not (small_a.any() or small_b.any()):
            break
        target = np.arange(len(size))
        target[comp[a[small_a]]] = comp[b[small_a]]
        target[comp[b[small_b]]] = comp[a[small_b]]
        # Follow chains of merges so that two small neighbours do not just swap ids.
        for _ in range(32):
            nxt = target[target]
            if np.array_equal(nxt, target):
                break
            target = nxt
        comp = target[comp]
    return np.unique(comp, return_inverse=True)[1]


def uv_unwrap(
    vertices: np.ndarray, faces: np.ndarray, *, cell: float, padding: int = 2, texture_size: int = 0
) -> UvMesh:
    """Chart each face cluster with xatlas and pack all charts into a single atlas.

    With ``texture_size`` the texel density is set so that the atlas comes out near that size, which
    makes ``padding`` mean texels of the final texture (xatlas's own choice packs small charts at a
    lower density, so the padding eats more of the texture). The atlas is checked to be exactly one.
    """
    cluster = cluster_faces(vertices, faces, cell=cell)
    order = np.argsort(cluster, kind="stable")
    bounds = np.searchsorted(cluster[order], np.arange(cluster.max() + 2))
    atlas = xatlas.Atlas()
    members = []
    for c in range(len(bounds) - 1):
        face_ids = order[bounds[c] : bounds[c + 1]]
        verts, local = np.unique(faces[face_ids], return_inverse=True)
        # Keyword arguments: an old binding swapped the Python names of normals and uvs.
        atlas.add_mesh(
            positions=np.ascontiguousarray(vertices[verts], dtype=np.float32),
            indices=np.ascontiguousarray(local.reshape(-1, 3), dtype=np.uint32),
        )
        members.append((face_ids, verts))
    chart_options = xatlas.ChartOptions()
    chart_options.max_iterations = 1
    pack_options = xatlas.PackOptions()
    pack_options.padding = padding
    pack_options.bilinear = True
    pack_options.resolution = 0  # > 0 together with texels_per_unit may split into several atlases
    if texture_size > 0:
        area = 0.5 * np.linalg.norm(
            np.cross(vertices[faces[:, 1]] - vertices[faces[:, 0]], vertices[faces[:, 2]] - vertices[faces[:, 0]]),
            axis=1,
        ).sum()
        pack_options.texels_per_unit = float(texture_size * np.sqrt(_TARGET_FILL / max(area, 1e-30)))
    atlas.generate(chart_options=chart_options, pack_options=pack_options)
    if atlas.atlas_count != 1:
        raise RuntimeError(f"xatlas produced {atlas.atlas_count} atlases; expected exactly one")
    out_map, out_faces, out_uvs = [], np.empty((len(faces), 3), np.int64), []
    offset = 0
    for c, (face_ids, verts) in enumerate(members):
        vmap, idx, uv = atlas[c]
        out_map.append(verts[vmap])
        out_faces[face_ids] = idx.astype(np.int64) + offset
        out_uvs.append(uv)
        offset += len(vmap)
    log.info("uv atlas: %d clusters, %d charts, %dx%d", len(members), atlas.chart_count, atlas.width, atlas.height)
    return UvMesh(
        vertex_map=np.concatenate(out_map),
        faces=out_faces.astype(np.int32),
        uvs=np.concatenate(out_uvs).astype(np.float32),
        atlas_size=(int(atlas.width), int(atlas.height)),
        chart_count=int(atlas.chart_count),
    )
