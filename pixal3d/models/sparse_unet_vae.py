"""Sparse U-Net VAE decoders of the structured latents: shape (flexible dual grid) and texture (PBR).

A decoder takes a latent ``SparseTensor [N, 32]`` on a coarse grid (64³ in the 1024 cascade) and runs
stages of ConvNeXt blocks; each stage but the last ends in a channel-to-space residual block (C2S) that
subdivides every voxel ×2 per axis, keeping the children whose subdivision logit is > 0. The shape
decoder predicts those logits (``to_subdiv``); the texture decoder is guided by the shape decoder's
logits (``guide_subs``) so both decode to the same voxels. Structure and key names follow TRELLIS.2
``trellis2/models/sc_vaes/sparse_unet_vae.py`` and ``fdg_vae.py`` (reference notes §2.5).

Precision placement (reference): convolutions and linears of ``blocks`` in fp16 (``use_fp16``), layer-norm
affine parameters and the ``from_latent`` / ``output_layer`` ends in fp32; activations fp16 inside,
fp32 at both ends; the subdivision decision ``logit > 0`` is taken on the fp16 logits.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..mesh.fields import DualGridFields, PbrVoxels
from ..nn.norms import LayerNorm32
from ..nn.sparse_conv import SparseConv3d
from ..nn.sparse_ops import SparseLinear, subdivide
from ..nn.sparse_tensor import SparseTensor
from .loading import register_model

BLOCK_TYPES = ("SparseConvNeXtBlock3d",)
UP_BLOCK_TYPES = ("SparseResBlockC2S3d",)
_TRAINING_ONLY_BLOCK_ARGS = ("use_checkpoint",)


class SparseConvNeXtBlock3d(nn.Module):
    """``x + mlp(norm(conv(x)))`` with a 3×3×3 submanifold conv and a ``C → r·C → C`` SiLU MLP."""

    def __init__(self, channels: int, mlp_ratio: float = 4.0):
        super().__init__()
        hidden = int(channels * mlp_ratio)
        self.conv = SparseConv3d(channels, channels, 3)
        self.norm = LayerNorm32(channels, elementwise_affine=True, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(channels, hidden), nn.SiLU(), nn.Linear(hidden, channels))
        self.mlp_rows: int | None = None  # norm + MLP over this many voxels at a time (None: all at once)

    def forward(self, x: SparseTensor) -> SparseTensor:
        h = self.conv(x).feats
        if self.mlp_rows is None or len(h) <= self.mlp_rows:
            h = self.mlp(self.norm(h))
        else:  # per voxel: the same values over row chunks (half-precision kernels; the encoder's tiles rely on it)
            h = torch.cat([self.mlp(self.norm(h[i:i + self.mlp_rows])) for i in range(0, len(h), self.mlp_rows)])
        return x.replace(h + x.feats)


class SparseResBlockC2S3d(nn.Module):
    """Channel-to-space residual block: ``[N, Cin]`` on grid R -> ``[M, Cout]`` on grid 2R.

    ``h = conv2(silu(norm2(C2S(conv1(silu(norm1(x)))))))``, skip = ``C2S(x)`` with each of its ``Cin/8``
    channels repeated ``Cout/(Cin/8)`` times. With ``pred_subdiv`` the kept children are those of
    ``to_subdiv(x) > 0``; otherwise the caller passes the logits.
    """

    def __init__(self, channels: int, out_channels: int, pred_subdiv: bool = True):
        super().__init__()
        if channels % 8 or out_channels % (channels // 8):
            raise ValueError(f"SparseResBlockC2S3d({channels}, {out_channels}): channels must be divisible by 8 "
                             f"and out_channels by channels/8")
        self.channels, self.out_channels, self.pred_subdiv = channels, out_channels, pred_subdiv
        self.norm1 = LayerNorm32(channels, elementwise_affine=True, eps=1e-6)
        self.conv1 = SparseConv3d(channels, out_channels * 8, 3)
        self.norm2 = LayerNorm32(out_channels, elementwise_affine=False, eps=1e-6)
        self.conv2 = SparseConv3d(out_channels, out_channels, 3)
        if pred_subdiv:
            self.to_subdiv = SparseLinear(channels, 8)

    def subdiv_logits(self, x: SparseTensor) -> SparseTensor:
        """``[N, 8]`` subdivision logits of ``x`` (child kept where > 0)."""
        return self.to_subdiv(x)

    def forward(self, x: SparseTensor, subdiv: SparseTensor | None = None) -> tuple[SparseTensor, SparseTensor]:
        """-> ``(h [M, Cout], subdiv logits [N, 8])`` (the predicted or the given logits)."""
        if self.pred_subdiv:
            subdiv = self.subdiv_logits(x)
        elif subdiv is None:
            raise ValueError("SparseResBlockC2S3d(pred_subdiv=False) needs the subdivision logits of the "
                             "shape decoder (guide_subs)")
        if subdiv.feats.shape != (x.feats.shape[0], 8):
            raise ValueError(f"subdivision logits must be [{x.feats.shape[0]}, 8] for this stage; "
                             f"got {tuple(subdiv.feats.shape)} (guide_subs from a different latent?)")
        coords, src = subdivide(x.coords, subdiv.feats > 0)
        h = self.conv1(x.replace(F.silu(self.norm1(x.feats)))).feats  # [N, 8·Cout]
        h = h.reshape(h.shape[0] * 8, self.out_channels).index_select(0, src)  # [M, Cout]
        skip = x.feats.reshape(x.feats.shape[0] * 8, -1).index_select(0, src)  # [M, Cin/8]
        skip = skip.repeat_interleave(self.out_channels // skip.shape[1], dim=1)  # [M, Cout]
        h = SparseTensor(F.silu(self.norm2(h)), coords)
        h = self.conv2(h)
        return h.replace(h.feats + skip), subdiv


def _block_kwargs(block_args: Sequence[dict[str, Any]] | None, stages: int) -> list[dict[str, Any]]:
    """Per-stage ConvNeXt keyword arguments from ``block_args`` (training-only keys dropped)."""
    if block_args is None:
        return [{} for _ in range(stages)]
    if len(block_args) != stages:
        raise ValueError(f"block_args has {len(block_args)} entries but there are {stages} stages")
    out = []
    for i, args in enumerate(block_args):
        unknown = set(args) - {"mlp_ratio", *_TRAINING_ONLY_BLOCK_ARGS}
        if unknown:
            raise ValueError(f"block_args[{i}] has unsupported key(s) {sorted(unknown)}; "
                             f"supported: mlp_ratio (and training-only {list(_TRAINING_ONLY_BLOCK_ARGS)})")
        out.append({k: v for k, v in args.items() if k == "mlp_ratio"})
    return out


@register_model("SparseUnetVaeDecoder")
class SparseUnetVaeDecoder(nn.Module):
    """Structured latent ``[N, latent_channels]`` -> ``[M, out_channels]`` on a ``2^(stages-1)``× finer grid."""

    stream_unit = r"blocks\.\d+\.\d+\."  # one block of one stage in the checkpoint (see ``stream_lists``)

    def __init__(self, out_channels: int, model_channels: Sequence[int], latent_channels: int,
                 num_blocks: Sequence[int], block_type: Sequence[str], up_block_type: Sequence[str],
                 block_args: Sequence[dict[str, Any]] | None = None, use_fp16: bool = False,
                 pred_subdiv: bool = True):
        super().__init__()
        stages = len(num_blocks)
        if len(model_channels) != stages or len(block_type) != stages or len(up_block_type) != stages - 1:
            raise ValueError(f"decoder config: model_channels ({len(model_channels)}), num_blocks ({stages}), "
                             f"block_type ({len(block_type)}) need one entry per stage and up_block_type "
                             f"({len(up_block_type)}) one per stage boundary")
        for name in block_type:
            if name not in BLOCK_TYPES:
                raise ValueError(f"block_type {name!r} is not implemented; supported: {BLOCK_TYPES}")
        for name in up_block_type:
            if name not in UP_BLOCK_TYPES:
                raise ValueError(f"up_block_type {name!r} is not implemented; supported: {UP_BLOCK_TYPES}")
        kwargs = _block_kwargs(block_args, stages)
        self.out_channels, self.pred_subdiv = out_channels, pred_subdiv
        self.dtype = torch.float16 if use_fp16 else torch.float32
        self.from_latent = SparseLinear(latent_channels, model_channels[0])
        self.blocks = nn.ModuleList()
        for i in range(stages):
            stage = nn.ModuleList(SparseConvNeXtBlock3d(model_channels[i], **kwargs[i]) for _ in range(num_blocks[i]))
            if i < stages - 1:
                stage.append(SparseResBlockC2S3d(model_channels[i], model_channels[i + 1], pred_subdiv=pred_subdiv))
            self.blocks.append(stage)
        self.output_layer = SparseLinear(model_channels[-1], out_channels)
        for module in self.blocks.modules():  # the torso's convs/linears in fp16; norms and ends stay fp32
            if isinstance(module, (SparseConv3d, nn.Linear)):
                module.to(self.dtype)

    @property
    def num_upsamplings(self) -> int:
        return len(self.blocks) - 1

    @property
    def stream_lists(self) -> tuple[str, ...]:
        """The ModuleLists whose children the stream policy copies to the device one at a time
        (pixal3d.staging.stream): each stage's blocks (a C2S block of the first stage is the largest, 241 MB);
        ``from_latent`` and ``output_layer`` stay."""
        return tuple(f"blocks.{i}" for i in range(len(self.blocks)))

    def _stage(self, i: int, h: SparseTensor, subdiv: SparseTensor | None = None
               ) -> tuple[SparseTensor, SparseTensor | None]:
        """Run stage ``i``: its ConvNeXt blocks, then (except the last stage) its C2S block."""
        h = self.stage_blocks(i, h)
        if i < self.num_upsamplings:
            return self.blocks[i][-1](h, subdiv)
        return h, None

    def stage_blocks(self, i: int, h: SparseTensor) -> SparseTensor:
        """The ConvNeXt blocks of stage ``i`` (not its C2S block) on ``h``."""
        stage = self.blocks[i]
        for block in stage[:-1] if i < self.num_upsamplings else stage:
            h = block(h)
        return h

    def forward(self, latent: SparseTensor, guide_subs: Sequence[SparseTensor] | None = None,
                return_subs: bool = False) -> SparseTensor | tuple[SparseTensor, list[SparseTensor]]:
        """Decoded ``[M, out_channels]`` fp32 (and, with ``return_subs``, the subdivision logits per stage)."""
        if guide_subs is not None and self.pred_subdiv:
            raise ValueError("guide_subs is for decoders built with pred_subdiv=False (the texture decoder)")
        if guide_subs is None and not self.pred_subdiv:
            raise ValueError("this decoder (pred_subdiv=False) needs guide_subs: the subdivision logits returned "
                             "by the shape decoder for the same latent coordinates (return_subs=True)")
        if guide_subs is not None and len(guide_subs) != self.num_upsamplings:
            raise ValueError(f"guide_subs has {len(guide_subs)} entries; this decoder has {self.num_upsamplings} "
                             f"upsampling stages")
        h, subs = self.run_stages(self.embed(latent), 0, len(self.blocks), guide_subs)
        h = self.head(h)
        return (h, subs) if return_subs else h

    def embed(self, latent: SparseTensor) -> SparseTensor:
        """``from_latent`` (fp32) and the cast to the torso dtype: ``[N, latent_channels]`` -> ``[N, C0]``."""
        return self.from_latent(latent.type(self.from_latent.weight.dtype)).type(self.dtype)

    def run_stages(self, h: SparseTensor, start: int, stop: int,
                   guide_subs: Sequence[SparseTensor] | None = None) -> tuple[SparseTensor, list[SparseTensor]]:
        """Stages ``start .. stop-1`` on ``h`` (the input of stage ``start``) -> (input of stage ``stop`` or the
        last stage's output, the subdivision logits of the C2S blocks run). ``guide_subs`` is indexed by stage."""
        subs = []
        for i in range(start, stop):
            h, sub = self._stage(i, h, guide_subs[i] if guide_subs is not None and i < self.num_upsamplings else None)
            if sub is not None:
                subs.append(sub)
        return h, subs

    def head(self, h: SparseTensor) -> SparseTensor:
        """Per-voxel output: fp32, non-affine layer norm, ``output_layer`` -> ``[M, out_channels]``."""
        h = h.type(torch.float32)
        return self.output_layer(h.replace(F.layer_norm(h.feats, h.feats.shape[-1:])))

    @torch.no_grad()
    def upsample(self, latent: SparseTensor, times: int) -> torch.Tensor:
        """Coordinates ``[M, 4]`` int32 after ``times`` predicted ×2 subdivisions (the cascade's LR→HR step).

        Only what decides the coordinates is computed: the last subdivision needs the logits, not the
        features, of its stage.
        """
        if not self.pred_subdiv:
            raise ValueError("upsample needs a decoder that predicts subdivisions (pred_subdiv=True)")
        if not 0 <= times <= self.num_upsamplings:
            raise ValueError(f"upsample times={times} must be in [0, {self.num_upsamplings}]")
        if times == 0:
            return latent.coords
        h = self.embed(latent)
        for i in range(times - 1):
            h, _ = self._stage(i, h)
        for block in self.blocks[times - 1][:-1]:
            h = block(h)
        logits = self.blocks[times - 1][-1].subdiv_logits(h)
        coords, _ = subdivide(h.coords, logits.feats > 0)
        return coords

    @torch.no_grad()
    def decode_pbr(self, latent: SparseTensor, guide_subs: Sequence[SparseTensor], resolution: int) -> PbrVoxels:
        """Texture decode of one sample: ``PbrVoxels`` with ``attrs = h·0.5 + 0.5`` (no clamp) on the voxels
        that ``guide_subs`` (the shape decoder's subdivision logits) select, at grid size ``resolution``."""
        _check_single_sample(latent)
        h = self(latent, guide_subs=guide_subs)
        return PbrVoxels(coords=h.coords[:, 1:].contiguous(), attrs=h.feats * 0.5 + 0.5, resolution=resolution)


@register_model("FlexiDualGridVaeDecoder")
class FlexiDualGridVaeDecoder(SparseUnetVaeDecoder):
    """Shape decoder: 7 channels per voxel -> flexible-dual-grid fields (dual vertex, edge flags, split weight)."""

    def __init__(self, resolution: int, model_channels: Sequence[int], latent_channels: int,
                 num_blocks: Sequence[int], block_type: Sequence[str], up_block_type: Sequence[str],
                 block_args: Sequence[dict[str, Any]] | None = None, voxel_margin: float = 0.5,
                 use_fp16: bool = False):
        super().__init__(7, model_channels, latent_channels, num_blocks, block_type, up_block_type,
                         block_args, use_fp16, pred_subdiv=True)
        self.resolution = resolution
        self.voxel_margin = voxel_margin

    def set_resolution(self, resolution: int) -> None:
        """Grid size of the decoded voxels (1024 in the 1024 cascade; the json's value is a training one)."""
        self.resolution = resolution

    def fields_from_output(self, h: SparseTensor) -> DualGridFields:
        """Raw 7-channel output of one sample -> ``DualGridFields`` (reference §1.9)."""
        feats = h.feats.float()
        margin = self.voxel_margin
        return DualGridFields(
            coords=h.coords[:, 1:].contiguous(),
            dual_vertices=(1 + 2 * margin) * torch.sigmoid(feats[:, 0:3]) - margin,
            intersected=feats[:, 3:6] > 0,
            split_weight=F.softplus(feats[:, 6]),
            resolution=self.resolution,
        )

    @torch.no_grad()
    def decode_fields(self, latent: SparseTensor) -> tuple[DualGridFields, list[SparseTensor]]:
        """Shape decode of one sample -> ``(DualGridFields, subs)``; ``subs`` guide the texture decoder."""
        _check_single_sample(latent)
        h, subs = self(latent, return_subs=True)
        return self.fields_from_output(h), subs


def _check_single_sample(latent: SparseTensor) -> None:
    if latent.batch_size != 1:
        raise ValueError(f"decode one sample at a time: the latent holds {latent.batch_size} samples "
                         f"(split it by latent.layout)")
