"""A flow stage's inputs seen as one token sequence, and its patches (contiguous token ranges).

The token order is the model's own: the dense structure latent ``[B, C, R, R, R]`` flattened with x
slowest (``n = x·R² + y·R + z``, the order ``SparseStructureFlowModel`` uses), a sparse latent's rows
in coordinate order. A patch is a ``slice`` of that order. Everything a patch needs is *sliced* from the
full sequence, never recomputed for the patch: the RoPE phases (from the model's own ``rope_phases`` of
the whole grid / coordinate set), the pixel-aligned ``proj`` features, the ``concat_cond`` rows.

Three tensor forms of one patch, all with the patch's tokens in order:

* *payload* — the latent piece as it travels from the sampler to the first pipeline stage, contiguous:
  dense ``[B, C, l]``, sparse ``[l, C]``;
* *tokens* — the first stage's input, exactly the view the model's ``forward`` would build:
  dense ``payload.transpose(1, 2)`` ``[B, l, C]``, sparse ``cat(payload, concat_cond rows)``;
* *pred* — the last stage's output tokens, fp32 ``[B, l, Cout]`` or ``[l, Cout]``.

With one patch these are bit-for-bit what ``forward`` builds (same strides, same kernels), which is
what makes W = S or M = 1 bitwise equal to the single-process sampler.
"""
from __future__ import annotations

from typing import Any

import torch

from ..models.flow_transformer import FlowTransformer
from ..nn.sparse_tensor import SparseTensor
from ..samplers import Latent, LatentOps
from .settings import ParallelConfigError, near_equal_ranges


def split_tokens(length: int, patches: int) -> tuple[slice, ...]:
    """``patches`` near-equal contiguous ranges covering ``range(length)`` (the first ones one longer)."""
    if not 1 <= patches <= length:
        raise ParallelConfigError(f"cannot split {length} tokens into {patches} patches; use 1 <= M <= {length}")
    return tuple(slice(r.start, r.stop) for r in near_equal_ranges(length, patches))


def run_blocks(blocks: list[torch.nn.Module], h: torch.Tensor, mod: torch.Tensor, context: torch.Tensor,
               proj: torch.Tensor, phases: torch.Tensor, layout: list[slice] | None) -> torch.Tensor:
    """The model trunk's block loop over ``blocks`` (a rank's share, or all of them)."""
    for block in blocks:
        h = block(h, mod, context, proj, phases, layout)
    return h


