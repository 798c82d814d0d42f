"""Multi-head attention of the flow transformers, over dense batches and packed variable-length samples.

Shapes: a *dense* batch is ``[B, L, C]`` (every sample has L tokens); a *packed* batch is ``[N, C]``
with ``layout`` = one row slice per sample (a ``SparseTensor``'s features). All attention goes through
``torch.nn.functional.scaled_dot_product_attention``; heads are handled as ``[B, H, L, D]`` views of
``[B, L, H, D]`` projections (last dimension contiguous, which the fused CUDA kernels take without a copy).

Query chunking bounds the memory of attention kernels that materialise the ``[H, Lq, Lk]`` score matrix
(the math path on CPU/MPS): with ``query_chunk="auto"`` queries are split so that one chunk's scores
hold at most ``SCORE_BUDGET`` elements; on CUDA the fused kernels keep memory linear, so nothing is split.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .norms import MultiHeadRMSNorm
from .rope import apply_rope

QueryChunk = int | None | Literal["auto"]

SCORE_BUDGET = 1 << 26  # score elements per chunk (256 MiB in fp32) on devices without fused kernels


def auto_query_chunk(q: torch.Tensor, k: torch.Tensor) -> int | None:
    """Query chunk length for ``q [B, H, Lq, D]`` against ``k [B, H, Lk, D]``; None = no chunking."""
    if q.device.type == "cuda":
        return None
    batch, heads, lq, _ = q.shape
    chunk = max(1, SCORE_BUDGET // max(1, batch * heads * k.shape[-2]))
    return None if chunk >= lq else chunk


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, query_chunk: QueryChunk = "auto") -> torch.Tensor:
    """Softmax attention of ``q [B, Lq, H, D]`` over ``k, v [B, Lk, H, D]`` → ``[B, Lq, H, D]``.

    ``query_chunk``: ``"auto"`` (see module doc), an int (queries per SDPA call) or None (one call).
    """
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, L, D]
    chunk = auto_query_chunk(q, k) if query_chunk == "auto" else query_chunk
    if chunk is None or chunk >= q.shape[2]:
        out = F.scaled_dot_product_attention(q, k, v)
    else:
        out = torch.cat([F.scaled_dot_product_attention(qc, k, v) for qc in q.split(chunk, dim=2)], dim=2)
    return out.transpose(1, 2)  # [B, Lq, H, D]


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: list[slice], *,
                     query_chunk: QueryChunk = "auto") -> torch.Tensor:
    """Per-sample attention of packed ``q [N, H, D]`` (one SDPA call per sample, not per token) over
    packed ``k, v [N, H, D]`` of the same rows (self-attention) or dense ``[B, S, H, D]`` (cross-attention)."""
    outs = []
    for i, rows in enumerate(layout):
        if k.dim() == 4:
            ki, vi = k[i:i + 1], v[i:i + 1]
        else:
            ki, vi = k[rows].unsqueeze(0), v[rows].unsqueeze(0)
        outs.append(attention(q[rows].unsqueeze(0), ki, vi, query_chunk=query_chunk)[0])
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: list[slice] | None) -> torch.Tensor:
    """Dense (``layout`` None, q ``[B, L, H, D]``) or packed (q ``[N, H, D]``) attention."""
    return attention(q, k, v) if layout is None else packed_attention(q, k, v, layout)


class MultiHeadSelfAttention(nn.Module):
    """Self-attention with a fused ``to_qkv``, optional per-head q/k RMS norm and optional RoPE phases."""

    def __init__(self, channels: int, num_heads: int, *, qk_rms_norm: bool = True, dtype: torch.dtype | None = None):
        super().__init__()
        if channels % num_heads:
            raise ValueError(f"channels {channels} must be divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = channels // num_heads
        self.to_qkv = nn.Linear(channels, 3 * channels, dtype=dtype)
        if qk_rms_norm:
            self.q_rms_norm = MultiHeadRMSNorm(self.head_dim, num_heads)
            self.k_rms_norm = MultiHeadRMSNorm(self.head_dim, num_heads)
        self.qk_rms_norm = qk_rms_norm
        self.to_out = nn.Linear(channels, channels, dtype=dtype)

    def project_qkv(self, x: torch.Tensor, phases: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q, k, v [..., L, H, D]`` of tokens ``x``: q/k RMS-normed (if enabled) and rotated (if ``phases``)."""
        qkv = self.to_qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim))  # [..., L, 3, H, D]
        q, k, v = qkv.unbind(dim=-3)
        if self.qk_rms_norm:
            q, k = self.q_rms_norm(q), self.k_rms_norm(k)
        if phases is not None:
            q, k = apply_rope(q, phases), apply_rope(k, phases)
        return q, k, v

    def forward(self, x: torch.Tensor, phases: torch.Tensor | None = None,
                layout: list[slice] | None = None) -> torch.Tensor:
        """``x [B, L, C]`` (layout None) or packed ``[N, C]``; ``phases [L or N, D/2]`` complex."""
        q, k, v = self.project_qkv(x, phases)
        h = attend(q, k, v, layout)
        return self.to_out(h.flatten(-2))


class MultiHeadCrossAttention(nn.Module):
    """Cross-attention from tokens to a dense context ``[B, S, Cc]`` (``to_q``, fused ``to_kv``)."""

    def __init__(self, channels: int, context_channels: int, num_heads: int, *, qk_rms_norm: bool = True,
                 dtype: torch.dtype | None = None):
        super().__init__()
        if channels % num_heads:
            raise ValueError(f"channels {channels} must be divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = channels // num_heads
        self.to_q = nn.Linear(channels, channels, dtype=dtype)
        self.to_kv = nn.Linear(context_channels, 2 * channels, dtype=dtype)
        if qk_rms_norm:
            self.q_rms_norm = MultiHeadRMSNorm(self.head_dim, num_heads)
            self.k_rms_norm = MultiHeadRMSNorm(self.head_dim, num_heads)
        self.qk_rms_norm = qk_rms_norm
        self.to_out = nn.Linear(channels, channels, dtype=dtype)

    def forward(self, x: torch.Tensor, context: torch.Tensor, layout: list[slice] | None = None) -> torch.Tensor:
        """``x [B, L, C]`` (layout None) or packed ``[N, C]``; ``context [B, S, Cc]``."""
        q = self.to_q(x).unflatten(-1, (self.num_heads, self.head_dim))  # [..., L, H, D]
        k, v = self.to_kv(context).unflatten(-1, (2, self.num_heads, self.head_dim)).unbind(dim=-3)  # [B, S, H, D]
        if self.qk_rms_norm:
            q, k = self.q_rms_norm(q), self.k_rms_norm(k)
        h = attend(q, k, v, layout)
        return self.to_out(h.flatten(-2))
