"""Triangle mesh → flexible dual grid: TRELLIS.2's ``o_voxel.convert.mesh_to_flexible_dual_grid`` (a C++ loop
over faces and voxels) written as NumPy array passes; the inverse of ``dual_grid.py``.

The reference works in the frame shifted by −aabb_min (the cube becomes [0, 1]³, voxel size ``fl32(1/R)``):

1. Scan-convert each triangle along the three axes (float64). A crossing of the grid edge along a2 at grid
   lines ``(i+1, j+1)`` of the other two axes adds the crossing point (to a mean) and the triangle's plane QEF
   ``ppᵀ`` to the 4 voxels around that edge; only voxel ``(i, j)`` sets its flag on a2 (the ownership of
   ``dual_grid.py``). The voxels so touched are the output, in the order they were first touched.
2. Face term: each triangle adds its plane QEF (unscaled; ``face_weight`` only switches it on) to every existing
   voxel whose box it overlaps (the separating-axis test of the reference, in float32).
3. Boundary term: each boundary edge (used by one face) adds ``boundary_weight ·`` its line QEF to the existing
   voxels its 3D-DDA walk visits.
4. Regulariser ``reg · cnt · |x − mean|²``, then the minimiser of the QEF inside the voxel: unconstrained, else
   the best of the constrained minima on its 6 faces, 12 edges and 8 corners.

Steps 1–3 follow the reference's float32/float64 operations and its order of addition per voxel, so the voxels,
flags, means and QEF matrices are the reference's bits. Step 4 solves in float64 where the reference uses
Eigen's float32 column-pivoting QR: the dual vertices agree to the reference's own float32 error
(``tests/pixal3d/mesh/test_voxelize.py`` states the bound).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from .fields import DualGridFields

# The 10 distinct entries of a symmetric 4×4 QEF, row-major over the upper triangle.
PACK = ((0, 0), (0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3), (2, 2), (2, 3), (3, 3))
_AT = {rc: k for k, rc in enumerate(PACK)} | {(c, r): k for k, (r, c) in enumerate(PACK)}
_FULL = np.array([[_AT[r, c] for c in range(4)] for r in range(4)])  # packed → [4, 4]
CHUNK = 1 << 22  # work items (scan hits, box candidates, voxels) per array pass: ~0.3 GiB of temporaries


@dataclass(frozen=True)
class _Settings:
    resolution: int
    voxel_size: np.float32
    face_weight: float
    boundary_weight: float
    regularization_weight: float
    chunk: int
    progress: bool


@dataclass(frozen=True)
class Accumulated:
    """Per-voxel state before the solve, in the reference's voxel order and bits (shifted frame).

    coords [N, 3] int32, mean_sums [N, 3] float32 (sums of crossing points), counts [N] float32,
    intersected [N, 3] bool, qef [N, 10] float32 (``PACK`` order)."""

    coords: np.ndarray
    mean_sums: np.ndarray
    counts: np.ndarray
    intersected: np.ndarray
    qef: np.ndarray

    def matrices(self, regularization_weight: float = 0.0) -> np.ndarray:
        """The QEFs as [N, 4, 4] float32, with the regulariser added as the reference adds it when > 0."""
        return _regularized(self, regularization_weight)[:, _FULL]


def mesh_to_dual_grid(
    vertices,
    faces,
    resolution: int,
    *,
    face_weight: float = 1.0,
    boundary_weight: float = 0.2,
    regularization_weight: float = 1e-2,
    chunk: int = CHUNK,
    progress: bool = True,
) -> DualGridFields:
    """Flexible dual grid of a triangle mesh whose vertices lie in [-0.5, 0.5]³ (the caller normalises).

    The defaults are the weights TRELLIS.2's texturing pipeline passes. ``dual_vertices`` are offsets in voxel
    units within the voxel, ``[0, 1]``, computed as that pipeline does (``dual · R − coords`` in float32);
    ``split_weight`` is all ones (the reference's converter makes none: the decoder side then splits every
    quad along its 1–3 diagonal). ``face_weight`` only switches the face term on or off (> 0), as in the
    reference. ``chunk`` bounds the items per array pass (memory), ``progress`` shows a tqdm bar.
    """
    v, f = _check_inputs(vertices, faces)
    settings = _settings(resolution, face_weight, boundary_weight, regularization_weight, chunk, progress)
    acc = _accumulate(v, f, settings)
    dual = _solve(acc, settings)
    r = np.float32(settings.resolution)
    offsets = dual * r - acc.coords.astype(np.float32)  # the texturing pipeline's feats, in float32
    n = len(acc.coords)
    return DualGridFields(
        coords=torch.from_numpy(acc.coords),
        dual_vertices=torch.from_numpy(offsets),
        intersected=torch.from_numpy(acc.intersected),
        split_weight=torch.ones(n, dtype=torch.float32),
        resolution=settings.resolution,
    )


def accumulate_qefs(vertices, faces, resolution: int, *, face_weight: float = 1.0, boundary_weight: float = 0.2,
                    chunk: int = CHUNK, progress: bool = False) -> Accumulated:
    """Steps 1–3 alone: the per-voxel state the solve starts from (for parity checks and diagnostics)."""
    v, f = _check_inputs(vertices, faces)
    return _accumulate(v, f, _settings(resolution, face_weight, boundary_weight, 0.0, chunk, progress))


def _settings(resolution, face_weight, boundary_weight, regularization_weight, chunk, progress) -> _Settings:
    if isinstance(resolution, bool) or not isinstance(resolution, (int, np.integer)) or not 1 <= resolution <= 1 << 20:
        raise ValueError(f"resolution must be an integer in [1, 2^20], got {resolution!r}")
    for name, value in (("face_weight", face_weight), ("boundary_weight", boundary_weight),
                        ("regularization_weight", regularization_weight)):
        if not np.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if int(chunk) < 1024:
        raise ValueError(f"chunk must be at least 1024 items, got {chunk!r}")
    r = int(resolution)
    return _Settings(r, np.float32(1.0) / np.float32(r), float(face_weight), float(boundary_weight),
                     float(regularization_weight), int(chunk), bool(progress))


def _as_numpy(a) -> np.ndarray:
    return a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def _check_inputs(vertices, faces) -> tuple[np.ndarray, np.ndarray]:
    """float32 vertices shifted into [0, 1]³ (the reference's ``vertices - aabb_min``) and int64 faces."""
    v, f = _as_numpy(vertices), _as_numpy(faces)
    if v.ndim != 2 or v.shape[1] != 3 or len(v) == 0:
        raise ValueError(f"vertices must be a non-empty [V, 3] array, got shape {v.shape}")
    if f.ndim != 2 or f.shape[1] != 3 or len(f) == 0:
        raise ValueError(f"faces must be a non-empty [F, 3] array of vertex indices, got shape {f.shape}")
    if not np.issubdtype(f.dtype, np.integer):
        raise ValueError(f"faces must hold integer vertex indices, got dtype {f.dtype}")
    if not np.issubdtype(v.dtype, np.floating) and not np.issubdtype(v.dtype, np.integer):
        raise ValueError(f"vertices must be numbers, got dtype {v.dtype}")
    v = v.astype(np.float32)
    if not np.all(np.isfinite(v)):
        raise ValueError(f"vertices hold {int(np.sum(~np.isfinite(v).all(1)))} non-finite rows; fix or drop them")
    lo, hi = v.min(), v.max()
    if lo < -0.5 or hi > 0.5:
        raise ValueError(f"vertices span [{lo:.6g}, {hi:.6g}], outside the cube [-0.5, 0.5]; normalise the mesh first")
    if f.min() < 0 or f.max() >= len(v):
        raise ValueError(f"faces index vertices in [{f.min()}, {f.max()}], outside [0, {len(v) - 1}]")
    return v + np.float32(0.5), f.astype(np.int64)


# ---- float arithmetic in the reference's order ----------------------------------------------------------


def _dot3(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Eigen's fixed-size 3-term sum: ``a0·b0 + (a1·b1 + a2·b2)``."""
    return a[..., 0] * b[..., 0] + (a[..., 1] * b[..., 1] + a[..., 2] * b[..., 2])


def _lerp(a, b, t, va, vb):
    """The reference's ``lerp``: ``va`` where ``a == b``, else ``(1 − α)·va + α·vb``, α = (t − a)/(b − a)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        alpha = (t - a) / (b - a)
    if va.ndim > alpha.ndim:
        alpha, same = alpha[:, None], (a == b)[:, None]
    else:
        same = a == b
    return np.where(same, va, (1 - alpha) * va + alpha * vb)


def _trunc_int(x: np.ndarray) -> np.ndarray:
    """C++ ``int(x)``: truncation toward zero (NaN becomes a value every range check rejects)."""
    with np.errstate(invalid="ignore"):
        return np.where(np.isfinite(x), x, -(2.0**31)).astype(np.int64)


def _planes(tri: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unit normals [T, 3] and plane QEFs ``ppᵀ`` [T, 10] (p = (n, −n·v0)) in float32, as the reference."""
    e0, e1 = tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 1]
    c = np.stack([e0[:, 1] * e1[:, 2] - e0[:, 2] * e1[:, 1],
                  e0[:, 2] * e1[:, 0] - e0[:, 0] * e1[:, 2],
                  e0[:, 0] * e1[:, 1] - e0[:, 1] * e1[:, 0]], axis=1)
    z = _dot3(c, c)
    with np.errstate(invalid="ignore", divide="ignore"):
        n = np.where((z > 0)[:, None], c / np.sqrt(z)[:, None], c)
    p = np.concatenate([n, -_dot3(n, tri[:, 0])[:, None]], axis=1)
    return n, np.stack([p[:, r] * p[:, c] for r, c in PACK], axis=1)


# ---- voxel table and ordered accumulation -------------------------------------------------------------


class _VoxelTable:
    """Voxel keys in order of first appearance, with a sorted copy for lookups."""

    def __init__(self, resolution: int):
        self.r = resolution
        self.keys = np.zeros(0, np.int64)
        self._sorted = np.zeros(0, np.int64)
        self._rows = np.zeros(0, np.int64)

    def key(self, x, y, z) -> np.ndarray:
        return (x.astype(np.int64) * self.r + y) * self.r + z

    def add(self, keys: np.ndarray) -> tuple[np.ndarray, _Batches]:
        """Row of each key (keys not seen yet get new rows in the order they first occur in ``keys``), and the
        key positions grouped for ``_add_batches`` (one stable sort serves both)."""
        order = np.argsort(keys, kind="stable")
        head = _heads(keys[order])
        uniq, first = keys[order][head], order[head]
        group = np.cumsum(head) - 1
        rows, found, pos = self._find(uniq)
        new = np.flatnonzero(~found)
        new = new[np.argsort(first[new], kind="stable")]
        rows[new] = len(self.keys) + np.arange(len(new))
        self.keys = np.concatenate([self.keys, uniq[new]])
        self._sorted = np.insert(self._sorted, pos[~found], uniq[~found])
        self._rows = np.insert(self._rows, pos[~found], rows[~found])
        out = np.empty(len(keys), np.int64)
        out[order] = rows[group]
        return out, _rank_batches(order, head)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Row of each key, −1 where absent."""
        rows, found, _ = self._find(keys)
        rows[~found] = -1
        return rows

    def _find(self, keys):
        pos = np.searchsorted(self._sorted, keys)
        safe = np.minimum(pos, max(len(self._sorted) - 1, 0))
        if len(self._sorted):
            found = (pos < len(self._sorted)) & (self._sorted[safe] == keys)
        else:
            found = np.zeros(len(keys), bool)
        rows = np.zeros(len(keys), np.int64)
        rows[found] = self._rows[safe[found]]
        return rows, found, pos


def _heads(sorted_values: np.ndarray) -> np.ndarray:
    return np.r_[True, sorted_values[1:] != sorted_values[:-1]] if len(sorted_values) else np.zeros(0, bool)


@dataclass(frozen=True)
class _Batches:
    """Contributions grouped for ordered sums: ``first`` is one position per row (its first contribution);
    ``positions[k]`` / ``groups[k]`` are the k-th contribution of every row that has one, and that row's group."""

    first: np.ndarray
    positions: list[np.ndarray]
    groups: list[np.ndarray]


def _rank_batches(order: np.ndarray, head: np.ndarray) -> _Batches:
    """``order`` is a stable sort of the rows, ``head`` marks each row's first place in it."""
    starts = np.flatnonzero(head)
    group = np.cumsum(head) - 1
    rank = np.arange(len(order)) - starts[group]
    small = rank.astype(np.uint16) if len(rank) and rank.max() < 1 << 16 else rank  # uint16 sorts by radix
    by_rank = np.argsort(small, kind="stable")
    bounds = np.cumsum(np.bincount(rank))[:-1] if len(rank) else []
    return _Batches(order[starts], np.split(order[by_rank], bounds), np.split(group[by_rank], bounds))


def _add_batches(acc: np.ndarray, rows: np.ndarray, table: np.ndarray, src: np.ndarray, batches: _Batches) -> None:
    """``acc[rows[i]] += table[src[i]]`` for i in order: float sums are not associative and the reference adds
    one contribution at a time, so each voxel's additions keep their order. Vectorised over voxels, one pass
    per rank (the k-th addition of every voxel in pass k), on a compact copy of the rows touched."""
    if len(batches.first) == 0:
        return
    target = rows[batches.first]
    local = acc[target]
    for k, (pos, grp) in enumerate(zip(batches.positions, batches.groups)):
        if k == 0:  # every row has a first contribution, in group order: no scatter needed
            local += table[src[pos]]
        else:
            local[grp] += table[src[pos]]
    acc[target] = local


def _add_in_order(acc: np.ndarray, rows: np.ndarray, table: np.ndarray, src: np.ndarray) -> None:
    """``_add_batches`` for rows not grouped yet."""
    order = np.argsort(rows, kind="stable")
    _add_batches(acc, rows, table, src, _rank_batches(order, _heads(rows[order])))


class _Buffers:
    """Growable per-voxel accumulators."""

    def __init__(self):
        self.n = 0
        self.means = np.zeros((0, 3), np.float32)
        self.counts = np.zeros(0, np.float32)
        self.flags = np.zeros((0, 3), bool)
        self.qef = np.zeros((0, 10), np.float32)

    def grow(self, n: int) -> None:
        if n > len(self.counts):
            cap = max(n, len(self.counts) * 3 // 2, 1024)  # 1.5×: the slack is per-voxel bytes
            for name in ("means", "counts", "flags", "qef"):
                old = getattr(self, name)
                new = np.zeros((cap,) + old.shape[1:], old.dtype)
                new[: self.n] = old[: self.n]
                setattr(self, name, new)
        self.n = max(self.n, n)


# ---- 1. scan conversion -------------------------------------------------------------------------------


def _expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ``counts[i]`` items per parent: the parent of each item and its index within the parent."""
    parent = np.repeat(np.arange(len(counts)), counts)
    starts = np.cumsum(counts) - counts
    return parent, np.arange(len(parent)) - starts[parent]


def _scan_axis(tri64: np.ndarray, vs: np.float32, r: int, ax2: int):
    """Crossings of the grid edges along ``ax2`` by each triangle, in the reference's order (triangle, first
    then second half, row, column): triangle index, owner voxel (x, y, z) and the crossing point (float32)."""
    ax0, ax1 = (ax2 + 1) % 3, (ax2 + 2) % 3
    vsd = np.float64(vs)
    t = tri64[:, :, [ax0, ax1, ax2]]  # [T, 3 vertices, (x, y, z) canonical]
    t = np.take_along_axis(t, np.argsort(t[:, :, 1], axis=1, kind="stable")[:, :, None], axis=1)
    rows = np.clip(_trunc_int(t[:, :, 1] / vsd), 0, r - 1)  # [T, 3]: start, mid, end
    # Halves: rows [start, mid) between t0→t1 and t0→t2; rows [mid, end) between t2→t1 and t2→t0.
    a = np.stack([t[:, 0], t[:, 2]], axis=1)  # [T, 2, 3]
    b = t[:, [1, 1]]
    c = np.stack([t[:, 2], t[:, 0]], axis=1)
    lo = np.stack([rows[:, 0], rows[:, 1]], axis=1).reshape(-1)
    hi = np.stack([rows[:, 1], rows[:, 2]], axis=1).reshape(-1)
    half, k = _expand(np.maximum(hi - lo, 0))
    y_idx = lo[half] + k
    y = ((y_idx + 1).astype(np.float32) * vs).astype(np.float64)
    a, b, c = a.reshape(-1, 3)[half], b.reshape(-1, 3)[half], c.reshape(-1, 3)[half]
    t3 = _lerp(a[:, 1], b[:, 1], y, a[:, [0, 2]], b[:, [0, 2]])
    t4 = _lerp(a[:, 1], c[:, 1], y, a[:, [0, 2]], c[:, [0, 2]])
    swap = t3[:, 0] > t4[:, 0]
    t3, t4 = np.where(swap[:, None], t4, t3), np.where(swap[:, None], t3, t4)
    x_lo = np.clip(_trunc_int(t3[:, 0] / vsd), 0, r - 1)
    x_hi = np.clip(_trunc_int(t4[:, 0] / vsd), 0, r - 1)
    row, k = _expand(np.maximum(x_hi - x_lo, 0))
    x_idx = x_lo[row] + k
    x = ((x_idx + 1).astype(np.float32) * vs).astype(np.float64)
    z = _lerp(t3[row, 0], t4[row, 0], x, t3[row, 1], t4[row, 1])
    z_idx = _trunc_int(z / vsd)
    keep = (z_idx >= 0) & (z_idx < r)
    row, x_idx, x, z, z_idx = row[keep], x_idx[keep], x[keep], z[keep], z_idx[keep]
    owner = np.empty((len(row), 3), np.int64)
    owner[:, ax0], owner[:, ax1], owner[:, ax2] = x_idx, y_idx[row], z_idx
    point = np.empty((len(row), 3), np.float32)
    point[:, ax0], point[:, ax1], point[:, ax2] = x, y[row], z
    return half[row] // 2, owner, point


def _scan_chunk(tri: np.ndarray, qef: np.ndarray, table: _VoxelTable, buf: _Buffers, s: _Settings) -> None:
    tri64 = tri.astype(np.float64)
    parts = [_scan_axis(tri64, s.voxel_size, s.resolution, ax) for ax in range(3)]
    tri_id = np.concatenate([p[0] for p in parts])
    axis = np.repeat(np.arange(3), [len(p[0]) for p in parts])
    order = np.argsort(tri_id, kind="stable")  # (triangle, axis, half, row, column)
    tri_id, axis = tri_id[order], axis[order]
    owner = np.concatenate([p[1] for p in parts])[order]
    point = np.concatenate([p[2] for p in parts])[order]
    del parts
    # The 4 voxels around each crossed edge: owner + (0|1) on the two other axes, (dx, dy) loops as the reference.
    ax0, ax1 = (axis + 1) % 3, (axis + 2) % 3
    around = np.repeat(owner[:, None, :], 4, axis=1)  # [H, 4, 3]
    hit = np.arange(len(owner))
    for j, (dx, dy) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
        around[hit, j, ax0] += dx
        around[hit, j, ax1] += dy
    around = around.reshape(-1, 3)
    rows, batches = table.add(table.key(around[:, 0], around[:, 1], around[:, 2]))
    buf.grow(len(table.keys))
    src = np.repeat(hit, 4)
    _add_batches(buf.means, rows, point, src, batches)
    buf.counts[: buf.n] += np.bincount(rows, minlength=buf.n).astype(np.float32)  # whole numbers: exact in any order
    buf.flags[rows[0::4], axis] = True
    _add_batches(buf.qef, rows, qef, tri_id[src], batches)


def _scan_budget(tri: np.ndarray, r: int) -> np.ndarray:
    """An upper estimate of each triangle's scan hits (4 per grid edge crossed): its projected areas plus its
    perimeter, in voxels."""
    e0, e1 = tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0]
    area2 = np.abs(np.cross(e0.astype(np.float64), e1)).sum(axis=1) * r * r
    perimeter = (np.linalg.norm(e0, axis=1) + np.linalg.norm(e1, axis=1) + np.linalg.norm(e1 - e0, axis=1)) * r
    return 4 * (area2 / 2 + 3 * perimeter + 3)


def _chunks(cost: np.ndarray, budget: int) -> list[slice]:
    """Consecutive slices whose cost sums stay within ``budget`` (at least one item each)."""
    out, start, total = [], 0, np.cumsum(cost)
    while start < len(cost):
        base = total[start - 1] if start else 0.0
        stop = max(int(np.searchsorted(total, base + budget, side="right")), start + 1)
        out.append(slice(start, stop))
        start = stop
    return out


# ---- 2. face term -----------------------------------------------------------------------------------


def _box_candidates(tri: np.ndarray, n: np.ndarray, vs: np.float32, r: int):
    """Per triangle, the voxels of its bounding box (the reference's) near its plane: for each column along the
    normal's dominant axis w, the voxels the plane crosses plus one on either side (the float32 box test then
    decides). Returns the candidates as (triangle, [K, 3] voxel)."""
    lo_f = np.minimum(np.minimum(tri[:, 0], tri[:, 1]), tri[:, 2]) / vs
    hi_f = np.maximum(np.maximum(tri[:, 0], tri[:, 1]), tri[:, 2]) / vs
    bb_lo = np.maximum(_trunc_int(lo_f), 0)
    bb_hi = np.minimum(_trunc_int(hi_f + np.float32(1)), r)
    w = np.argmax(np.abs(n), axis=1)
    axes = np.stack([w, (w + 1) % 3, (w + 2) % 3], axis=1)  # [T, 3]: w, u, v
    lo, hi = np.take_along_axis(bb_lo, axes, 1), np.take_along_axis(bb_hi, axes, 1)
    n64 = np.take_along_axis(n, axes, 1).astype(np.float64)
    vsd = np.float64(vs)
    # Per triangle: the plane's w over a column's centre is a + bu·iu + bv·iv, give or take ``spread``.
    d = -(n.astype(np.float64) * tri[:, 0].astype(np.float64)).sum(axis=1)
    a = -(d + (n64[:, 1] + n64[:, 2]) * 0.5 * vsd) / n64[:, 0]
    bu, bv = -n64[:, 1] * vsd / n64[:, 0], -n64[:, 2] * vsd / n64[:, 0]
    spread = (np.abs(n64[:, 1]) + np.abs(n64[:, 2])) * 0.5 * vsd / np.abs(n64[:, 0])
    nv = np.maximum(hi[:, 2] - lo[:, 2], 0)
    tri_id, k = _expand(np.maximum(hi[:, 1] - lo[:, 1], 0) * nv)
    nv_t = np.maximum(nv[tri_id], 1)
    iu, iv = lo[tri_id, 1] + k // nv_t, lo[tri_id, 2] + k % nv_t
    centre = a[tri_id] + bu[tri_id] * iu + bv[tri_id] * iv
    w_lo = np.maximum(np.floor((centre - spread[tri_id]) / vsd).astype(np.int64) - 1, lo[tri_id, 0])
    w_hi = np.minimum(np.floor((centre + spread[tri_id]) / vsd).astype(np.int64) + 2, hi[tri_id, 0])
    col, k = _expand(np.maximum(w_hi - w_lo, 0))
    tc = tri_id[col]
    xyz = np.empty((len(col), 3), np.int64)
    rows = np.arange(len(col))
    ax = axes[tc]
    xyz[rows, ax[:, 0]] = w_lo[col] + k
    xyz[rows, ax[:, 1]] = iu[col]
    xyz[rows, ax[:, 2]] = iv[col]
    return tc, xyz


def _box_overlaps(tri: np.ndarray, n: np.ndarray, tc: np.ndarray, xyz: np.ndarray, vs: np.float32) -> np.ndarray:
    """The reference's triangle/box test (plane through the box, then the three 2D edge projections), in its
    float32 operations: which candidates ``(tc, xyz)`` pass."""
    zero = np.float32(0)
    vsv = np.full(3, vs, np.float32)
    c = np.where(n > 0, vs, zero).astype(np.float32)
    d1 = _dot3(n, c - tri[:, 0])
    d2 = _dot3(n, (vsv - c) - tri[:, 0])
    p = xyz.astype(np.float32) * vs
    nn = n[tc]
    ndp = _dot3(nn, p)
    keep = ~(((ndp + d1[tc]) * (ndp + d2[tc])) > 0)
    edges = (tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 1], tri[:, 0] - tri[:, 2])
    # (plane axes (a, b), the normal component whose sign flips the edge normals), as in the reference.
    for a, b, sign_axis in ((0, 1, 2), (1, 2, 0), (2, 0, 1)):
        mul = np.where(n[:, sign_axis] < 0, np.float32(-1), np.float32(1))
        for e, start in zip(edges, (tri[:, 0], tri[:, 1], tri[:, 2])):
            ea, eb = -mul * e[:, b], mul * e[:, a]
            de = -(ea * start[:, a] + eb * start[:, b]) + (np.maximum(ea, zero) * vs + np.maximum(eb, zero) * vs)
            keep &= ~((ea[tc] * p[:, a] + eb[tc] * p[:, b]) + de[tc] < 0)
    return keep


def _face_chunk(tri, n, qef, table, buf, s: _Settings) -> None:
    live = np.flatnonzero(np.any(qef != 0, axis=1))  # a zero QEF (degenerate triangle) adds nothing
    if len(live) == 0:
        return
    tc, xyz = _box_candidates(tri[live], n[live], s.voxel_size, s.resolution)
    keep = _box_overlaps(tri[live], n[live], tc, xyz, s.voxel_size)
    tc, xyz = tc[keep], xyz[keep]
    rows = table.lookup(table.key(xyz[:, 0], xyz[:, 1], xyz[:, 2]))
    present = rows >= 0
    _add_in_order(buf.qef, rows[present], qef[live], tc[present])


def _box_budget(tri: np.ndarray, r: int) -> np.ndarray:
    """Candidate count estimate per triangle: its bounding box's largest face, times 5 voxels per column."""
    ext = (tri.max(axis=1) - tri.min(axis=1)) * r + 2
    return 5 * np.sort(ext, axis=1)[:, 1:].prod(axis=1)


# ---- 3. boundary term -------------------------------------------------------------------------------


def _boundary_edges(f: np.ndarray, n_vertices: int) -> np.ndarray:
    """Edges used by exactly one face, as (low, high) vertex pairs sorted as the reference's ``std::map``."""
    e = np.stack([f, np.roll(f, -1, axis=1)], axis=2).reshape(-1, 2)
    keys = np.minimum(e[:, 0], e[:, 1]) * n_vertices + np.maximum(e[:, 0], e[:, 1])
    uniq, count = np.unique(keys, return_counts=True)
    once = uniq[count == 1]
    return np.stack([once // n_vertices, once % n_vertices], axis=1)


def _line_qefs(v0: np.ndarray, v1: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unit directions (float64), lengths, and the QEF of the distance to the line [E, 10] (float32)."""
    d = (v1 - v0).astype(np.float64)
    length = np.sqrt(_dot3(d, d))
    with np.errstate(invalid="ignore", divide="ignore"):
        d = d / length[:, None]
    a = np.eye(3, dtype=np.float32) - (d[:, :, None] * d[:, None, :]).astype(np.float32)  # [E, 3, 3]
    b = -(a[:, :, 0] * v0[:, None, 0] + (a[:, :, 1] * v0[:, None, 1] + a[:, :, 2] * v0[:, None, 2]))
    row = v0[:, 0, None] * a[:, 0] + (v0[:, 1, None] * a[:, 1] + v0[:, 2, None] * a[:, 2])  # v0ᵀA
    c = _dot3(row, v0)
    q = np.empty((len(v0), 10), np.float32)
    for k, (r_, c_) in enumerate(PACK):
        q[:, k] = c if r_ == 3 else (b[:, r_] if c_ == 3 else a[:, r_, c_])
    return d, length, q


def _dda(v0: np.ndarray, d: np.ndarray, length: np.ndarray, vs: np.float32):
    """The reference's 3D-DDA walk from v0 along d for ``length``: (edge, voxel) of every voxel visited."""
    start = np.floor(v0 / vs).astype(np.int64)
    step = np.where(d > 0, 1, -1)
    border = ((start + (step > 0)).astype(np.float32) * vs).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(d == 0, np.inf, (border - v0).astype(np.float64) / d)
        delta = np.where(d == 0, np.inf, np.float64(vs) / np.abs(d))
    # Every crossing time of each axis up to the length, added up one step at a time as the reference does.
    edges, axes, times = [], [], []
    live = np.argwhere(t <= length[:, None])
    while len(live):
        e, a = live[:, 0], live[:, 1]
        edges.append(e), axes.append(a), times.append(t[e, a])
        t[e, a] += delta[e, a]
        live = live[t[e, a] <= length[e]]
    if edges:
        e, a, tm = np.concatenate(edges), np.concatenate(axes), np.concatenate(times)
    else:
        e, a, tm = np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    # Ties go to z, then y, then x (the reference's comparisons); the walk is the events sorted by time.
    order = np.lexsort((2 - a, tm, e))
    e, a = e[order], a[order]
    onehot = np.zeros((len(e), 3), np.int64)
    onehot[np.arange(len(e)), a] = 1
    moved = np.cumsum(onehot, axis=0)
    first = np.searchsorted(e, np.arange(len(v0)))
    before = np.vstack([np.zeros((1, 3), np.int64), moved])[first]
    moved = moved - before[e]
    visits_e = np.concatenate([np.arange(len(v0)), e])
    visits = np.concatenate([start, start[e] + step[e] * moved])
    order = np.argsort(visits_e, kind="stable")
    return visits_e[order], visits[order]


def _boundary(v: np.ndarray, f: np.ndarray, table: _VoxelTable, buf: _Buffers, s: _Settings) -> None:
    ends = _boundary_edges(f, len(v))
    v0, v1 = v[ends[:, 0]], v[ends[:, 1]]
    d, length, q = _line_qefs(v0, v1)
    keep = length >= 1e-6  # the reference skips degenerate edges
    v0, d, length, q = v0[keep], d[keep], length[keep], q[keep]
    q = np.float32(s.boundary_weight) * q
    for part in _chunks(np.ceil(length * s.resolution * 3 + 1), s.chunk):
        edge, vox = _dda(v0[part], d[part], length[part], s.voxel_size)
        inside = np.all((vox >= 0) & (vox < s.resolution), axis=1)
        edge, vox = edge[inside], vox[inside]
        rows = table.lookup(table.key(vox[:, 0], vox[:, 1], vox[:, 2]))
        present = rows >= 0
        _add_in_order(buf.qef, rows[present], q[part], edge[present])


def _accumulate(v: np.ndarray, f: np.ndarray, s: _Settings) -> Accumulated:
    """Steps 1–3 on shifted float32 vertices ``v`` and int64 faces ``f``: the reference's per-voxel state."""
    tri = v[f]  # [F, 3, 3] float32
    table, buf = _VoxelTable(s.resolution), _Buffers()
    passes = 2 if s.face_weight > 0 else 1  # the bar counts faces per pass: scan, then the face term
    with tqdm(total=passes * len(f), desc="voxelize", unit="face", disable=not s.progress) as bar:
        # 1. Scan conversion, triangles in order.
        for part in _chunks(_scan_budget(tri, s.resolution), s.chunk):
            n, qef = _planes(tri[part])
            _scan_chunk(tri[part], qef, table, buf, s)
            bar.update(part.stop - part.start)
        # 2. Face term, on the voxels step 1 made.
        if s.face_weight > 0:
            for part in _chunks(_box_budget(tri, s.resolution), s.chunk):
                n, qef = _planes(tri[part])
                _face_chunk(tri[part], n, qef, table, buf, s)
                bar.update(part.stop - part.start)
        # 3. Boundary term.
        if s.boundary_weight > 0:
            _boundary(v, f, table, buf, s)
    k = table.keys
    coords = np.stack([k // (s.resolution * s.resolution), k // s.resolution % s.resolution,
                       k % s.resolution], axis=1).astype(np.int32)
    m = buf.n
    return Accumulated(coords, buf.means[:m], buf.counts[:m], buf.flags[:m], buf.qef[:m])


# ---- 4. regularise and solve ------------------------------------------------------------------------


def _regularized(acc: Accumulated, reg: float, rows: slice = slice(None)) -> np.ndarray:
    """``Q + reg·cnt·Q_reg(mean)`` in float32, the reference's operations: [n, 10] for ``rows``."""
    q = acc.qef[rows].copy()
    if reg > 0:
        counts = acc.counts[rows]
        scale = np.float32(reg) * counts
        p = acc.mean_sums[rows] / counts[:, None]
        for i in range(3):
            q[:, _AT[i, i]] += scale
            q[:, _AT[i, 3]] += scale * -p[:, i]
        q[:, _AT[3, 3]] += scale * _dot3(p, p)
    return q


def _solve3(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Batched 3×3 solve; rank-deficient systems (possible only without the regulariser) by least squares."""
    det = np.linalg.det(a)
    ok = np.abs(det) > 1e-300
    x = np.empty(b.shape)
    if ok.any():
        x[ok] = np.linalg.solve(a[ok], b[ok][:, :, None])[:, :, 0]
    if (~ok).any():
        x[~ok] = (np.linalg.pinv(a[~ok]) @ b[~ok][:, :, None])[:, :, 0]
    return x


def _box_minimum(q: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The minimiser of the quadratic ``pᵀQp`` (p = (x, 1)) over the box [lo, hi], for QEFs whose free minimum
    lies outside: the best of the constrained minima on the faces, edges and corners that fall in the box,
    in the reference's order (first best wins)."""
    m = len(q)
    cands, oks = [], []
    bounds = np.stack([lo, hi], axis=1)  # [M, 2, 3]
    rows = np.arange(m)
    for fixed in range(3):  # faces: one coordinate at a bound, the other two from a 2×2 solve
        a1, a2 = (fixed + 1) % 3, (fixed + 2) % 3
        a11, a12, a22 = q[:, a1, a1], q[:, a1, a2], q[:, a2, a2]
        det = a11 * a22 - a12 * a12
        for side in range(2):
            c = bounds[:, side, fixed]
            r1 = -(q[:, a1, fixed] * c + q[:, a1, 3])
            r2 = -(q[:, a2, fixed] * c + q[:, a2, 3])
            with np.errstate(divide="ignore", invalid="ignore"):
                x1, x2 = (a22 * r1 - a12 * r2) / det, (a11 * r2 - a12 * r1) / det
            p = np.empty((m, 3))
            p[:, fixed], p[:, a1], p[:, a2] = c, x1, x2
            cands.append(p)
            oks.append((x1 >= lo[:, a1]) & (x1 <= hi[:, a1]) & (x2 >= lo[:, a2]) & (x2 <= hi[:, a2]))
    for free in range(3):  # edges: two coordinates at bounds, the free one from a 1×1 solve
        a1, a2 = (free + 1) % 3, (free + 2) % 3
        for s1, s2 in ((0, 0), (0, 1), (1, 0), (1, 1)):
            c1, c2 = bounds[:, s1, a1], bounds[:, s2, a2]
            with np.errstate(divide="ignore", invalid="ignore"):
                x = -(q[:, free, a1] * c1 + q[:, free, a2] * c2 + q[:, free, 3]) / q[:, free, free]
            p = np.empty((m, 3))
            p[:, free], p[:, a1], p[:, a2] = x, c1, c2
            cands.append(p)
            oks.append((x >= lo[:, free]) & (x <= hi[:, free]))
    for sx in (1, 0):  # corners, in the reference's loop order (max bound first)
        for sy in (1, 0):
            for sz in (1, 0):
                cands.append(np.stack([bounds[:, sx, 0], bounds[:, sy, 1], bounds[:, sz, 2]], axis=1))
                oks.append(np.ones(m, bool))
    p = np.stack(cands, axis=1)  # [M, 26, 3]
    ph = np.concatenate([p, np.ones((m, p.shape[1], 1))], axis=2)
    err = np.einsum("mki,mij,mkj->mk", ph, q, ph)
    err = np.where(np.stack(oks, axis=1), err, np.inf)
    return p[rows, np.argmin(err, axis=1)]


def _solve(acc: Accumulated, s: _Settings) -> np.ndarray:
    """Step 4: dual vertices [N, 3] float32 in the shifted frame ([0, 1]³ world units)."""
    out = np.empty((len(acc.coords), 3), np.float32)
    for start in range(0, len(out), s.chunk // 16):
        sl = slice(start, start + s.chunk // 16)
        q = _regularized(acc, s.regularization_weight, sl)[:, _FULL].astype(np.float64)
        coords = acc.coords[sl]
        lo = (coords.astype(np.float32) * s.voxel_size).astype(np.float64)
        hi = ((coords + 1).astype(np.float32) * s.voxel_size).astype(np.float64)
        x = _solve3(q[:, :3, :3], -q[:, :3, 3]).astype(np.float32).astype(np.float64)
        outside = ~np.all((x >= lo) & (x <= hi), axis=1)
        if outside.any():
            x[outside] = _box_minimum(q[outside], lo[outside], hi[outside])
        out[sl] = x
    return out
