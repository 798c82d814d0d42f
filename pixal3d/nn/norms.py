"""Normalisation layers that compute in fp32 whatever the activation dtype (reference precision placement).

``LayerNorm32`` / ``ChannelLayerNorm32`` mirror TRELLIS.2's fp32 norms: the input is upcast, normalised
with fp32 affine parameters and cast back. ``MultiHeadRMSNorm`` is the per-head q/k RMS norm of the
flow transformers: ``normalize(x) * gamma[H, D] * sqrt(D)`` in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm32(nn.LayerNorm):
    """LayerNorm over the last dimension, computed in fp32 and cast back to the input dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


class ChannelLayerNorm32(LayerNorm32):
    """LayerNorm over the channel dimension (dim 1) of a dense ``[B, C, *spatial]`` tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = x.dim()
        x = x.permute(0, *range(2, dims), 1)  # [B, *spatial, C]
        x = super().forward(x)
        return x.permute(0, dims - 1, *range(1, dims - 1)).contiguous()  # [B, C, *spatial]


class MultiHeadRMSNorm(nn.Module):
    """Per-head RMS norm of ``[..., H, D]`` tensors: ``normalize(x) * gamma[H, D] * sqrt(D)`` in fp32."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(heads, dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.normalize(x.float(), dim=-1) * self.gamma * self.scale).to(x.dtype)
