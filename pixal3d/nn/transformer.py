"""Modulated DiT blocks of the flow transformers (TRELLIS.2 ``ModulatedTransformerCrossBlock`` with
Pixal3D's pixel-aligned projection branch), for dense ``[B, L, C]`` and packed sparse ``[N, C]`` tokens.

One block, per token ``x`` (activations in the block dtype, norms in fp32)::

    shift/scale/gate (msa, mlp) = (modulation + mod).to(mod.dtype).chunk(6)     # shared adaLN + offset
    x = x + gate_msa · SelfAttn(LN1(x) · (1 + scale_msa) + shift_msa)           # LN1, LN3 non-affine
    x = x + CrossAttn(LN2(x), global tokens) + proj_linear(projected features)  # LN2 affine, no gate
    x = x + gate_mlp · MLP(LN3(x) · (1 + scale_mlp) + shift_mlp)                # Linear → GELU(tanh) → Linear

Parameter dtypes follow the reference placement: Linear layers in ``dtype`` (bf16 for the released
models), ``modulation``, ``norm2`` and the RMS-norm gammas in fp32.
"""
from __future__ import annotations

import torch
from torch import nn

from .attention import MultiHeadCrossAttention, MultiHeadSelfAttention
from .norms import LayerNorm32


def rows_per_token(values: torch.Tensor, layout: list[slice] | None) -> torch.Tensor:
    """Broadcastable per-sample rows ``[B, C]``: ``[B, 1, C]`` for dense tokens, ``[N, C]`` (or ``[1, C]``
    for one sample) for packed tokens."""
    if layout is None:
        return values.unsqueeze(1)
    if len(layout) == 1:
        return values
    counts = torch.tensor([s.stop - s.start for s in layout], device=values.device)
    return values.repeat_interleave(counts, dim=0)


class FeedForward(nn.Module):
    """Token MLP: Linear(C, int(C·ratio)) → GELU(tanh) → Linear(·, C)."""

    def __init__(self, channels: int, mlp_ratio: float, *, dtype: torch.dtype | None = None):
        super().__init__()
        hidden = int(channels * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(channels, hidden, dtype=dtype), nn.GELU(approximate="tanh"),
                                 nn.Linear(hidden, channels, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


class ProjCrossAttention(nn.Module):
    """Pixal3D ``proj`` conditioning: cross-attention to the global image tokens plus a per-token
    linear map of the pixel-aligned (projected) image features of that token."""

    def __init__(self, channels: int, context_channels: int, proj_channels: int, num_heads: int, *,
                 qk_rms_norm: bool = True, dtype: torch.dtype | None = None):
        super().__init__()
        self.cross_attn_block = MultiHeadCrossAttention(channels, context_channels, num_heads,
                                                        qk_rms_norm=qk_rms_norm, dtype=dtype)
        self.proj_linear = nn.Linear(proj_channels, channels, dtype=dtype)

    def forward(self, x: torch.Tensor, context: torch.Tensor, proj: torch.Tensor,
                layout: list[slice] | None = None) -> torch.Tensor:
        """``x`` and ``proj`` token-aligned (``[B, L, ·]`` or packed ``[N, ·]``); ``context [B, S, Cc]``."""
        return self.cross_attn_block(x, context, layout) + self.proj_linear(proj)


class ModulatedTransformerCrossBlock(nn.Module):
    """One DiT block with shared adaLN modulation (plus a learned per-block offset) and proj conditioning."""

    def __init__(self, channels: int, context_channels: int, proj_channels: int, num_heads: int,
                 mlp_ratio: float, *, qk_rms_norm: bool = True, qk_rms_norm_cross: bool = True,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.norm1 = LayerNorm32(channels, elementwise_affine=False, eps=1e-6)
        self.norm2 = LayerNorm32(channels, elementwise_affine=True, eps=1e-6, dtype=torch.float32)
        self.norm3 = LayerNorm32(channels, elementwise_affine=False, eps=1e-6)
        self.self_attn = MultiHeadSelfAttention(channels, num_heads, qk_rms_norm=qk_rms_norm, dtype=dtype)
        self.cross_attn = ProjCrossAttention(channels, context_channels, proj_channels, num_heads,
                                             qk_rms_norm=qk_rms_norm_cross, dtype=dtype)
        self.mlp = FeedForward(channels, mlp_ratio, dtype=dtype)
        self.modulation = nn.Parameter(torch.randn(6 * channels, dtype=torch.float32) / channels ** 0.5)

    def forward(self, x: torch.Tensor, mod: torch.Tensor, context: torch.Tensor, proj: torch.Tensor,
                phases: torch.Tensor | None = None, layout: list[slice] | None = None) -> torch.Tensor:
        """``x [B, L, C]`` (layout None) or packed ``[N, C]``; ``mod [B, 6C]`` (shared adaLN output);
        ``context [B, S, Cc]``; ``proj`` token-aligned with ``x``; ``phases`` RoPE ``[L or N, D/2]``."""
        mods = (self.modulation + mod).type(mod.dtype)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            rows_per_token(m, layout) for m in mods.chunk(6, dim=-1))
        h = self.norm1(x)
        h = h * (1 + scale_msa) + shift_msa
        h = self.self_attn(h, phases, layout)
        x = x + h * gate_msa
        x = x + self.cross_attn(self.norm2(x), context, proj, layout)
        h = self.norm3(x)
        h = h * (1 + scale_mlp) + shift_mlp
        h = self.mlp(h)
        return x + h * gate_mlp
