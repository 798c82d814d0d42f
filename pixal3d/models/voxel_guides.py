"""The subdivision guides that take a texture decoder to a given set of voxels (a ``--mesh`` run's dual grid).

TRELLIS.2's texture decoder, given no subdivision tensor, undoes its shape encoder's space-to-channel blocks from
their cached children; here the children are explicit. Per C2S block a parent's child is kept (``+1``) when one of
the given voxels lies under it, else not (``-1``), in the decoder's row order (its subdivision lists children parent
by parent). Used by the shape encoder (``shape_encoder.guide_to_voxels``) and the tiled decode
(``decoder_tiling.decode_texture_to_voxels``, each tile's guide from its own rows).
"""
from __future__ import annotations

import torch

from ..nn.sparse_ops import child_offsets, subdivide
from ..nn.sparse_tensor import SparseTensor


def guide_to_voxels(coords: torch.Tensor, voxels: torch.Tensor, levels: int) -> list[SparseTensor]:
    """The texture decoder's ``guide_subs`` that take the latent's ``coords [N, 4]`` (``levels`` ×2 subdivisions
    coarser) to exactly those of ``voxels [M, 3]`` (x, y, z) under them: per level, ``+1`` for a child with one of
    ``voxels`` under it, else ``-1``, in the decoder's row order. On an encoder's own latent it is
    ``EncodedShape.guide_logits``."""
    guides = []
    for level in range(levels):
        guides.append(guide_for(coords, voxels, levels - level - 1))
        coords, _ = subdivide(coords, guides[-1].feats > 0)
    return guides


def guide_for(coords: torch.Tensor, voxels: torch.Tensor, shift: int) -> SparseTensor:
    """One C2S block's guide for parents ``coords [N, 4]``: ``+1`` for a child with one of ``voxels [M, 3]`` under
    it (``shift`` more ×2 levels down: the children are the voxels shifted right by ``shift``), else ``-1``."""
    fine = voxels.to(torch.int64)
    children = torch.unique(torch.cat([torch.zeros_like(fine[:, :1]), fine >> shift], dim=1), dim=0)
    key = linear_key(children)
    parent = coords.to(torch.int64)
    candidates = (parent[:, None, 1:] * 2 + child_offsets(coords.device).to(torch.int64)[None]).reshape(-1, 3)
    candidates = torch.cat([parent[:, :1].repeat_interleave(8, dim=0), candidates], dim=1)
    probe = linear_key(candidates)
    at = torch.searchsorted(key, probe).clamp(max=max(len(key) - 1, 0))
    kept = (key[at] == probe).reshape(-1, 8) if len(key) else torch.zeros(len(coords), 8, dtype=torch.bool)
    return SparseTensor(torch.where(kept, 1.0, -1.0).to(torch.float32), coords)


def linear_key(coords: torch.Tensor) -> torch.Tensor:
    """One int64 per ``(b, x, y, z)`` row (each < 4096), ordered as the rows' lexicographic order."""
    c = coords.to(torch.int64)
    return ((c[:, 0] * 4096 + c[:, 1]) * 4096 + c[:, 2]) * 4096 + c[:, 3]
