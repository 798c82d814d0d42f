"""Per-voxel linear layer and the ×2 channel↔space rearrangements of the sparse decoders.

Child index of a voxel inside its parent (×2 subdivision): ``child = (x % 2) | (y % 2) << 1 | (z % 2) << 2``
(bit0 → x, bit1 → y, bit2 → z). A parent with features ``[8·C]`` holds child ``k``'s features in channels
``k·C : (k+1)·C``.

- ``subdivide(coords, mask)`` -> the children's coordinates and, per child, the row of the ``[N·8, C]``
  view it reads: parents in input order, each parent's kept children in ascending child index (the
  order TRELLIS.2's ``SparseChannel2Spatial`` produces, so decoded voxels line up row by row).
- ``channel_to_space(x, mask)`` applies it to a ``SparseTensor`` ``[N, 8·C]`` -> ``[M, C]``.
- ``space_to_channel(x)`` is its inverse: ``[M, C]`` -> parents ``[P, 8·C]`` (lexicographically sorted,
  zeros for absent children) and the ``[P, 8]`` child mask.
"""
from __future__ import annotations

import torch
from torch import nn

from .sparse_tensor import SparseTensor

_CHILD_OFFSETS = [[(k >> axis) & 1 for axis in range(3)] for k in range(8)]  # [8, 3] (x, y, z) per child


def child_offsets(device: torch.device | str | None = None) -> torch.Tensor:
    """``[8, 3]`` int32 ``(dx, dy, dz)`` of child ``k`` (bit0 → x, bit1 → y, bit2 → z)."""
    return torch.tensor(_CHILD_OFFSETS, dtype=torch.int32, device=device)


class SparseLinear(nn.Linear):
    """``nn.Linear`` on the features of a ``SparseTensor`` (same parameter names)."""

    def forward(self, x: SparseTensor) -> SparseTensor:  # type: ignore[override]
        return x.replace(super().forward(x.feats))


def subdivide(coords: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Children of ``coords [N, 4]`` kept by ``mask [N, 8]`` bool -> ``(coords [M, 4] int32, src [M] int64)``.

    ``src`` indexes the ``[N·8, C]`` view of per-parent ``[8·C]`` features: ``src = parent·8 + child``.
    """
    if mask.shape != (coords.shape[0], 8) or mask.dtype != torch.bool:
        raise ValueError(f"subdivision mask must be bool [N, 8] with N={coords.shape[0]}; "
                         f"got {mask.dtype} {tuple(mask.shape)}")
    src = mask.reshape(-1).nonzero().squeeze(1)  # [M] parent-major, child ascending
    parent, child = src // 8, src % 8
    new = coords.index_select(0, parent)  # [M, 4]
    new[:, 1:] = new[:, 1:] * 2 + child_offsets(coords.device).index_select(0, child)
    return new, src


def channel_to_space(x: SparseTensor, mask: torch.Tensor) -> SparseTensor:
    """``x [N, 8·C]`` on a grid of size R -> ``[M, C]`` on the kept children (grid size 2R)."""
    if x.feats.shape[1] % 8:
        raise ValueError(f"channel_to_space needs a channel count divisible by 8; got {x.feats.shape[1]}")
    coords, src = subdivide(x.coords, mask)
    feats = x.feats.reshape(x.feats.shape[0] * 8, -1).index_select(0, src)  # [M, C]
    return SparseTensor(feats, coords)


def space_to_channel(x: SparseTensor) -> tuple[SparseTensor, torch.Tensor]:
    """``x [M, C]`` -> ``(parents [P, 8·C], mask [P, 8] bool)``; parents sorted by ``(b, x, y, z)``."""
    parent_coords = x.coords.clone()
    parent_coords[:, 1:] = torch.div(parent_coords[:, 1:], 2, rounding_mode="floor")
    child = ((x.coords[:, 1:] % 2).long() * torch.tensor([1, 2, 4], device=x.coords.device)).sum(dim=1)  # [M]
    parents, inverse = torch.unique(parent_coords, dim=0, return_inverse=True)  # lexicographic (b, x, y, z)
    slot = inverse * 8 + child  # [M] row of the [P·8, C] view
    feats = x.feats.new_zeros(parents.shape[0] * 8, x.feats.shape[1])
    feats[slot] = x.feats
    mask = torch.zeros(parents.shape[0] * 8, dtype=torch.bool, device=x.coords.device)
    mask[slot] = True
    return SparseTensor(feats.reshape(parents.shape[0], -1), parents.to(torch.int32)), mask.reshape(-1, 8)
