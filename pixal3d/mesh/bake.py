"""Texture baking without a GPU: UV rasterization, closest point on the source surface, sparse
trilinear sampling of the PBR voxels, nearest-texel gutter fill. Every per-texel pass is chunked.

Conventions (nvdiffrast's, as upstream bakes them): texel ``(x, y)`` ↔ ``u = (x + 0.5) / W``,
``v = (y + 0.5) / H``; image row 0 is v ≈ 0. Voxel ``c`` holds its attribute at its centre
``c + 0.5`` (flex_gemm ``grid_sample_3d`` semantics).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from .distance import z_order
from .fields import PBR_LAYOUT
from .settings import PROJECTIONS
from .sparse_index import SparseIndex
from .workers import ordered_map, resolve_workers

log = logging.getLogger(__name__)

_CANDIDATES_PER_CHUNK = 1 << 20  # ~70 B of temporaries each
TEXEL_CHUNK = 1 << 18  # texels baked at once, shared out among the threads' chunks (~0.4 KB of temporaries each)


def rasterize_uv(
    uvs: np.ndarray, faces: np.ndarray, width: int, height: int, *, eps: float = 1e-6
) -> tuple[np.ndarray, np.ndarray]:
    """Face id per texel (``[H, W]`` int32, -1 where empty) and barycentrics (``[H, W, 2]`` float32,
    weights of the face's vertices 1 and 2), sampled at texel centres.

    Triangles are binned by the power-of-two side of their texel bounding box and tested in chunks of
    at most 2²⁰ candidate texels, so one large triangle never inflates the work of the others.
    """
    face_id = np.full((height, width), -1, np.int32)
    bary = np.zeros((height, width, 2), np.float32)
    scale = np.array([width, height], np.float64)
    tri = uvs[faces].astype(np.float64) * scale - 0.5  # [F, 3, 2], texel-centre units
    lo = np.ceil(tri.min(1) - eps).astype(np.int64)
    hi = np.floor(tri.max(1) + eps).astype(np.int64)
    lo = np.maximum(lo, 0)
    hi = np.minimum(hi, [width - 1, height - 1])
    extent = (hi - lo + 1).max(1)
    e1, e2 = tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0]
    det = e1[:, 0] * e2[:, 1] - e1[:, 1] * e2[:, 0]
    usable = (extent > 0) & (np.abs(det) > 1e-12)
    side = np.where(usable, 1 << np.ceil(np.log2(np.maximum(extent, 1))).astype(np.int64), 0)
    for s in np.unique(side[side > 0]):
        ids = np.flatnonzero(side == s)
        step = max(1, _CANDIDATES_PER_CHUNK // int(s * s))
        grid = np.stack(np.meshgrid(np.arange(s), np.arange(s), indexing="xy"), -1).reshape(-1, 2)
        for start in range(0, len(ids), step):
            f = ids[start : start + step]
            px = lo[f, None, :] + grid[None]  # [n, s², 2] texel indices
            q = px - tri[f, None, 0]
            b1 = (q[..., 0] * e2[f, None, 1] - q[..., 1] * e2[f, None, 0]) / det[f, None]
            b2 = (e1[f, None, 0] * q[..., 1] - e1[f, None, 1] * q[..., 0]) / det[f, None]
            inside = (b1 >= -eps) & (b2 >= -eps) & (b1 + b2 <= 1 + eps) & np.all(px <= hi[f, None, :], axis=-1)
            rows, cols = np.nonzero(inside)
            x, y = px[rows, cols, 0], px[rows, cols, 1]
            face_id[y, x] = f[rows]
            bary[y, x, 0] = b1[rows, cols]
            bary[y, x, 1] = b2[rows, cols]
    return face_id, bary


def closest_point_on_triangles(p: np.ndarray, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Closest point to ``p [..., 3]`` on triangles ``(a, b, c) [..., 3]``: plane projection when it
    falls inside, otherwise the nearest of the three clamped edge projections."""
    n = np.cross(b - a, c - a)
    nn = np.maximum((n * n).sum(-1, keepdims=True), 1e-30)
    proj = p - ((p - a) * n).sum(-1, keepdims=True) / nn * n
    # inside test: same-side of each edge w.r.t. the normal
    inside = (
        ((np.cross(b - a, proj - a) * n).sum(-1) >= 0)
        & ((np.cross(c - b, proj - b) * n).sum(-1) >= 0)
        & ((np.cross(a - c, proj - c) * n).sum(-1) >= 0)
    )
    best = proj
    best_d = np.where(inside, ((p - proj) ** 2).sum(-1), np.inf)
    for s, e in ((a, b), (b, c), (c, a)):
        d = e - s
        t = np.clip(((p - s) * d).sum(-1, keepdims=True) / np.maximum((d * d).sum(-1, keepdims=True), 1e-30), 0, 1)
        q = s + t * d
        dist = ((p - q) ** 2).sum(-1)
        better = dist < best_d
        best = np.where(better[..., None], q, best)
        best_d = np.where(better, dist, best_d)
    return best




class SurfaceProjector:
    """Moves points onto a reference triangle mesh (the decoded surface before simplification).

    Both modes start from the nearest reference vertex (cKDTree):
    * ``"exact"``: the closest point over that vertex's incident faces (up to ``max_valence``);
    * ``"tangent"`` (fast): projection onto the vertex's tangent plane, the shift limited to
      ``max_shift``. Vertex normals are sign-aligned per vertex, so an unoriented reference works;
      the error against the exact closest point is second order in the distance (sub-voxel here).
    """

    def __init__(
        self,
        vertices: np.ndarray,
        faces: np.ndarray,
        *,
        mode: str = "tangent",
        max_shift: float = np.inf,
        max_valence: int = 12,
    ) -> None:
        if mode not in PROJECTIONS:
            raise ValueError(f"projection mode must be one of {PROJECTIONS}, got {mode!r}")
        self.mode = mode
        self.max_shift = max_shift
        self.vertices = vertices.astype(np.float32, copy=False)
        self.faces = faces if mode == "exact" else None  # "tangent" needs only the vertex normals built below
        from scipy.spatial import (
            cKDTree,  # 0.4 s to import: only when a mesh is exported
        )

        # the per-vertex structures before the tree: their build's temporaries (~45 B per vertex) and the tree's
        # (its float64 copy of the vertices) are then never held together
        if mode == "exact":
            self.incident = self._incident_faces(len(vertices), faces, max_valence)
        else:
            self.normals = self._aligned_normals(self.vertices, faces)
        self.tree = cKDTree(self.vertices, balanced_tree=False, compact_nodes=False, leafsize=32)

    @staticmethod
    def _incident_faces(nv: int, faces: np.ndarray, max_valence: int) -> np.ndarray:
        owner = faces.reshape(-1)
        order = np.argsort(owner, kind="stable")
        start = np.searchsorted(owner[order], np.arange(nv))
        count = np.bincount(owner, minlength=nv)
        k = np.arange(max_valence)
        slot = start[:, None] + np.minimum(k, np.maximum(count[:, None] - 1, 0))
        incident = (order[np.minimum(slot, len(order) - 1)] // 3).astype(np.int32)
        return np.where(count[:, None] > 0, incident, -1)  # [V, K], repeats pad short fans

    @staticmethod
    def _aligned_normals(vertices: np.ndarray, faces: np.ndarray, *, chunk: int = 1 << 20) -> np.ndarray:
        """Area-weighted vertex normals with each face's normal sign-aligned to one incident face."""

        def normals_of(f: np.ndarray) -> np.ndarray:
            a, b, c = vertices[f[:, 0]], vertices[f[:, 1]], vertices[f[:, 2]]
            return np.cross(b - a, c - a)

        nv = len(vertices)
        ref = np.zeros(nv, np.int64)
        ref[faces.reshape(-1)] = np.repeat(np.arange(len(faces)), 3)
        ref_normal = np.empty((nv, 3), vertices.dtype)  # [V, 3] the normal each vertex aligns to
        for s in range(0, nv, chunk):  # in chunks: the corners' coordinates of every vertex at once are ~0.7 GB
            ref_normal[s : s + chunk] = normals_of(faces[ref[s : s + chunk]])
        del ref
        out = np.zeros((nv, 3))
        for s in range(0, len(faces), chunk):
            f = faces[s : s + chunk]
            n = normals_of(f)
            for k in range(3):
                corner = f[:, k]
                sign = np.where(np.einsum("ij,ij->i", n, ref_normal[corner]) < 0, -1.0, 1.0)
                for c in range(3):
                    out[:, c] += np.bincount(corner, weights=sign * n[:, c], minlength=nv)
        del ref_normal
        # normalised a chunk of rows at a time (each row's norm is its own three values': the same bits as whole),
        # so the float64 quotient and squares of every vertex (~0.4 GB at 9M) are never held beside the sums
        unit = np.empty((nv, 3), np.float32)
        for s in range(0, nv, chunk):
            o = out[s : s + chunk]
            unit[s : s + chunk] = o / np.maximum(np.linalg.norm(o, axis=1, keepdims=True), 1e-30)
        return unit

    def project(self, points: np.ndarray, *, chunk: int = 1 << 16) -> np.ndarray:
        """``[N, 3]`` float32 points moved onto the reference surface."""
        if len(points) == 0:
            return np.zeros((0, 3), np.float32)
        fn = self._project_exact if self.mode == "exact" else self._project_tangent
        return np.concatenate([fn(points[s : s + chunk]) for s in range(0, len(points), chunk)])

    def _project_tangent(self, points: np.ndarray) -> np.ndarray:
        _, nearest = self.tree.query(points, k=1, workers=-1)
        n = self.normals[nearest]
        shift = np.einsum("ij,ij->i", points - self.vertices[nearest], n)
        shift = np.clip(shift, -self.max_shift, self.max_shift)
        return (points - shift[:, None] * n).astype(np.float32)

    def _project_exact(self, points: np.ndarray) -> np.ndarray:
        _, nearest = self.tree.query(points, k=1, workers=-1)
        fids = self.incident[nearest]  # [N, K]
        valid = fids >= 0
        tri = self.vertices[self.faces[np.maximum(fids, 0)]].astype(np.float64)  # [N, K, 3, 3]
        p = points.astype(np.float64)[:, None, :]
        q = closest_point_on_triangles(p, tri[..., 0, :], tri[..., 1, :], tri[..., 2, :])
        d = np.where(valid, ((q - p) ** 2).sum(-1), np.inf)
        best = d.argmin(1)
        out = q[np.arange(len(points)), best]
        lonely = ~valid.any(1)
        out[lonely] = self.vertices[nearest[lonely]]
        return out.astype(np.float32)


def sample_trilinear(
    index: SparseIndex, attrs: np.ndarray, points: np.ndarray, resolution: int
) -> tuple[np.ndarray, np.ndarray]:
    """Trilinear sample of sparse voxel attributes at world ``points [N, 3]`` (grid origin -0.5, size 1/R).

    Voxel centres sit at ``coord + 0.5``; weights are renormalized over the corners that exist, and the
    result is 0 with no existing corner. Returns ``(values [N, C] float32, support [N] float32)``.
    """
    values, support, _ = sample_with_normals(index, attrs, points, resolution)
    return values, support


def sample_with_normals(
    index: SparseIndex, attrs: np.ndarray, points: np.ndarray, resolution: int, *,
    normals: np.ndarray | None = None, along: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``sample_trilinear``, and with ``normals [M, 3]`` (per voxel, unoriented) and ``along [N, 3]``, ``normal`` is their blend with each
    corner's sign turned to agree with ``along`` (``along`` itself where no corner has one), from the same
    corner lookups; None otherwise.
    """
    g = (points.astype(np.float64) + 0.5) * resolution
    base = np.floor(g - 0.5).astype(np.int64)
    frac = g - 0.5 - base  # in [0, 1)
    acc = np.zeros((len(points), attrs.shape[1]), np.float64)
    support = np.zeros(len(points), np.float64)
    blend = None if normals is None else np.zeros((len(points), 3), np.float32)
    for corner in range(8):
        off = np.array([(corner >> 2) & 1, (corner >> 1) & 1, corner & 1])
        w = np.prod(np.where(off == 1, frac, 1.0 - frac), axis=1)
        idx = index.lookup(base + off)
        w = np.where(idx >= 0, w, 0.0)
        acc += w[:, None] * attrs[np.maximum(idx, 0)]
        support += w
        if blend is not None:
            n = normals[np.maximum(idx, 0)]
            sign = np.where(np.einsum("ij,ij->i", n, along) < 0, -1.0, 1.0)
            blend += (w * sign).astype(np.float32)[:, None] * n
    values = acc / np.maximum(support, 1e-12)[:, None]
    normal = None
    if blend is not None:
        length = np.linalg.norm(blend, axis=1, keepdims=True)
        normal = np.where(length > 1e-6, blend / np.maximum(length, 1e-30), along).astype(np.float32)
    return values.astype(np.float32), support.astype(np.float32), normal


@dataclass(frozen=True)
class BakedTextures:
    """``base_color_rgba [H, W, 4]`` and ``metallic_roughness [H, W, 3]`` (occlusion or 0, roughness, metallic),
    uint8; ``normal [H, W, 3]`` the tangent-space normal map (None: not baked); ``occlusion``: whether the red
    channel of ``metallic_roughness`` holds ambient occlusion; ``coverage`` = fraction of texels covered by a
    chart and sampled."""

    base_color_rgba: np.ndarray
    metallic_roughness: np.ndarray
    coverage: float
    normal: np.ndarray | None = None
    occlusion: bool = False


@dataclass(frozen=True)
class SurfaceMaps:
    """What the shading maps need per UV vertex: ``normals [V', 3]``, ``tangents [V', 4]`` (for the normal map,
    with ``voxel_normals``, the decoded surface's) and ``occlusion [V']`` (None: no occlusion map)."""

    normals: np.ndarray
    tangents: np.ndarray
    voxel_normals: object | None = None  # maps.VoxelNormals
    occlusion: np.ndarray | None = None


def to_uint8(x: np.ndarray) -> np.ndarray:
    """``clip(x·255, 0, 255)`` rounded to uint8 (no gamma change: base colour is already sRGB)."""
    return np.clip(np.rint(x * 255.0), 0, 255).astype(np.uint8)


def nearest_covered(covered: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Row and column of each texel's nearest covered texel (EDT indices), or None when all or none are covered:
    computed once and used for every image of the atlas (it was one transform per image)."""
    if covered.all() or not covered.any():
        return None
    from scipy.ndimage import (
        distance_transform_edt,  # 0.7 s to import: only when a texture is baked
    )

    iy, ix = distance_transform_edt(~covered, return_distances=False, return_indices=True)
    return iy.astype(np.int32, copy=False), ix.astype(np.int32, copy=False)


def fill_gutters(image: np.ndarray, covered: np.ndarray,
                 nearest: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Copy into every uncovered texel the value of its nearest covered texel (``nearest``: ``nearest_covered``
    of ``covered``, computed here when not given)."""
    if nearest is None:
        nearest = nearest_covered(covered)
        if nearest is None:
            return image
    return image[nearest[0], nearest[1]]


@dataclass(frozen=True)
class AtlasRaster:
    """The atlas's rasterized texels, row-major: their rows and columns (int32), faces (int32) and barycentrics
    (``[n, 2]`` float32, ``rasterize_uv``'s), and the ``[H, W]`` mask of them."""

    ys: np.ndarray
    xs: np.ndarray
    face_id: np.ndarray
    bary: np.ndarray
    rasterized: np.ndarray


def rasterize_atlas(uvs: np.ndarray, uv_faces: np.ndarray, size: int) -> AtlasRaster:
    """``rasterize_uv`` at ``size²`` kept for the covered texels only: 21 B per rasterized texel and a bool per texel
    against the images' 12 B per texel (0.2 GB at 4096²)."""
    face_id, bary = rasterize_uv(uvs, uv_faces, size, size)
    rasterized = face_id >= 0
    ys, xs = (i.astype(np.int32) for i in np.nonzero(rasterized))  # int32: half of int64's 8 B per texel
    return AtlasRaster(ys, xs, face_id[ys, xs], bary[ys, xs], rasterized)


def bake_texels(
    mesh_vertices: np.ndarray,
    uv_faces: np.ndarray,
    uvs: np.ndarray,
    vertex_map: np.ndarray,
    projector: SurfaceProjector | None,
    index: SparseIndex,
    attrs: np.ndarray,
    resolution: int,
    size: int,
    *,
    maps: SurfaceMaps | None = None,
    chunk: int | None = None,
    threads: int | None = None,
    raster: AtlasRaster | None = None,
) -> BakedTexels:
    """Rasterize the atlas at ``size²``, place each texel on the reference surface and sample it; with
    ``maps``, also the normal map (where ``maps.voxel_normals``) and occlusion (where ``maps.occlusion``).
    Texel chunks run on ``threads`` threads (default ``workers.resolve_workers()``); every texel is written by one chunk,
    so the images do not depend on how many. The gutters are ``finish_textures``'s. ``raster``: the atlas's
    ``rasterize_atlas`` at ``size`` when the caller made it first (the export does, before its larger structures)."""
    import torch

    from .maps import encode_normals, interpolate

    raster = raster if raster is not None else rasterize_atlas(uvs, uv_faces, size)
    ys, xs, face_id, bary, rasterized = raster.ys, raster.xs, raster.face_id, raster.bary, raster.rasterized
    base = np.zeros((size, size, 4), np.uint8)
    mr = np.zeros((size, size, 3), np.uint8)
    covered = np.zeros((size, size), bool)
    want_normal = maps is not None and maps.voxel_normals is not None
    want_occlusion = maps is not None and maps.occlusion is not None
    normal_map = np.zeros((size, size, 3), np.uint8) if want_normal else None
    if maps is not None:
        uv_f = torch.from_numpy(np.ascontiguousarray(uv_faces))
        uv_n = torch.from_numpy(np.ascontiguousarray(maps.normals, np.float32))
        uv_t = torch.from_numpy(np.ascontiguousarray(maps.tangents, np.float32))
        uv_ao = torch.from_numpy(np.ascontiguousarray(maps.occlusion, np.float32))[:, None] if want_occlusion else None
    voxel_normals = maps.voxel_normals.take(index) if want_normal else None  # on the PBR voxels' rows, the field freed
    corners = vertex_map[uv_faces]  # [F, 3] indices into mesh_vertices
    threads = resolve_workers(threads)
    # The chunks in flight together hold what one serial chunk did (~0.4 KB of temporaries per texel).
    chunk = chunk or max(1 << 12, TEXEL_CHUNK // threads)

    def bake_chunk(start: int) -> None:  # writes only its own texels: chunks run in any order, on any thread
        y, x = ys[start : start + chunk], xs[start : start + chunk]
        f = face_id[start : start + chunk]
        b = bary[start : start + chunk].astype(np.float64)
        tri = mesh_vertices[corners[f]].astype(np.float64)  # [n, 3, 3]
        p = tri[:, 0] * (1 - b[:, :1] - b[:, 1:]) + tri[:, 1] * b[:, :1] + tri[:, 2] * b[:, 1:]
        # Texels in Z order of their surface point: the KD-tree, the voxel index and the attributes are then read
        # in neighbouring runs instead of atlas order (a texel's value does not depend on its place in the chunk).
        order = z_order(p)
        y, x, f, b, p = y[order], x[order], f[order], b[order], p[order]
        if projector is not None:
            p = projector.project(p)
        n_lo = t_lo = None
        if maps is not None:  # the shading maps cover every rasterized texel, sampled or not
            ft, bt = torch.from_numpy(f.astype(np.int64)), torch.from_numpy(b.astype(np.float32))
            if want_normal:
                n_lo, t_lo = interpolate(uv_n, uv_f, ft, bt), interpolate(uv_t, uv_f, ft, bt)
            if want_occlusion:
                mr[y, x, 0] = to_uint8(interpolate(uv_ao, uv_f, ft, bt).numpy())[:, 0]
        values, support, n_hi = sample_with_normals(index, attrs, p, resolution, normals=voxel_normals,
                                                    along=None if n_lo is None else n_lo.numpy())
        if n_hi is not None:
            normal_map[y, x] = encode_normals(torch.from_numpy(n_hi), n_lo, t_lo).numpy()
        ok = support > 0
        y, x, values = y[ok], x[ok], values[ok]
        covered[y, x] = True
        base[y, x, :3] = to_uint8(values[:, PBR_LAYOUT["base_color"]])
        base[y, x, 3] = to_uint8(values[:, PBR_LAYOUT["alpha"]])[:, 0]
        mr[y, x, 1] = to_uint8(values[:, PBR_LAYOUT["roughness"]])[:, 0]
        mr[y, x, 2] = to_uint8(values[:, PBR_LAYOUT["metallic"]])[:, 0]

    for _ in ordered_map(bake_chunk, range(0, len(ys), chunk), threads):
        pass
    return BakedTexels(base, mr, covered, rasterized, normal_map, want_occlusion)


@dataclass
class BakedTexels:
    """What ``bake_texels`` writes: the images at the rasterized texels (uint8), which texels were sampled
    (``covered``) and which lie in a chart (``rasterized``); ``finish_textures`` fills the gutters."""

    base: np.ndarray
    mr: np.ndarray
    covered: np.ndarray
    rasterized: np.ndarray
    normal: np.ndarray | None
    occlusion: bool


def finish_textures(texels: BakedTexels) -> BakedTextures:
    """Fill every image's gutters from the nearest sampled texel (the rasterized texels of the normal map keep their
    own normal) and report coverage. Takes the images over: ``texels`` is emptied."""
    base, mr, covered, rasterized, normal_map = texels.base, texels.mr, texels.covered, texels.rasterized, texels.normal
    texels.base = texels.mr = texels.covered = texels.rasterized = texels.normal = None
    coverage = float(covered.mean())
    if not covered.any():
        log.warning("no texel found PBR voxels within one voxel of the surface; textures stay black")
    nearest = nearest_covered(covered)
    if nearest is not None:
        base = fill_gutters(base, covered, nearest)
        mr = fill_gutters(mr, covered, nearest)
        if normal_map is not None:  # its rasterized texels keep their own normal, the rest the nearest covered one's
            normal_map = np.where(rasterized[..., None], normal_map, fill_gutters(normal_map, covered, nearest))
    del nearest
    return BakedTextures(base, mr, coverage, normal_map, texels.occlusion)


def bake_textures(*args, **kwargs) -> BakedTextures:
    """``bake_texels`` then ``finish_textures`` (same arguments as ``bake_texels``). A caller that can let go of the
    projector, the voxel index and the attributes between the two (the export does) holds less memory in the
    gutter fill."""
    return finish_textures(bake_texels(*args, **kwargs))
