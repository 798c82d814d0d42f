"""Multi-head attention of the flow transformers, over dense batches and packed variable-length samples.

Shapes: a *dense* batch is ``[B, L, C]`` (every sample has L tokens); a *packed* batch is ``[N, C]``
with ``layout`` = one row slice per sample (a ``SparseTensor``'s features). Heads are handled as
``[B, H, L, D]`` views of ``[B, L, H, D]`` projections (last dimension contiguous, which the fused CUDA
kernels take without a copy).

Two routes compute the same softmax attention (``route``; ``ROUTES``):

- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` in the input dtype, per query chunk
  (``query_chunk``). The fused CUDA and CPU kernels; the golden fingerprints are made with it.
- ``fp32_chunked``: per query chunk, the scores from fp32 q and k, the softmax in fp32, times fp32 v, cast
  back to the input dtype (``fp32_chunked_attention``). Exact to fp32 rounding at any key length, and no
  tensor it makes exceeds ``MPS_ARRAY_BYTES``. Why on Apple Silicon: PyTorch's MPS attention
  (``sdpa_general_mps``) hands all of Q·Kᵀ to MPSGraph's softmax, which does not accumulate half
  precision in fp32 (2.4 % max error at 14k bf16 keys, pytorch/pytorch#190791), and MPSGraph refuses
  arrays over 2**32 bytes (pytorch/pytorch#149261); what torch 2.13 dispatches to on MPS, and why, is in
  benchmarks/mps_audit.md.
- ``auto`` (the default): ``fp32_chunked`` on ``mps`` (and on the MPS audit's stand-in device, which stands
  for it), ``sdpa`` everywhere else.

Query chunking bounds the memory of kernels that materialise the ``[H, Lq, Lk]`` score matrix: one chunk
holds at most ``score_budget()`` score elements; on CUDA the fused kernels keep memory linear, so the
``sdpa`` route splits nothing there.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..audit.limits import MPSGRAPH_ARRAY_BYTES
from ..audit.standin import STANDIN
from ..devices import kind
from .limits import current_limits
from .norms import MultiHeadRMSNorm
from .rope import apply_rope

QueryChunk = int | None | Literal["auto"]
ROUTES: tuple[str, ...] = ("auto", "sdpa", "fp32_chunked")

MPS_ARRAY_BYTES = MPSGRAPH_ARRAY_BYTES  # MPSGraph: "total bytes of NDArray > 2**32" (pytorch/pytorch#149261)


def device_array_bytes(device: torch.device | str) -> int | None:
    """The largest single tensor ``device`` takes: ``MPS_ARRAY_BYTES`` on mps, None (no such limit) elsewhere
    (``pixal3d.devices``)."""
    return kind(device).array_bytes


def score_budget() -> int:
    """Score elements one query chunk may hold: the running stage's limit (``pixal3d.nn.limits``, per thread;
    a memory budget may lower it)."""
    return current_limits().attention_scores


def check_route(route: str) -> str:
    """``route`` if it is one of ``ROUTES``, else a ``ValueError`` naming the choices."""
    if route not in ROUTES:
        raise ValueError(f"attention route {route!r} is not one of {', '.join(ROUTES)}")
    return route


def resolve_route(route: str, device: torch.device) -> str:
    """The route that runs on ``device``: ``auto`` is ``fp32_chunked`` on mps (or the audit's stand-in for
    it), ``sdpa`` elsewhere; an explicit route is kept."""
    if check_route(route) != "auto":
        return route
    return "fp32_chunked" if kind(device).fp32_attention or device == STANDIN else "sdpa"


def describe_route(route: str, device: torch.device) -> str:
    """One line for the plan's reasons: which attention route runs on ``device``, and why."""
    resolved = resolve_route(route, device)
    why = f"auto on {device.type}" if route == "auto" else "runtime.attention"
    if resolved == "sdpa":
        return f"attention: fused SDPA in the model dtype ({why})"
    return (f"attention: fp32_chunked ({why}): scores, softmax and the value product in fp32 over query chunks of "
            f"at most {score_budget():,} scores, no tensor over 2**32 bytes (MPS's half-precision softmax "
            f"loses accuracy over long key sequences)")


