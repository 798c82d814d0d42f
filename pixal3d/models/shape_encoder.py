"""The shape encoder of TRELLIS.2 (``shape_enc_next_dc_f16c32_fp16``): a mesh's flexible dual grid -> shape latent.

The mirror of the shape decoder (``sparse_unet_vae.FlexiDualGridVaeDecoder``): per voxel of the 1024 grid, its
dual-vertex offset inside the voxel and its three edge flags (``DualGridFields``) go in as six channels
(``offset - 0.5``, ``flag - 0.5``); stages of ConvNeXt blocks, each but the last ending in a space-to-channel
residual block (S2C) that folds every 2×2×2 children into their parent, halve the grid four times (1024 -> 64);
a non-affine layer norm and ``to_latent`` give the posterior's mean and log-variance, of which the mean is the
latent ``[N, 32]`` (TRELLIS.2's ``encode_shape_slat`` samples no posterior). Structure, key names and precision
placement follow ``trellis2/models/sc_vaes/sparse_unet_vae.py`` (``SparseUnetVaeEncoder``,
``SparseResBlockS2C3d``) and ``fdg_vae.py`` (``FlexiDualGridVaeEncoder``): the torso's convolutions and linears
fp16, ``input_layer``/``to_latent`` and the layer norms fp32.

``encode`` also returns, per S2C block, which children each parent had (``[P, 8]`` bool): the voxels the texture
decoder must decode back to. TRELLIS.2's texture decoder finds them in the encoder's spatial cache (its C2S blocks
undo the encoder's S2C); here they are explicit, and ``guide_logits`` turns them into the subdivision logits our
decoder takes (``guide_subs``), row for row in the decoder's order.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..mesh.fields import DualGridFields
from ..nn.norms import LayerNorm32
from ..nn.sparse_conv import SparseConv3d
from ..nn.sparse_ops import SparseLinear, space_to_channel, subdivide
from ..nn.sparse_tensor import SparseTensor
from .loading import register_model
from .sparse_unet_vae import SparseConvNeXtBlock3d, _block_kwargs
from .voxel_guides import guide_for, guide_to_voxels, linear_key  # noqa: F401  (guide_* re-exported)

DOWN_BLOCK_TYPES = ("SparseResBlockS2C3d",)


class SparseResBlockS2C3d(nn.Module):
    """Space-to-channel residual block: ``[M, Cin]`` on grid 2R -> ``[P, Cout]`` on grid R (P parents).

    ``h = conv2(silu(norm2(S2C(conv1(silu(norm1(x)))))))`` with ``conv1: Cin -> Cout/8`` on the children, and
    skip = ``S2C(x)`` ``[P, 8·Cin]`` averaged over groups of ``8·Cin/Cout`` consecutive channels. Absent children
    are zeros in both (as TRELLIS.2's ``SparseSpatial2Channel``).
    """

    def __init__(self, channels: int, out_channels: int):
        super().__init__()
        if out_channels % 8 or (8 * channels) % out_channels:
            raise ValueError(f"SparseResBlockS2C3d({channels}, {out_channels}): out_channels must be divisible by 8 "
                             f"and 8·channels by out_channels")
        self.channels, self.out_channels = channels, out_channels
        self.norm1 = LayerNorm32(channels, elementwise_affine=True, eps=1e-6)
        self.conv1 = SparseConv3d(channels, out_channels // 8, 3)
        self.norm2 = LayerNorm32(out_channels, elementwise_affine=False, eps=1e-6)
        self.conv2 = SparseConv3d(out_channels, out_channels, 3)

    def forward(self, x: SparseTensor) -> tuple[SparseTensor, torch.Tensor]:
        """-> ``(h [P, Cout] on the parents, sorted by (b, x, y, z); children mask [P, 8] bool)``."""
        h, skip, mask = self.fold(x)
        return self.finish(h, skip), mask

    def fold(self, x: SparseTensor) -> tuple[SparseTensor, torch.Tensor, torch.Tensor]:
        """The part on the children: ``conv1``, then both branches folded into the parents -> ``(h [P, Cout],
        skip [P, Cout], mask [P, 8])``; each parent's values depend on its own children only (and ``conv1``'s)."""
        h = self.conv1(x.replace(F.silu(self.norm1(x.feats))))
        h, mask = space_to_channel(h)  # [P, Cout]
        folded, _ = space_to_channel(x)  # [P, 8·Cin]
        skip = folded.feats.reshape(folded.feats.shape[0], self.out_channels, -1).mean(dim=-1)
        return h, skip, mask

    def finish(self, h: SparseTensor, skip: torch.Tensor) -> SparseTensor:
        """The part on the parents: ``conv2`` and the skip."""
        h = self.conv2(h.replace(F.silu(self.norm2(h.feats))))
        return h.replace(h.feats + skip)


@dataclass(frozen=True)
class EncodeTiles:
    """How to encode in bounded memory: the first ``levels`` stages over tiles of at most ``tile_voxels`` level-0
    voxels (their cores; halos come on top); ``radius``: override of ``head_radius`` (tests)."""

    levels: int = 2
    tile_voxels: int = 1 << 20
    radius: int | None = None
    mlp_rows: int | None = 1 << 16  # the ConvNeXt blocks' norm and MLP over this many voxels at a time


@dataclass
class EncodedShape:
    """What ``encode`` gives: the latent ``[N, latent_channels]`` fp32 on the coarse grid, and per S2C block (finest
    first) the children mask ``[P, 8]`` of its parents with the parents' coordinates ``[P, 4]``."""

    latent: SparseTensor
    masks: list[torch.Tensor]
    parents: list[torch.Tensor]

    def guide_logits(self) -> list[SparseTensor]:
        """The texture decoder's ``guide_subs`` (coarsest first): per C2S block, ``+1`` for a child the mesh has and
        ``-1`` for one it has not, in the rows of the decoder's coordinates at that stage (its subdivision orders
        children parent by parent; the encoder's parents are sorted), so it decodes exactly the encoded voxels."""
        coords = self.latent.coords
        guides = []
        for mask, parents in zip(reversed(self.masks), reversed(self.parents)):
            rows = _rows_of(coords, parents)
            chosen = mask.index_select(0, rows)
            guides.append(SparseTensor(torch.where(chosen, 1.0, -1.0).to(torch.float32), coords))
            coords, _ = subdivide(coords, chosen)
        return guides


