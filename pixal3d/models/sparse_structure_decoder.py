"""Sparse-structure decoder: dense 3-D conv net from the 16³×8 latent to 64³ occupancy logits.

Structure and key names follow TRELLIS.2 ``trellis2/models/sparse_structure_vae.py`` (reference notes
§2.4): ``input_layer`` conv → ``middle_block`` ResBlocks → per resolution ``num_res_blocks`` ResBlocks and
an upsampling block (conv to 8× channels + 3-D pixel shuffle) → ``out_layer`` (channel LayerNorm, SiLU,
conv). Precision placement: convolutions of ``middle_block``/``blocks`` in fp16 (``use_fp16``), their
channel LayerNorms computed and stored in fp32, ``input_layer``/``out_layer`` in fp32.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.norms import ChannelLayerNorm32
from .loading import register_model


def pixel_shuffle_3d(x: torch.Tensor, factor: int) -> torch.Tensor:
    """``[B, C·f³, D, H, W]`` -> ``[B, C, f·D, f·H, f·W]``; channel ``c·f³ + i·f² + j·f + k`` goes to
    spatial offset ``(i, j, k)`` (the first spatial dim is the slowest sub-index)."""
    b, c, d, h, w = x.shape
    x = x.reshape(b, c // factor**3, factor, factor, factor, d, h, w)
    x = x.permute(0, 1, 5, 2, 6, 3, 7, 4)  # [B, C, D, f, H, f, W, f]
    return x.reshape(b, c // factor**3, d * factor, h * factor, w * factor)


class ResBlock3d(nn.Module):
    """``x + conv2(silu(norm2(conv1(silu(norm1(x))))))`` at constant channel count."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm1 = ChannelLayerNorm32(channels)
        self.conv1 = nn.Conv3d(channels, channels, 3, padding=1)
        self.norm2 = ChannelLayerNorm32(channels)
        self.conv2 = nn.Conv3d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return h + x


class UpsampleBlock3d(nn.Module):
    """×2 upsampling: conv to ``8·out_channels`` then 3-D pixel shuffle."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv = nn.Conv3d(in_channels, out_channels * 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return pixel_shuffle_3d(self.conv(x), 2)


@register_model("SparseStructureDecoder")
class SparseStructureDecoder(nn.Module):
    """``z [B, latent_channels, R, R, R]`` -> logits ``[B, out_channels, R·2^(len(channels)-1), ...]`` fp32."""

    def __init__(self, out_channels: int, latent_channels: int, num_res_blocks: int, channels: Sequence[int],
                 num_res_blocks_middle: int = 2, norm_type: str = "layer", use_fp16: bool = False):
        super().__init__()
        if norm_type != "layer":
            raise ValueError(f"SparseStructureDecoder: norm_type={norm_type!r} is not implemented; "
                             f"the published decoder uses 'layer'")
        self.dtype = torch.float16 if use_fp16 else torch.float32
        self.input_layer = nn.Conv3d(latent_channels, channels[0], 3, padding=1)
        self.middle_block = nn.Sequential(*(ResBlock3d(channels[0]) for _ in range(num_res_blocks_middle)))
        self.blocks = nn.ModuleList()
        for i, ch in enumerate(channels):
            self.blocks.extend(ResBlock3d(ch) for _ in range(num_res_blocks))
            if i < len(channels) - 1:
                self.blocks.append(UpsampleBlock3d(ch, channels[i + 1]))
        self.out_layer = nn.Sequential(ChannelLayerNorm32(channels[-1]), nn.SiLU(),
                                       nn.Conv3d(channels[-1], out_channels, 3, padding=1))
        for torso in (self.middle_block, self.blocks):  # convs in fp16; the fp32 norms keep fp32 params
            for module in torso.modules():
                if isinstance(module, nn.Conv3d):
                    module.to(self.dtype)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.input_layer(z.type(self.input_layer.weight.dtype)).type(self.dtype)
        h = self.middle_block(h)
        for block in self.blocks:
            h = block(h)
        return self.out_layer(h.type(torch.float32))