def auto_query_chunk(q: torch.Tensor, k: torch.Tensor) -> int | None:
    """SDPA query chunk length for ``q [B, H, Lq, D]`` against ``k [B, H, Lk, D]``; None = no chunking."""
    if kind(q.device).fused_attention:
        return None
    batch, heads, lq, _ = q.shape
    chunk = max(1, score_budget() // max(1, batch * heads * k.shape[-2]))
    return None if chunk >= lq else chunk


def fp32_chunk_length(batch: int, heads: int, lq: int, lk: int, budget: int | None = None) -> int:
    """Queries per fp32 chunk: at most ``budget`` score elements (default ``score_budget()``), and fp32
    scores under ``MPS_ARRAY_BYTES``; at least one query."""
    per_query = max(1, batch * heads * lk)
    budget = score_budget() if budget is None else budget
    under_limit = (MPS_ARRAY_BYTES - 1) // (4 * per_query)
    return max(1, min(lq, budget // per_query, under_limit))


def fp32_chunked_scratch_bytes(batch: int, heads: int, lq: int, lk: int, head_dim: int, *,
                               value_dim: int | None = None, budget: int | None = None,
                               out_element_size: int = 2) -> int:
    """Peak bytes ``fp32_chunked_attention`` (and the cast back) allocates beyond its inputs: fp32 copies
    of k and v, the fp32 output, and per chunk the fp32 queries, scores, probabilities and product."""
    value_dim = head_dim if value_dim is None else value_dim
    chunk = fp32_chunk_length(batch, heads, lq, lk, budget)
    rows = batch * heads
    held = 4 * rows * (lk * head_dim + lk * value_dim + lq * value_dim)
    per_chunk = 4 * rows * chunk * (head_dim + 2 * lk + value_dim)
    return held + max(per_chunk, out_element_size * rows * lq * value_dim)


def fp32_chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                           chunk: int | None = None) -> torch.Tensor:
    """Softmax attention of ``q [B, H, Lq, D]`` over ``k, v [B, H, Lk, D]`` in fp32 → fp32 ``[B, H, Lq, Dv]``.

    Per chunk of ``chunk`` queries (default ``fp32_chunk_length``): scores ``(q / sqrt(D)) · kᵀ`` in fp32,
    softmax over all keys in fp32, times v in fp32. Rows of a softmax are independent, so chunking the
    queries changes nothing but the memory.
    """
    batch, heads, lq, head_dim = q.shape
    lk = k.shape[-2]
    chunk = fp32_chunk_length(batch, heads, lq, lk) if chunk is None else max(1, chunk)
    keys_t = k.float().transpose(-1, -2)  # [B, H, D, Lk]
    values = v.float()  # [B, H, Lk, Dv]
    out = torch.empty(batch, heads, lq, values.shape[-1], dtype=torch.float32, device=q.device)
    scale = 1.0 / math.sqrt(head_dim)
    for start in range(0, lq, chunk):
        stop = min(lq, start + chunk)
        scores = torch.matmul(q[:, :, start:stop].float() * scale, keys_t)  # [B, H, c, Lk] fp32
        probs = torch.softmax(scores, dim=-1)
        del scores
        out[:, :, start:stop] = torch.matmul(probs, values)  # [B, H, c, Dv]
        del probs
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_chunk: QueryChunk) -> torch.Tensor:
    """The ``sdpa`` route on ``[B, H, L, D]`` heads (see the module doc)."""
    chunk = auto_query_chunk(q, k) if query_chunk == "auto" else query_chunk
    if chunk is None or chunk >= q.shape[2]:
        return F.scaled_dot_product_attention(q, k, v)
    return torch.cat([F.scaled_dot_product_attention(qc, k, v) for qc in q.split(chunk, dim=2)], dim=2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, query_chunk: QueryChunk = "auto",
              route: str = "auto") -> torch.Tensor:
    """Softmax attention of ``q [B, Lq, H, D]`` over ``k, v [B, Lk, H, D]`` → ``[B, Lq, H, D]`` in q's dtype.

    ``route``: ``auto``, ``sdpa`` or ``fp32_chunked`` (module doc). ``query_chunk`` (``sdpa`` route):
    ``"auto"`` (at most ``score_budget()`` scores per call), an int (queries per SDPA call) or None (one call);
    the ``fp32_chunked`` route sizes its own chunks.
    """
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, L, D]
    if resolve_route(route, q.device) == "fp32_chunked":
        out = fp32_chunked_attention(q, k, v).to(q.dtype)
    else:
        out = _sdpa(q, k, v, query_chunk)
    return out.transpose(1, 2)  # [B, Lq, H, D]


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: list[slice], *,
                     query_chunk: QueryChunk = "auto", route: str = "auto") -> torch.Tensor:
    """Per-sample attention of packed ``q [N, H, D]`` (one attention call per sample, not per token) over
    packed ``k, v [N, H, D]`` of the same rows (self-attention) or dense ``[B, S, H, D]`` (cross-attention)."""
    outs = []
    for i, rows in enumerate(layout):
        if k.dim() == 4:
            ki, vi = k[i:i + 1], v[i:i + 1]
        else:
            ki, vi = k[rows].unsqueeze(0), v[rows].unsqueeze(0)
        outs.append(attention(q[rows].unsqueeze(0), ki, vi, query_chunk=query_chunk, route=route)[0])
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: list[slice] | None, *,
           route: str = "auto") -> torch.Tensor:
    """Dense (``layout`` None, q ``[B, L, H, D]``) or packed (q ``[N, H, D]``) attention."""
    return attention(q, k, v, route=route) if layout is None else packed_attention(q, k, v, layout, route=route)


def set_attention_route(module: nn.Module, route: str) -> nn.Module:
    """Make every attention layer of ``module`` run ``route`` (``ROUTES``); returns ``module``."""
    check_route(route)
    for layer in module.modules():
        if isinstance(layer, (MultiHeadSelfAttention, MultiHeadCrossAttention)):
            layer.route = route
    return module


class MultiHeadSelfAttention(nn.Module):
    """Self-attention with a fused ``to_qkv``, optional per-head q/k RMS norm and optional RoPE phases."""

    route: str = "auto"  # the attention route (module doc); set_attention_route changes it

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
        h = attend(q, k, v, layout, route=self.route)
        return self.to_out(h.flatten(-2))


class MultiHeadCrossAttention(nn.Module):
    """Cross-attention from tokens to a dense context ``[B, S, Cc]`` (``to_q``, fused ``to_kv``)."""

    route: str = "auto"  # the attention route (module doc); set_attention_route changes it

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
        h = attend(q, k, v, layout, route=self.route)
        return self.to_out(h.flatten(-2))
