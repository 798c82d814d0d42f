"""The remesh's sparse grid: its domain, the coarse-to-fine narrow band, the corner distances.

Steps 1–3 of the reference's ``remesh_narrow_band_dc`` (CuMesh; mesh-export.md §3.3a):
1. The domain is the cube of side ``scale = (R + 3·band) / R`` centred on the origin, cut into R³
   cells; ``eps = band · scale / R`` (one cell at band 1).
2. Coarse to fine: from a dense grid of at most 32³ cells, keep the cells whose centre has
   ``|UDF − eps| < 0.87 · cell`` (half the diagonal), split each into 8, repeat down to R/2.
3. ``d = UDF − eps`` at the corners of the 8 children of every cell kept at R/2 (negative inside the
   thickened shell).
Deviation, with the same contour: the reference also tests the finest cells' centres; for a
1-Lipschitz UDF a cell crossed by the level set always passes that test, and the exterior flood fill
wants the corners of all children anyway.

Memory: no dense R³ array. Corners are deduplicated in x-slabs of the kept R/2 cells, each with a
dense ``(2h + 1) × (R + 1)²`` map, and stored as sorted int64 keys with float32 values.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from .distance import SurfaceDistance

log = logging.getLogger(__name__)

# Cell corners, index 4x + 2y + z; the 12 edges (a, b) with a < b; the owned edge per axis.
CORNERS = np.array([[x, y, z] for x in (0, 1) for y in (0, 1) for z in (0, 1)])
EDGES = np.array([(a, b) for a in range(8) for b in range(a + 1, 8) if np.abs(CORNERS[a] - CORNERS[b]).sum() == 1])
OWNED = np.array([[3, 7], [5, 7], [6, 7]])  # x: (0,1,1)→(1,1,1), y: (1,0,1)→(1,1,1), z: (1,1,0)→(1,1,1)
LATTICE = np.array([[x, y, z] for x in range(3) for y in range(3) for z in range(3)])  # corners of 8 children
BASE_LIMIT = 32  # the coarsest level has at most this many cells per axis (the reference's start)
# Entries of one slab's dense corner index (16 MiB as int32): at R = 1024 one parent plane per slab. The slab's
# contour temporaries scale with it: 2^24 (7 planes) held 0.38 GB more at a 9M-voxel remesh's slab peak, for no
# measured gain in time (45 s against 47 s over 3 of its 36 slabs). The contour does not depend on it.
SLAB_CELLS = 1 << 22


@dataclass(frozen=True)
class RemeshGrid:
    """The remesh domain: ``resolution`` cells per axis over a cube of side ``scale`` centred on 0."""

    resolution: int
    band: float = 1.0

    def __post_init__(self) -> None:
        r = self.resolution
        if r < 4 or r % 2:
            raise ValueError(f"remesh resolution must be an even number >= 4, got {r}")
        if not self.band > 0:
            raise ValueError(f"remesh band must be > 0 cells, got {self.band}")
        self.levels()  # raises when R does not halve evenly down to <= 32

    @property
    def scale(self) -> float:
        """Side of the domain: a little over the unit cube, so that the offset shell stays inside."""
        return (self.resolution + 3 * self.band) / self.resolution

    @property
    def cell(self) -> float:
        """Cell side in world units."""
        return self.scale / self.resolution

    @property
    def eps(self) -> float:
        """The contoured offset distance: ``band`` cells."""
        return self.band * self.cell

    def levels(self) -> list[int]:
        """Cells per axis of each coarse-to-fine level before the finest: ``[base, 2·base, …, R/2]``."""
        n = self.resolution // 2
        out = [n]
        while n > BASE_LIMIT:
            if n % 2:
                raise ValueError(f"remesh resolution {self.resolution} must halve evenly down to <= {BASE_LIMIT} "
                                 f"(e.g. a power of two such as 512 or 1024)")
            n //= 2
            out.append(n)
        return out[::-1]

    def to_world(self, lattice: np.ndarray) -> np.ndarray:
        """World positions (float64) of points in finest-cell units (corner g at ``(g/R − 0.5)·scale``)."""
        return (np.asarray(lattice, np.float64) / self.resolution - 0.5) * self.scale

    @property
    def corner_side(self) -> int:
        """Corners per axis (R + 1); corner key = ``(x·(R+1) + y)·(R+1) + z``."""
        return self.resolution + 1

    def corner_coords(self, key: np.ndarray) -> np.ndarray:
        """Integer corner coordinates ``[..., 3]`` of corner keys."""
        n = self.corner_side
        return np.stack([key // (n * n), (key // n) % n, key % n], axis=-1)


@dataclass
class NarrowBand:
    """Result of the coarse-to-fine search.

    parents:  [P, 3] int32 cells kept at level R/2, sorted x-major; their 8 children are the finest cells.
    free:     per level (cells per axis, sorted int64 keys ``(x·n + y)·n + z``) the cells left out on the
              far side (d > 0 in the whole cell); only collected for the exterior flood fill.
    corners:  [C] int64 sorted keys of every corner of a finest cell.
    values:   [C] float32 ``UDF − eps`` at those corners (clamped far away: only the sign counts there).
    """

    grid: RemeshGrid
    parents: np.ndarray
    free: list[tuple[int, np.ndarray]]
    corners: np.ndarray
    values: np.ndarray
    _dense: np.ndarray | None = field(default=None, init=False, repr=False)
    _written: np.ndarray | None = field(default=None, init=False, repr=False)

    def slab_planes(self) -> int:
        """Parent planes per slab, so that a slab's dense corner index stays under ``SLAB_CELLS``."""
        return max(1, (SLAB_CELLS // self.grid.corner_side**2 - 1) // 2)

    def slabs(self, *, occupied: bool = False) -> Iterator[tuple[int, np.ndarray]]:
        """``(a, parents with x in [a, a + h))`` for a = 0, h, 2h, … (empty slabs included); with ``occupied``, only
        from the first parent's slab to the last's (a remesh slab's band of a few planes then costs a few slabs,
        not all R / 2h of them)."""
        h = self.slab_planes()
        if occupied and len(self.parents) == 0:
            return
        first = int(self.parents[0, 0]) // h * h if occupied else 0
        last = int(self.parents[-1, 0]) + 1 if occupied else self.grid.resolution // 2
        starts = np.arange(first, last, h)
        bounds = np.searchsorted(self.parents[:, 0], np.r_[starts, starts[-1] + h])
        for i, a in enumerate(starts.tolist()):
            yield a, self.parents[bounds[i] : bounds[i + 1]]

    def corner_index(self, a: int) -> np.ndarray:
        """Dense ``[2h + 1, R + 1, R + 1]`` int32 map of the corner rows in planes ``[2a, 2a + 2h]`` (-1: none).

        One buffer serves every slab (the previous slab's entries are reset, not the whole buffer refilled: that
        refill was a tenth of the remesh), so a map is valid only until the next call."""
        h, n = self.slab_planes(), self.grid.corner_side
        first = 2 * a * n * n
        lo, hi = np.searchsorted(self.corners, [first, first + (2 * h + 1) * n * n])
        if self._dense is None:
            self._dense = np.full((2 * h + 1) * n * n, -1, np.int32)
        elif self._written is not None:
            self._dense[self._written] = -1
        self._written = self.corners[lo:hi] - first
        self._dense[self._written] = np.arange(lo, hi, dtype=np.int32)
        return self._dense.reshape(2 * h + 1, n, n)


def children(cells: np.ndarray) -> np.ndarray:
    """The 8 children ``[8P, 3]`` int32 of cells ``[P, 3]``, in ``CORNERS`` order per parent."""
    return (2 * cells[:, None, :] + CORNERS[None]).reshape(-1, 3).astype(np.int32)


def narrow_band(udf: SurfaceDistance, grid: RemeshGrid, *, keep_free: bool = False) -> NarrowBand:
    """Steps 2–3: the cells kept down to level R/2, then ``UDF − eps`` at every finest corner."""
    parents, free = band_parents(udf, grid, keep_free=keep_free)
    return band_of(udf, grid, parents, free)


def band_of(udf: SurfaceDistance, grid: RemeshGrid, parents: np.ndarray,
            free: list[tuple[int, np.ndarray]] | None = None) -> NarrowBand:
    """Step 3 for ``parents`` (sorted x-major, any subset of the kept cells): their finest corners' ``UDF − eps``."""
    band = NarrowBand(grid, parents, free or [], np.zeros(0, np.int64), np.zeros(0, np.float32))
    band.corners = _band_corners(band)
    band.values = _corner_values(udf, grid, band.corners)
    return band


def band_parents(udf: SurfaceDistance, grid: RemeshGrid, *, keep_free: bool = False,
                 chunk: int = 1 << 20) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
    """Step 2: the cells kept at level R/2 ``[P, 3]`` int32 sorted x-major, and (``keep_free``) the far cells.

    Each level's candidates (the children of the last level's kept cells) are made, measured and kept a chunk at a
    time, in the children's order: the whole level's candidates and their distances (~0.35 GB at 9M voxels) are
    never held, and the kept cells are the same."""
    levels = grid.levels()
    axis = np.arange(levels[0], dtype=np.int32)
    cells = np.stack(np.meshgrid(axis, axis, axis, indexing="ij"), -1).reshape(-1, 3)
    free: list[tuple[int, np.ndarray]] = []
    for i, n in enumerate(levels):
        size = grid.scale / n
        step = grid.resolution // n
        reach = grid.eps + 0.87 * size
        kept, far = [], []
        per = chunk if i == 0 else max(1, chunk // 8)  # parents per chunk past the first level: 8 children each
        for s in range(0, len(cells), per):
            part = cells[s : s + per] if i == 0 else children(cells[s : s + per])
            d = udf.distance(grid.to_world((part + 0.5) * step), upper_bound=reach, coherent=True)
            keep = np.abs(d - grid.eps) < 0.87 * size
            if keep_free:
                far.append(part[~keep & (d > grid.eps)].astype(np.int64))
            kept.append(part[keep])
        cells = np.concatenate(kept) if kept else np.zeros((0, 3), np.int32)
        del kept
        if keep_free:
            far = np.concatenate(far) if far else np.zeros((0, 3), np.int64)
            free.append((n, np.sort((far[:, 0] * n + far[:, 1]) * n + far[:, 2])))
        log.debug("remesh level %d: %d cells kept", n, len(cells))
    order = np.lexsort((cells[:, 2], cells[:, 1], cells[:, 0]))
    return cells[order], free


def _band_corners(band: NarrowBand) -> np.ndarray:
    """Sorted unique keys of the 27 lattice points of every kept parent (its 8 children's corners)."""
    grid, h = band.grid, band.slab_planes()
    n = grid.corner_side
    keys, carry, a = [], None, 0
    for a, parents in band.slabs(occupied=True):
        mark = np.zeros((2 * h + 1, n, n), bool)
        if carry is not None:
            mark[0] = carry
        if len(parents):
            pts = (2 * parents[:, None, :].astype(np.int64) + LATTICE[None]).reshape(-1, 3)
            mark[pts[:, 0] - 2 * a, pts[:, 1], pts[:, 2]] = True
        keys.append(np.flatnonzero(mark[: 2 * h]) + 2 * a * n * n)  # planes 2a … 2a + 2h − 1
        carry = mark[2 * h].copy()  # plane 2a + 2h: shared with the next slab
    if not keys:
        return np.zeros(0, np.int64)
    last_plane = 2 * (a + h)
    if carry is not None and carry.any() and last_plane <= grid.resolution:
        keys.append(np.flatnonzero(carry) + last_plane * n * n)
    return np.concatenate(keys).astype(np.int64)


def _corner_values(udf: SurfaceDistance, grid: RemeshGrid, keys: np.ndarray, chunk: int = 1 << 20) -> np.ndarray:
    """``UDF − eps`` (float32). Only corners within eps + 2 cells can sit on a crossing edge; the rest
    are clamped to that distance (their sign is all that is used)."""
    reach = grid.eps + 2 * grid.cell
    out = np.empty(len(keys), np.float32)
    for s in range(0, len(keys), chunk):
        d = udf.distance(grid.to_world(grid.corner_coords(keys[s : s + chunk])), upper_bound=reach,
                         coherent=True)  # sorted keys: rows of z
        out[s : s + chunk] = np.minimum(d, reach) - grid.eps
    return out
