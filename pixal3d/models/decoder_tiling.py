"""Decode the structured latents over spatial tiles: the untiled decode's voxels, in its row order, in
bounded memory.

Why: at the reference's sizes (~20k latent tokens at 64³ → ~9M voxels at 1024³) one decode holds about
a kilobyte per decoded voxel (benchmarks/full_work.md); a tile holds that for its own voxels only.

Why it is exact. Every operation of the sparse U-Net decoders acts on one voxel at a time — linears,
``LayerNorm32`` and the head's ``layer_norm`` (over a voxel's channels: no norm spans voxels), SiLU, the
C2S channel-to-space reshuffle, its skip and the subdivision decision — except the submanifold
convolutions, which read the neighbours within ``k//2 · dilation`` voxels. So the decoded value (and the
existence) of a voxel depends only on a bounded neighbourhood, and a tile computed with a large enough
halo reproduces it. The radius needed at the input of stage ``i``, in level-``i`` voxels, from the output
back (``receptive_radii``)::

    R[last] = sum of the last stage's block convolution radii
    R[i]    = ceil((R[i+1] + r(conv2)) / 2) + r(conv1) + sum of stage i's block convolution radii

(C2S: ``conv1`` at level i, then ``conv2`` on the children at level i+1; children within ``d`` of a box at
level i+1 have parents within ``ceil(d/2)`` of the box at level i, because boxes are whole parents.) For
the released decoders (4/16/8/4/0 blocks) ``R = [18, 24, 13, 6, 0]``.

A tile is a box of voxels at the start level ``s`` (its *core*). The stages before ``s`` run untiled. A
tile's run takes the level-``s`` voxels within ``R[s]`` of its core, and at the input of every later
stage keeps only the voxels within ``R[i]`` of the core scaled to level ``i``: the expensive last levels
carry a halo of a few voxels. Of the decoded voxels it keeps those whose level-``s`` ancestor lies in the
core; the cores partition the level-``s`` voxels, so each decoded voxel comes from exactly one tile.

Order. The untiled decode lists children parent by parent, so its rows are sorted by (level-``s``
ancestor's row, path of child indices below it); a tile's rows are that order restricted to its core.
A stable sort of all tiles' rows by ancestor row therefore gives the untiled order exactly.

Bits. Equal bits also need every kernel to give a voxel's result independently of how many rows share
the call. Checked on CPU: bf16/fp16 GEMMs and elementwise kernels are; fp32 GEMMs are from 12 rows on
(``sparse_conv.MIN_GEMM_ROWS`` keeps convolution chunks above that; tiles hold at least
``MIN_TILE_VOXELS`` start-level voxels); fp32 SiLU is *not* (PyTorch computes the last partial vectors of
each thread's range with a scalar formula, ~4% of those values differ by an ulp), so fp32 torsos — which
the released decoders do not use — agree to float rounding, not bit for bit, as the untiled decode
itself differs between thread counts. The head's sigmoid/softplus run once, on the reordered whole.

Texture decoding rides on the same tiles: the shape decoder's subdivision logits of a tile guide the
texture decoder on the same tile, whose voxels (and so its crops) are then the same.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..mesh.fields import DualGridFields, PbrVoxels
from ..nn.sparse_conv import SparseConv3d
from ..nn.sparse_tensor import SparseTensor
from .sparse_unet_vae import (
    FlexiDualGridVaeDecoder,
    SparseConvNeXtBlock3d,
    SparseResBlockC2S3d,
    SparseUnetVaeDecoder,
    _check_single_sample,
)
from .voxel_guides import guide_for, guide_to_voxels

logger = logging.getLogger(__name__)

REFERENCE_GROWTH = 4.6  # voxels kept per voxel per level in the reference: ~20k tokens -> ~9M voxels in 4 levels
MIN_TILE_VOXELS = 64  # fewest start-level voxels in a tile's core (keeps every GEMM far above 12 rows)


def _radius(conv: SparseConv3d) -> int:
    return (conv.kernel_size // 2) * conv.dilation


def receptive_radii(decoder: SparseUnetVaeDecoder) -> list[int]:
    """``R[i]``: the Chebyshev distance, in level-``i`` voxels, around a region within which the input of
    stage ``i`` must be exact for the decoder's output on that region to be exact (see module doc)."""
    last = decoder.num_upsamplings
    stages = [list(stage.children()) for stage in decoder.blocks.children()]  # structure only: a streamed decoder's
    # blocks are not materialised to read their kernel sizes

    def blocks_radius(i: int) -> int:
        stage = stages[i]
        total = 0
        for block in stage[:-1] if i < last else stage:
            if not isinstance(block, SparseConvNeXtBlock3d):
                raise TypeError(f"receptive_radii knows SparseConvNeXtBlock3d, not {type(block).__name__}: "
                                f"add its receptive field before tiling this decoder")
            total += _radius(block.conv)
        return total

    radii = [0] * (last + 1)
    radii[last] = blocks_radius(last)
    for i in range(last - 1, -1, -1):
        c2s = stages[i][-1]
        if not isinstance(c2s, SparseResBlockC2S3d):
            raise TypeError(f"stage {i} ends in {type(c2s).__name__}, not SparseResBlockC2S3d")
        child = radii[i + 1] + _radius(c2s.conv2)
        radii[i] = -(-child // 2) + _radius(c2s.conv1) + blocks_radius(i)
    return radii


@dataclass(frozen=True)
class Box:
    """Axis-aligned box of voxels ``lo <= (x, y, z) < hi`` at the start level."""

    lo: tuple[int, int, int]
    hi: tuple[int, int, int]

    def distance(self, xyz: torch.Tensor, scale: int = 1) -> torch.Tensor:
        """Chebyshev distance ``[N]`` of voxels ``xyz [N, 3]`` to this box scaled ``scale``× (0 inside)."""
        lo = torch.tensor(self.lo, dtype=xyz.dtype, device=xyz.device) * scale
        hi = torch.tensor(self.hi, dtype=xyz.dtype, device=xyz.device) * scale - 1
        return torch.maximum(lo - xyz, xyz - hi).clamp_(min=0).amax(dim=1)

    def contains(self, xyz: torch.Tensor) -> torch.Tensor:
        return self.distance(xyz) == 0


def _bisect(box: Box, xyz: torch.Tensor) -> tuple[Box, Box] | None:
    """Split ``box`` across its longest side at the median of the voxels ``xyz`` inside it (None: one cell)."""
    sides = [h - l for l, h in zip(box.lo, box.hi)]
    for axis in sorted(range(3), key=lambda a: -sides[a]):
        if sides[axis] < 2:
            continue
        values = torch.sort(xyz[:, axis]).values
        cut = int(values[len(values) // 2]) if len(values) else (box.lo[axis] + box.hi[axis]) // 2
        cut = min(max(cut, box.lo[axis] + 1), box.hi[axis] - 1)
        left_hi, right_lo = list(box.hi), list(box.lo)
        left_hi[axis] = right_lo[axis] = cut
        return Box(box.lo, tuple(left_hi)), Box(tuple(right_lo), box.hi)
    return None


def split_boxes(xyz: torch.Tensor, max_voxels: int) -> list[Box]:
    """Boxes partitioning the bounding box of ``xyz [N, 3]``, each holding at most ``max_voxels`` of the
    voxels (bisection at the median of the longest side); a single cell may hold more."""
    if len(xyz) == 0:
        return []
    root = Box(tuple(int(v) for v in xyz.amin(dim=0)), tuple(int(v) + 1 for v in xyz.amax(dim=0)))
    out, todo = [], [(root, xyz)]
    while todo:
        box, inside = todo.pop()
        halves = _bisect(box, inside) if len(inside) > max_voxels else None
        if halves is None:
            if len(inside):
                out.append(box)
            continue
        for half in reversed(halves):
            todo.append((half, inside[half.contains(inside)]))
    return out


@dataclass(frozen=True)
class TilePlan:
    """How to tile one decode.

    ``start_level``: the stages before it run untiled (their levels are small); ``tile_voxels``: the most
    final-level voxels one tile may compute, halo included (a tile that would decode more is split before
    its last, largest step); ``growth``: voxels kept per voxel per level, to size the first boxes (the
    prefix's own growth is used when larger); ``radii``: override of ``receptive_radii`` (tests).
    """

    start_level: int = 0
    tile_voxels: int = 1 << 22
    growth: float = REFERENCE_GROWTH
    radii: tuple[int, ...] | None = None


@dataclass
class TiledDecodeReport:
    """What a tiled decode did: tiles run, boxes split for being too large, voxels decoded and computed."""

    tiles: int = 0
    splits: int = 0
    start_voxels: int = 0
    decoded_voxels: int = 0
    computed_voxels: int = 0  # final-level voxels computed over all tiles, halos included
    largest_tile: int = 0  # most final-level voxels one tile computed

    @property
    def halo_overhead(self) -> float:
        """Final-level voxels computed per voxel kept (1.0: no halo)."""
        return self.computed_voxels / max(1, self.decoded_voxels)


class _TileOutput(NamedTuple):
    out: SparseTensor  # head output [m, C] on the core's decoded voxels, in the untiled relative order
    subs: list[SparseTensor | None]  # per stage: the C2S subdivision logits of this tile (None before start)
    computed: int  # final-level voxels computed (halo included)


def _crop(h: SparseTensor, keep: torch.Tensor) -> SparseTensor:
    if bool(keep.all()):
        return h
    return SparseTensor(h.feats[keep], h.coords[keep])


def _run_tile(decoder: SparseUnetVaeDecoder, h: SparseTensor, box: Box, start: int, radii: list[int],
              guide: list[SparseTensor | None] | None, limit: int | None) -> _TileOutput | None:
    """Stages ``start..`` of ``decoder`` on one tile's cropped input ``h``; None when ``limit`` (final voxels
    the shape decoder would make) is exceeded, checked before the last C2S block."""
    last = decoder.num_upsamplings
    subs: list[SparseTensor | None] = [None] * last
    computed = len(h)
    for i in range(start, last + 1):
        if i > start:
            if i == last:
                computed = len(h)  # the last C2S's output, before the crop: what the tile computed
            h = _crop(h, box.distance(h.coords[:, 1:], 2 ** (i - start)) <= radii[i])
        h = decoder.stage_blocks(i, h)
        if i == last:
            break
        c2s = decoder.blocks[i][-1]
        if limit is not None and i == last - 1 and c2s.pred_subdiv:
            if int((c2s.subdiv_logits(h).feats > 0).sum()) > limit:
                return None
        given = guide[i] if guide is not None else None
        h, subs[i] = c2s(h, given(h) if callable(given) else given)
    h = _crop(h, box.distance(h.coords[:, 1:], 2 ** (last - start)) == 0)
    return _TileOutput(decoder.head(h), subs, computed)


class _RowIndex:
    """Row of a voxel of ``coords [N, 4]`` (one sample) from its ``(x, y, z)``, by binary search."""

    def __init__(self, coords: torch.Tensor):
        xyz = coords[:, 1:].long()
        self.extent = xyz.amax(dim=0) + 1 if len(xyz) else torch.ones(3, dtype=torch.long)
        self.keys, self.order = torch.sort(self._keys(xyz))

    def _keys(self, xyz: torch.Tensor) -> torch.Tensor:
        return (xyz[:, 0] * self.extent[1] + xyz[:, 1]) * self.extent[2] + xyz[:, 2]

    def rows(self, xyz: torch.Tensor) -> torch.Tensor:
        keys = self._keys(xyz.long())
        pos = torch.searchsorted(self.keys, keys).clamp_(max=len(self.keys) - 1)
        if not bool((self.keys[pos] == keys).all()):
            raise RuntimeError("tiled decode: a decoded voxel has no ancestor among the start-level voxels")
        return self.order[pos]


def _concat_in_order(parts: list[torch.Tensor], order: torch.Tensor) -> torch.Tensor:
    whole = torch.cat(parts)
    parts.clear()
    return whole.index_select(0, order)


@torch.no_grad()
def decode_tiled(shape_decoder: FlexiDualGridVaeDecoder, latent: SparseTensor, plan: TilePlan, *,
                 tex_decoder: SparseUnetVaeDecoder | None = None, tex_latent: SparseTensor | None = None,
                 resolution: int | None = None) -> tuple[DualGridFields, PbrVoxels | None, TiledDecodeReport]:
    """Tiled ``decode_fields`` (and, with ``tex_decoder``, ``decode_pbr`` guided by the same subdivisions):
    the same ``DualGridFields`` / ``PbrVoxels`` as the untiled decode (module doc), computed one tile at a time.

    ``latent`` and ``tex_latent``: one sample on the same coords. ``resolution``: grid size of the PBR
    voxels (default: the shape decoder's).
    """
    _check_single_sample(latent)
    last = shape_decoder.num_upsamplings
    start = plan.start_level
    if not 0 <= start <= last:
        raise ValueError(f"TilePlan.start_level={start} must be in [0, {last}] for this decoder")
    radii = list(plan.radii) if plan.radii is not None else receptive_radii(shape_decoder)
    if len(radii) != last + 1:
        raise ValueError(f"TilePlan.radii needs {last + 1} entries (one per stage); got {len(radii)}")
    if tex_decoder is not None:
        if tex_latent is None or not torch.equal(tex_latent.coords, latent.coords):
            raise ValueError("decode_tiled: tex_latent must be given and live on the shape latent's coords")
        if tex_decoder.num_upsamplings != last or (plan.radii is None and receptive_radii(tex_decoder) != radii):
            raise ValueError("decode_tiled: the texture decoder must have the shape decoder's stages and "
                             "receptive field (the tiles' crops must select the same voxels)")
    report = TiledDecodeReport()

    # The untiled prefix: stages 0 .. start-1 of both decoders.
    h_shape, prefix_subs = shape_decoder.run_stages(shape_decoder.embed(latent), 0, start)
    h_tex = None
    if tex_decoder is not None:
        guide = [*prefix_subs, *[None] * (last - start)]
        h_tex, _ = tex_decoder.run_stages(tex_decoder.embed(tex_latent), 0, start, guide)
    del prefix_subs
    xyz = h_shape.coords[:, 1:]
    report.start_voxels = len(xyz)
    growth = plan.growth
    if start > 0 and len(latent):
        growth = max(growth, (len(xyz) / len(latent)) ** (1 / start))
    per_box = max(MIN_TILE_VOXELS, int(plan.tile_voxels / growth ** (last - start)))
    queue = deque(split_boxes(xyz, per_box))
    index = _RowIndex(h_shape.coords)
    coords, shape_out, tex_out, rows = [], [], [], []
    while queue:
        box = queue.popleft()
        keep = box.distance(xyz) <= radii[start]
        splittable = int(box.contains(xyz).sum()) > MIN_TILE_VOXELS
        tile = _run_tile(shape_decoder, _crop(h_shape, keep), box, start, radii, None,
                         plan.tile_voxels if splittable else None)
        if tile is None:
            halves = _bisect(box, xyz[box.contains(xyz)])
            if halves is not None:
                report.splits += 1
                queue.extendleft(reversed(halves))
                continue
            tile = _run_tile(shape_decoder, _crop(h_shape, keep), box, start, radii, None, None)
        if tex_decoder is not None:
            tex_tile = _run_tile(tex_decoder, _crop(h_tex, keep), box, start, radii, tile.subs, None)
            if not torch.equal(tex_tile.out.coords, tile.out.coords):
                raise RuntimeError("tiled decode: texture and shape tiles decoded different voxels")
            tex_out.append(tex_tile.out.feats)
        report.tiles += 1
        report.computed_voxels += tile.computed
        report.largest_tile = max(report.largest_tile, tile.computed)
        coords.append(tile.out.coords)
        shape_out.append(tile.out.feats)
        rows.append(index.rows(torch.div(tile.out.coords[:, 1:], 2 ** (last - start), rounding_mode="floor")))
        del tile
    del h_shape, h_tex
    order = torch.argsort(torch.cat(rows), stable=True)
    rows.clear()
    all_coords = _concat_in_order(coords, order)
    report.decoded_voxels = len(all_coords)
    fields = shape_decoder.fields_from_output(SparseTensor(_concat_in_order(shape_out, order), all_coords))
    pbr = None
    if tex_decoder is not None:
        attrs = _concat_in_order(tex_out, order) * 0.5 + 0.5
        pbr = PbrVoxels(coords=all_coords[:, 1:].contiguous(), attrs=attrs,
                        resolution=shape_decoder.resolution if resolution is None else resolution)
    logger.info("tiled decode: %d tiles (%d splits) from level %d, %d voxels decoded, %.3f computed per kept",
                report.tiles, report.splits, start, report.decoded_voxels, report.halo_overhead)
    return fields, pbr, report


@torch.no_grad()
def decode_texture_to_voxels(tex_decoder: SparseUnetVaeDecoder, tex_latent: SparseTensor, voxels: torch.Tensor,
                             resolution: int, plan: TilePlan | None = None) -> PbrVoxels:
    """The texture decode of a ``--mesh`` run: ``decode_pbr`` guided to exactly ``voxels [M, 3]`` (a mesh's dual grid,
    ``voxel_guides.guide_to_voxels``) — whole when ``plan`` is None, else over the plan's tiles, each tile's guide
    computed from its own rows (so the same voxels, values and order as the whole decode)."""
    _check_single_sample(tex_latent)
    last = tex_decoder.num_upsamplings
    if plan is None:
        return tex_decoder.decode_pbr(tex_latent, guide_to_voxels(tex_latent.coords, voxels, last), resolution)
    start = plan.start_level
    if not 0 <= start <= last:
        raise ValueError(f"TilePlan.start_level={start} must be in [0, {last}] for this decoder")
    radii = list(plan.radii) if plan.radii is not None else receptive_radii(tex_decoder)
    guide = [lambda h, i=i: guide_for(h.coords, voxels, last - i - 1) for i in range(last)]
    h = tex_decoder.embed(tex_latent)
    for i in range(start):  # the untiled prefix
        h = tex_decoder.stage_blocks(i, h)
        h, _ = tex_decoder.blocks[i][-1](h, guide[i](h))
    xyz = h.coords[:, 1:]
    growth = max(plan.growth, (len(xyz) / max(1, len(tex_latent))) ** (1 / start)) if start > 0 else plan.growth
    per_box = max(MIN_TILE_VOXELS, int(plan.tile_voxels / growth ** (last - start)))
    index = _RowIndex(h.coords)
    coords, out, rows = [], [], []
    for box in split_boxes(xyz, per_box):
        tile = _run_tile(tex_decoder, _crop(h, box.distance(xyz) <= radii[start]), box, start, radii, guide, None)
        coords.append(tile.out.coords)
        out.append(tile.out.feats)
        rows.append(index.rows(torch.div(tile.out.coords[:, 1:], 2 ** (last - start), rounding_mode="floor")))
        del tile
    del h
    order = torch.argsort(torch.cat(rows), stable=True)
    all_coords = _concat_in_order(coords, order)
    return PbrVoxels(coords=all_coords[:, 1:].contiguous(), attrs=_concat_in_order(out, order) * 0.5 + 0.5,
                     resolution=resolution)


@torch.no_grad()
def decode_shape_and_texture(shape_decoder: FlexiDualGridVaeDecoder, tex_decoder: SparseUnetVaeDecoder,
                             shape_latent: SparseTensor, tex_latent: SparseTensor, resolution: int,
                             plan: TilePlan | None = None) -> tuple[DualGridFields, PbrVoxels]:
    """The decode stage's work: shape fields, then PBR voxels guided by its subdivisions — in one pass
    when ``plan`` is None (the decoders' own methods), else over the plan's tiles (same result)."""
    shape_decoder.set_resolution(resolution)
    if plan is None:
        fields, subs = shape_decoder.decode_fields(shape_latent)
        return fields, tex_decoder.decode_pbr(tex_latent, subs, resolution)
    fields, pbr, _ = decode_tiled(shape_decoder, shape_latent, plan, tex_decoder=tex_decoder,
                                  tex_latent=tex_latent, resolution=resolution)
    return fields, pbr
