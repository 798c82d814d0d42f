"""Timestep embedding of the flow transformers: a sinusoid of the (already ×1000) time, then an MLP."""
from __future__ import annotations

import math

import torch
from torch import nn


def timestep_sinusoid(t: torch.Tensor, dim: int, *, max_period: float = 10000.0) -> torch.Tensor:
    """``[B] -> [B, dim]`` fp32: ``cat[cos(t·f), sin(t·f)]`` with ``f_j = max_period^(-j/(dim/2))``."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
    return embedding


class TimestepEmbedder(nn.Module):
    """``t [B]`` → ``[B, channels]``: 256-d sinusoid → Linear → SiLU → Linear (fp32 parameters)."""

    def __init__(self, channels: int, frequency_dim: int = 256):
        super().__init__()
        self.frequency_dim = frequency_dim
        self.mlp = nn.Sequential(nn.Linear(frequency_dim, channels, dtype=torch.float32), nn.SiLU(),
                                 nn.Linear(channels, channels, dtype=torch.float32))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(timestep_sinusoid(t, self.frequency_dim))