def _rows_of(coords: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The row of ``table [P, 4]`` (sorted by (b, x, y, z), unique) holding each of ``coords [N, 4]``."""
    key = linear_key(table)
    rows = torch.searchsorted(key, linear_key(coords))
    if rows.numel() and (rows.max() >= key.numel() or not torch.equal(key[rows], linear_key(coords))):
        raise ValueError("the decoder's coordinates are not the encoder's parents (a latent of another mesh?)")
    return rows




@register_model("FlexiDualGridVaeEncoder")
class FlexiDualGridVaeEncoder(nn.Module):
    """Flexible dual grid ``[M, 6]`` on the fine grid -> shape latent ``[N, latent_channels]`` on a ``2^(stages-1)``×
    coarser grid."""

    stream_unit = r"blocks\.\d+\.\d+\."  # one block of one stage in the checkpoint

    def __init__(self, model_channels: Sequence[int], latent_channels: int, num_blocks: Sequence[int],
                 block_type: Sequence[str], down_block_type: Sequence[str],
                 block_args: Sequence[dict[str, Any]] | None = None, use_fp16: bool = False):
        super().__init__()
        stages = len(num_blocks)
        if len(model_channels) != stages or len(block_type) != stages or len(down_block_type) != stages - 1:
            raise ValueError(f"encoder config: model_channels ({len(model_channels)}), num_blocks ({stages}), "
                             f"block_type ({len(block_type)}) need one entry per stage and down_block_type "
                             f"({len(down_block_type)}) one per stage boundary")
        if any(name != "SparseConvNeXtBlock3d" for name in block_type):
            raise ValueError(f"block_type {list(block_type)} is not implemented; supported: SparseConvNeXtBlock3d")
        for name in down_block_type:
            if name not in DOWN_BLOCK_TYPES:
                raise ValueError(f"down_block_type {name!r} is not implemented; supported: {DOWN_BLOCK_TYPES}")
        kwargs = _block_kwargs(block_args, stages)
        self.latent_channels = latent_channels
        self.dtype = torch.float16 if use_fp16 else torch.float32
        self.input_layer = SparseLinear(6, model_channels[0])
        self.blocks = nn.ModuleList()
        for i in range(stages):
            stage = nn.ModuleList(SparseConvNeXtBlock3d(model_channels[i], **kwargs[i]) for _ in range(num_blocks[i]))
            if i < stages - 1:
                stage.append(SparseResBlockS2C3d(model_channels[i], model_channels[i + 1]))
            self.blocks.append(stage)
        self.to_latent = SparseLinear(model_channels[-1], 2 * latent_channels)
        for module in self.blocks.modules():  # the torso's convs/linears in fp16; norms and ends stay fp32
            if isinstance(module, (SparseConv3d, nn.Linear)):
                module.to(self.dtype)

    @property
    def num_downsamplings(self) -> int:
        return len(self.blocks) - 1

    @property
    def stream_lists(self) -> tuple[str, ...]:
        return tuple(f"blocks.{i}" for i in range(len(self.blocks)))

    @staticmethod
    def inputs(fields: DualGridFields) -> SparseTensor:
        """The encoder's six input channels from a flexible dual grid (one sample, batch index 0): the dual vertex's
        offset in the voxel less 0.5 and each edge flag less 0.5 (TRELLIS.2's ``FlexiDualGridVaeEncoder.forward``)."""
        coords = torch.cat([torch.zeros_like(fields.coords[:, :1]), fields.coords], dim=1).to(torch.int32)
        feats = torch.cat([fields.dual_vertices.float() - 0.5, fields.intersected.float() - 0.5], dim=1)
        return SparseTensor(feats, coords)

    def forward(self, x: SparseTensor) -> SparseTensor:
        """``x [M, 6]`` (``inputs``) -> the latent (the posterior's mean) ``[N, latent_channels]`` fp32."""
        return self.encode_inputs(x).latent

    @torch.no_grad()
    def encode(self, fields: DualGridFields) -> EncodedShape:
        """A mesh's flexible dual grid -> its ``EncodedShape`` (latent and the children masks)."""
        return self.encode_inputs(self.inputs(fields))

    @torch.no_grad()
    def encode_tiled(self, fields: DualGridFields, tiles: EncodeTiles) -> SparseTensor:
        """``encode(fields).latent`` in bounded memory: the first ``tiles.levels`` stages (the large, fine ones) over
        spatial tiles of whole level-``levels`` parents, each with the halo ``head_radius`` says, the rest whole.
        Every operation there acts on one voxel, one parent's children, or a convolution's neighbours, so a tile's
        parents get the untiled values (for half-precision torsos, whose kernels give a row's result whatever the
        rows around it: the released encoder's); they are put back in the untiled (sorted) order."""
        from .decoder_tiling import split_boxes

        k = tiles.levels
        if not 1 <= k <= self.num_downsamplings:
            raise ValueError(f"EncodeTiles.levels={k} must be in [1, {self.num_downsamplings}]")
        for block in self.blocks.modules():
            if isinstance(block, SparseConvNeXtBlock3d):
                block.mlp_rows = tiles.mlp_rows
        x = self.inputs(fields)
        radius = self.head_radius(k) if tiles.radius is None else tiles.radius
        scale = 2 ** k
        parents = torch.unique(torch.div(x.coords[:, 1:], scale, rounding_mode="floor"), dim=0)
        per_box = max(1, int(tiles.tile_voxels * len(parents) / max(1, len(x))))
        h_parts, skip_parts, coord_parts = [], [], []
        for box in split_boxes(parents, per_box):
            crop = box.distance(x.coords[:, 1:], scale) <= radius
            h, skip = self._head(SparseTensor(x.feats[crop], x.coords[crop]), k)
            inside = box.distance(h.coords[:, 1:]) == 0
            h_parts.append(h.feats[inside])
            skip_parts.append(skip[inside])
            coord_parts.append(h.coords[inside])
        del x
        coords = torch.cat(coord_parts)
        order = torch.argsort(linear_key(coords))
        h = SparseTensor(torch.cat(h_parts).index_select(0, order), coords.index_select(0, order))
        skip = torch.cat(skip_parts).index_select(0, order)
        del h_parts, skip_parts
        h = self.blocks[k - 1][-1].finish(h, skip)
        return self._tail(h, k).latent

    def head_radius(self, levels: int) -> int:
        """The halo, in level-0 voxels, around whole level-``levels`` parents within which the encoder's input must be
        present for ``_head``'s outputs on those parents to be exact: back from the last fold (its parents read only
        their children), each level adds its convolutions (the S2C's ``conv2`` on arrival, the blocks, the next S2C's
        ``conv1``), and a level-``L+1`` distance ``d`` needs level-``L`` voxels within ``2d + 1``."""
        from .decoder_tiling import _radius

        radius = 0
        for level in range(levels - 1, -1, -1):
            stage = self.blocks[level]
            radius += sum(_radius(block.conv) for block in stage[:-1]) + _radius(stage[-1].conv1)
            if level > 0:
                radius += _radius(self.blocks[level - 1][-1].conv2)
                radius = 2 * radius + 1
        return radius

    def _head(self, x: SparseTensor, levels: int) -> tuple[SparseTensor, torch.Tensor]:
        """Stages ``0 .. levels-1`` up to the last one's fold: ``(h [P, C], skip [P, C])`` on level-``levels``
        parents, before that S2C's ``conv2``."""
        h = self.input_layer(x.type(self.input_layer.weight.dtype)).type(self.dtype)
        skip = None
        for i in range(levels):
            if i > 0:
                h = self.blocks[i - 1][-1].finish(h, skip)
            for block in self.blocks[i][:-1]:
                h = block(h)
            h, skip, _ = self.blocks[i][-1].fold(h)
        return h, skip

    def _tail(self, h: SparseTensor, start: int, masks: list | None = None, parents: list | None = None
              ) -> EncodedShape:
        """Stages ``start ..`` from their input ``h``, then the latent."""
        masks, parents = masks if masks is not None else [], parents if parents is not None else []
        for i in range(start, len(self.blocks)):
            stage = self.blocks[i]
            for block in stage[:-1] if i < self.num_downsamplings else stage:
                h = block(h)
            if i < self.num_downsamplings:
                h, mask = stage[-1](h)
                masks.append(mask)
                parents.append(h.coords)
        h = h.type(torch.float32)
        h = self.to_latent(h.replace(F.layer_norm(h.feats, h.feats.shape[-1:])))
        mean = h.feats[:, :self.latent_channels]
        return EncodedShape(latent=h.replace(mean.contiguous()), masks=masks, parents=parents)

    def encode_inputs(self, x: SparseTensor) -> EncodedShape:
        h = self.input_layer(x.type(self.input_layer.weight.dtype)).type(self.dtype)
        return self._tail(h, 0)