class FlowSequence:
    """One flow stage's latent, conditions and positions as a token sequence of ``length`` tokens.

    ``model`` is the flow transformer (or a pipeline shard of it: only its config, ``rope_phases`` and
    ``dtype`` are used here). ``neg_cond`` may be None when no step runs the negative branch.
    """

    def __init__(self, model: FlowTransformer, noise: Latent, cond: dict[str, Any], neg_cond: dict[str, Any] | None,
                 concat_cond: SparseTensor | None = None):
        self.sparse = isinstance(noise, SparseTensor)
        self.ops = LatentOps(noise)
        self.dtype = model.dtype
        self.concat = None
        if self.sparse:
            self._init_sparse(model, noise, concat_cond)
        else:
            self._init_dense(model, noise, concat_cond)
        self.context: dict[str, torch.Tensor] = {}
        self.proj: dict[str, torch.Tensor] = {}
        for branch, c in (("pos", cond), ("neg", neg_cond)):
            if c is not None:
                self.context[branch], self.proj[branch] = self._condition(model, c, branch)

    def _init_dense(self, model: FlowTransformer, noise: torch.Tensor, concat_cond: Any) -> None:
        r = model.resolution
        if tuple(noise.shape[1:]) != (model.in_channels, r, r, r):
            raise ValueError(f"noise must be [B, {model.in_channels}, {r}, {r}, {r}]; got {tuple(noise.shape)}")
        if concat_cond is not None:
            raise ValueError("concat_cond is only supported for sparse (SLat) flows")
        self.batch, self.channels, self.length = noise.shape[0], noise.shape[1], r ** 3
        self.out_channels, self.resolution = model.out_channels, r
        self.phases = model.rope_phases(noise.device)  # [R³, D/2], the model's own grid phases

    def _init_sparse(self, model: FlowTransformer, noise: SparseTensor, concat_cond: SparseTensor | None) -> None:
        if noise.batch_size != 1:
            raise ValueError(f"patch-parallel sampling of a sparse latent takes one sample; got batch size "
                             f"{noise.batch_size} (split the batch into requests)")
        self.batch, self.length, self.channels = 1, noise.feats.shape[0], noise.feats.shape[1]
        self.out_channels = model.out_channels
        extra = 0
        if concat_cond is not None:
            if concat_cond.feats.shape[0] != self.length:
                raise ValueError(f"concat_cond has {concat_cond.feats.shape[0]} rows but the noise has {self.length}")
            self.concat, extra = concat_cond.feats, concat_cond.feats.shape[1]
        if self.channels + extra != model.in_channels:
            raise ValueError(f"noise (+ concat_cond) has {self.channels + extra} channels; the model takes "
                             f"{model.in_channels}" + ("" if concat_cond is not None else " (missing concat_cond?)"))
        self.phases = model.rope_phases(noise)  # [N, D/2] from the coordinates, cached on the coordinate set
        if self.out_channels != self.channels:
            raise ValueError(f"the model predicts {self.out_channels} channels for a {self.channels}-channel latent")

    def _condition(self, model: FlowTransformer, cond: dict[str, Any], branch: str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(context [B, S, Cc], proj [B, L, Cp] or [N, Cp])`` in the block dtype (as the trunk casts them)."""
        proj = cond["proj"].feats if isinstance(cond["proj"], SparseTensor) else cond["proj"]
        expected = (self.length, model.proj_channels) if self.sparse else (self.batch, self.length, model.proj_channels)
        if tuple(proj.shape) != expected:
            raise ValueError(f"{branch} cond['proj'] must be {list(expected)} (one row per token, token order); "
                             f"got {list(proj.shape)}")
        return cond["global"].to(self.dtype), proj.to(self.dtype)

    # -- latent pieces (the sampler's side) ------------------------------------------------------
    def latent(self, noise: Latent) -> torch.Tensor:
        """The sampler's state tensor: dense ``[B, C, R, R, R]``, sparse feats ``[N, C]``."""
        return self.ops.features(noise)

    def wrap(self, x: torch.Tensor) -> Latent:
        """The sampler state as the latent kind of the noise."""
        return self.ops.wrap(x)

    def piece(self, x: torch.Tensor, piece: slice) -> torch.Tensor:
        """A view of the latent (or of a same-shaped velocity) on the patch's tokens, latent layout."""
        if self.sparse:
            return x[piece]
        return x.reshape(self.batch, x.shape[1], self.length)[:, :, piece]  # [B, C, l]

    def payload(self, x: torch.Tensor, piece: slice) -> torch.Tensor:
        """The contiguous latent piece that travels to the first stage."""
        return self.piece(x, piece).contiguous()

    def payload_shape(self, piece: slice) -> tuple[int, ...]:
        n = piece.stop - piece.start
        return (n, self.channels) if self.sparse else (self.batch, self.channels, n)

    def tokens(self, payload: torch.Tensor, piece: slice) -> torch.Tensor:
        """First-stage input tokens of a patch, as ``forward`` builds them for the whole sequence."""
        if self.sparse:
            return payload if self.concat is None else torch.cat([payload, self.concat[piece]], dim=-1)
        return payload.transpose(1, 2)  # [B, l, C]

    # -- hidden states and predictions -----------------------------------------------------------
    def hidden_shape(self, piece: slice, channels: int) -> tuple[int, ...]:
        n = piece.stop - piece.start
        return (n, channels) if self.sparse else (self.batch, n, channels)

    def pred_piece(self, pred: torch.Tensor) -> torch.Tensor:
        """A patch's output tokens as a latent-layout view (``[B, Cout, l]`` dense)."""
        return pred if self.sparse else pred.transpose(1, 2)

    def assemble(self, preds: list[torch.Tensor]) -> torch.Tensor:
        """The whole sequence's output tokens, in the layout ``forward`` returns (dense: ``.contiguous()``
        ``[B, Cout, R, R, R]``, the same op chain as ``SparseStructureFlowModel.forward``)."""
        if self.sparse:
            return torch.cat(preds, dim=0)
        h = torch.cat(preds, dim=1)  # [B, L, Cout]
        r = self.resolution
        return h.transpose(1, 2).reshape(self.batch, self.out_channels, r, r, r).contiguous()

    # -- what a block needs for a patch ----------------------------------------------------------
    def timestep(self, t: float, device: torch.device) -> torch.Tensor:
        """``1000·t`` as the sampler passes it: float32 ``[B]``."""
        return torch.tensor([1000 * t] * self.batch, device=device, dtype=torch.float32)

    def block_inputs(self, branch: str, piece: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """``(context, proj rows, RoPE phases rows, layout)`` of one patch of one CFG branch."""
        proj = self.proj[branch]
        proj = proj[piece] if self.sparse else proj[:, piece]
        layout = [slice(0, piece.stop - piece.start)] if self.sparse else None
        return self.context[branch], proj, self.phases[piece], layout
