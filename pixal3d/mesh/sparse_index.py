"""O(1) lookup of sparse voxel coordinates through a brick table (never a dense R³ volume).

The grid is cut into bricks of ``brick³`` voxels. A dense ``int32`` map holds one slot per brick
((R/8)³·4 B = 8 MB at R = 1024) and a ``[n_bricks, brick³]`` table holds the voxel indices of the
occupied bricks only, so memory follows the number of occupied bricks, not R³.
"""
from __future__ import annotations

import numpy as np


class SparseIndex:
    """Maps integer voxel coordinates ``(x, y, z)`` in ``[0, resolution)³`` to row indices (or -1)."""

    def __init__(self, coords: np.ndarray, resolution: int, *, brick: int = 8) -> None:
        coords = np.asarray(coords)
        if coords.ndim != 2 or coords.shape[1] != 3:
            raise ValueError(f"coords must have shape [M, 3], got {tuple(coords.shape)}")
        if resolution < 1:
            raise ValueError(f"resolution must be >= 1, got {resolution}")
        if coords.size and (coords.min() < 0 or coords.max() >= resolution):
            raise ValueError(
                f"voxel coordinates must lie in [0, {resolution}); got range "
                f"[{coords.min()}, {coords.max()}]: check the resolution passed with the coords"
            )
        self.resolution = int(resolution)
        self.brick = int(brick)
        self.shift = int(brick).bit_length() - 1
        if 1 << self.shift != brick:
            raise ValueError(f"brick must be a power of two, got {brick}")
        self.bricks_per_axis = -(-self.resolution // self.brick)
        nb = self.bricks_per_axis
        # A chunk of voxels at a time (whole, the int64 copies of the coordinates and keys were ~0.6 GB of
        # temporaries at 9M voxels): occupied bricks marked, numbered in key order, then each voxel's slot filled.
        chunk = 1 << 20
        occupied = np.zeros(nb**3, dtype=bool)
        for s in range(0, len(coords), chunk):
            occupied[self._brick_key(coords[s : s + chunk].astype(np.int64))] = True
        n_bricks = int(occupied.sum())
        self.brick_map = np.full(nb**3, -1, dtype=np.int32)
        self.brick_map[occupied] = np.arange(n_bricks, dtype=np.int32)
        self.table = np.full((n_bricks, brick**3), -1, dtype=np.int32)
        del occupied
        for s in range(0, len(coords), chunk):
            c = coords[s : s + chunk].astype(np.int64)
            self.table[self.brick_map[self._brick_key(c)], self._local(c)] = np.arange(s, s + len(c), dtype=np.int32)
        if int((self.table >= 0).sum()) != len(coords):
            raise ValueError("coords contain duplicate voxels; each voxel must appear once")

    def _brick_key(self, c: np.ndarray) -> np.ndarray:
        nb = self.bricks_per_axis
        b = c >> self.shift
        return (b[..., 0] * nb + b[..., 1]) * nb + b[..., 2]

    def _local(self, c: np.ndarray) -> np.ndarray:
        m, s = self.brick - 1, self.shift
        return ((((c[..., 0] & m) << s) | (c[..., 1] & m)) << s) | (c[..., 2] & m)

    def lookup(self, query: np.ndarray) -> np.ndarray:
        """Row index (int32) of each ``[..., 3]`` integer query, -1 where absent or out of bounds."""
        q = np.asarray(query, dtype=np.int64)
        inside = np.all((q >= 0) & (q < self.resolution), axis=-1)
        q = np.clip(q, 0, self.resolution - 1)
        slot = self.brick_map[self._brick_key(q)]
        found = self.table[np.maximum(slot, 0), self._local(q)]
        return np.where(inside & (slot >= 0), found, -1).astype(np.int32, copy=False)

    @property
    def nbytes(self) -> int:
        """Memory held by the index."""
        return self.brick_map.nbytes + self.table.nbytes
