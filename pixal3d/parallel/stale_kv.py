"""PipeFusion's self-attention: a patch's queries attend over a full-sequence K/V buffer in which the
patches already recomputed in this step hold fresh K/V and the others hold the previous step's.

Applied from outside, to an unchanged model: ``patch_attention(blocks)`` switches each block's
``MultiHeadSelfAttention`` to the subclass below for the duration of a request (the class swap FSDP2's
``fully_shard`` uses, so parameter names and the module tree stay as they are) and restores it in
``finally``. Outside a request the subclass behaves exactly like its parent.

What is per patch and what is global (checked against the model, ``pixal3d/nn/transformer.py``):

* self-attention mixes tokens: its K/V are the only cross-patch state. Keys are stored *after* RoPE,
  so a cached key is position-correct whichever step wrote it (xDiT does the same for Flux).
* cross-attention attends to the image tokens, which are not patched: every patch sees all of them,
  fresh, in every step; nothing is cached.
* adaLN modulation depends only on the timestep (one vector per sample), LayerNorms, the MLP and the
  ``proj`` linear are per token: they run on the patch's rows and give the rows' full-sequence values.

Buffers: one (K, V) pair per self-attention layer and CFG branch, ``[B, L, H, D]`` (dense) or
``[L, H, D]`` (packed), allocated on first write and owned by the request's ``PatchAttention``; a new
request starts with none (nothing leaks between images, stages or runs). Tokens never written in
this request (W = 0: the first streamed step) are left out of attention rather than read as zeros:
patch p of the first step attends over patches 0..p only.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..nn.attention import MultiHeadSelfAttention, attend, attention


class PatchAttention:
    """The request's attention state: the current (branch, piece, sync) and the K/V buffers."""

    def __init__(self, length: int, *, keep_kv: bool):
        self.length = length
        self.keep_kv = keep_kv          # False when no step streams patches: sync steps need no buffer
        self.branch = "pos"
        self.piece = slice(0, length)
        self.sync = True
        self._kv: dict[tuple[int, str], list] = {}  # (id(layer), branch) → [K, V, tokens written from 0]

    def point(self, branch: str, piece: slice, sync: bool) -> None:
        """Set what the next block calls compute: ``branch``'s ``piece`` (the whole sequence when ``sync``)."""
        self.branch, self.piece, self.sync = branch, piece, sync

    def buffer_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _, _ in self._kv.values())

    def _store(self, layer: nn.Module, k: torch.Tensor, v: torch.Tensor, piece: slice
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v`` (``[..., l, H, D]``) at ``piece``; return the written prefix of the buffers."""
        key = (id(layer), self.branch)
        entry = self._kv.get(key)
        tok = k.dim() - 3  # token dimension: 1 dense [B, L, H, D], 0 packed [L, H, D]
        if entry is None:
            shape = list(k.shape)
            shape[tok] = self.length
            entry = self._kv[key] = [k.new_empty(shape), v.new_empty(shape), 0]
        kbuf, vbuf, _ = entry
        kbuf.narrow(tok, piece.start, piece.stop - piece.start).copy_(k)
        vbuf.narrow(tok, piece.start, piece.stop - piece.start).copy_(v)
        entry[2] = max(entry[2], piece.stop)  # patches are written in order from 0: the valid prefix
        return kbuf.narrow(tok, 0, entry[2]), vbuf.narrow(tok, 0, entry[2])


class StaleKVSelfAttention(MultiHeadSelfAttention):
    """``MultiHeadSelfAttention`` reading/writing the request's ``PatchAttention`` (see module doc)."""

    patch_state: PatchAttention | None = None

    def forward(self, x: torch.Tensor, phases: torch.Tensor | None = None,
                layout: list[slice] | None = None) -> torch.Tensor:
        state = self.patch_state
        if state is None:
            return super().forward(x, phases, layout)
        q, k, v = self.project_qkv(x, phases)  # [..., l, H, D], k after RoPE
        if state.sync:  # the whole sequence: exactly the parent's attention; keep K/V for streamed steps
            if state.keep_kv:
                state._store(self, k, v, state.piece)
            h = attend(q, k, v, layout, route=self.route)
        else:
            k_all, v_all = state._store(self, k, v, state.piece)
            if layout is None:
                h = attention(q, k_all, v_all, route=self.route)  # [B, l, H, D] over [B, L', H, D]
            else:  # one packed sample (FlowSequence allows no more)
                h = attention(q.unsqueeze(0), k_all.unsqueeze(0), v_all.unsqueeze(0), route=self.route)[0]
        return self.to_out(h.flatten(-2))


@contextlib.contextmanager
def patch_attention(blocks: list[nn.Module], state: PatchAttention) -> Iterator[PatchAttention]:
    """Route the self-attention of ``blocks`` through ``state`` until the block exits."""
    layers = [block.self_attn for block in blocks]
    for layer in layers:
        if type(layer) is not MultiHeadSelfAttention:
            raise TypeError(f"expected MultiHeadSelfAttention, got {type(layer).__name__} (already patched?)")
    try:
        for layer in layers:
            layer.__class__ = StaleKVSelfAttention
            layer.patch_state = state
        yield state
    finally:
        for layer in layers:
            layer.__class__ = MultiHeadSelfAttention
            layer.__dict__.pop("patch_state", None)
