"""SparseTensor: features on a sparse set of voxels, with a cache tied to the coordinate set.

Vocabulary: a *coordinate set* is the ``coords`` tensor ``[N, 4]`` int32 whose columns are
``(batch, x, y, z)``; rows of one sample are contiguous and samples appear in batch order (the
*per-sample layout*). Tensors that share a coordinate set share one ``cache`` dict, so derived data
(neighbour maps for sparse convolution, RoPE phases, per-sample slices) is computed once per set and
reused by every layer that sees it. Changing the coordinates (``replace(feats, coords=...)``) starts a
fresh cache.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


class SparseTensor:
    """``feats [N, C]`` on ``coords [N, 4]`` int32 ``(batch, x, y, z)``, rows grouped by batch."""

    __slots__ = ("feats", "coords", "cache")

    def __init__(self, feats: torch.Tensor, coords: torch.Tensor, cache: dict[str, Any] | None = None):
        if coords.dim() != 2 or coords.shape[1] != 4:
            raise ValueError(f"coords must be [N, 4] (batch, x, y, z); got shape {tuple(coords.shape)}")
        if feats.shape[0] != coords.shape[0]:
            raise ValueError(f"feats has {feats.shape[0]} rows but coords has {coords.shape[0]}")
        if coords.dtype != torch.int32:
            raise ValueError(f"coords must be int32; got {coords.dtype}")
        self.feats = feats
        self.coords = coords
        self.cache = {} if cache is None else cache

    # -- construction -------------------------------------------------------------------------
    def replace(self, feats: torch.Tensor, coords: torch.Tensor | None = None) -> "SparseTensor":
        """New features on the same coordinate set (shared cache), or on new coords (fresh cache)."""
        if coords is None:
            return SparseTensor(feats, self.coords, self.cache)
        return SparseTensor(feats, coords)

    def to(self, *args, **kwargs) -> "SparseTensor":
        """Like ``Tensor.to`` for the features; coords follow a device change (and get a new cache)."""
        feats = self.feats.to(*args, **kwargs)
        if feats.device == self.coords.device:
            return SparseTensor(feats, self.coords, self.cache)
        return SparseTensor(feats, self.coords.to(feats.device))

    def type(self, dtype: torch.dtype) -> "SparseTensor":
        return self.replace(self.feats.type(dtype))

    def fingerprint_parts(self) -> dict[str, torch.Tensor]:
        """What identifies this tensor bit for bit (``pixal3d.staging.fingerprint``): coords and features."""
        return {"coords": self.coords, "feats": self.feats}

    # -- properties ---------------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return self.feats.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.feats.dtype

    @property
    def device(self) -> torch.device:
        return self.feats.device

    def __len__(self) -> int:
        return self.feats.shape[0]

    @property
    def batch_size(self) -> int:
        return len(self.layout)

    @property
    def layout(self) -> list[slice]:
        """Row range of each sample, in batch order (cached on the coordinate set)."""
        return self.cached("layout", self._compute_layout)

    def _compute_layout(self) -> list[slice]:
        if self.coords.shape[0] == 0:
            return []
        batch = self.coords[:, 0]
        if batch.shape[0] > 1 and bool((batch[1:] < batch[:-1]).any()):
            raise ValueError("coords rows must be grouped by batch index in ascending order")
        counts = torch.bincount(batch.long()).tolist()
        slices, start = [], 0
        for count in counts:
            slices.append(slice(start, start + count))
            start += count
        return slices

    def cached(self, key: str, compute: Callable[[], Any]) -> Any:
        """``cache[key]``, computing it once per coordinate set."""
        if key not in self.cache:
            self.cache[key] = compute()
        return self.cache[key]

    def __repr__(self) -> str:
        return (f"SparseTensor(feats={tuple(self.feats.shape)} {self.feats.dtype}, "
                f"batch_size={self.batch_size}, device={self.device})")
