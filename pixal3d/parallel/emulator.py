"""PipeFusion on one process: the patch schedule of ``schedule.plan_steps`` run over all blocks.

This is the method written out in one loop, and the oracle for the distributed runtime: for a given
(M, W, patch order) a run on any number of pipeline ranks, with or without CFG-parallel, must give
these bits (tests/pixal3d/parallel/test_parallel_ranks.py). It is also how the approximation table
(benchmarks/parallel_error.md) is made: its error depends on M and W only, not on the number of ranks.
"""
from __future__ import annotations

from typing import Any

import torch

from ..config import SamplerConfig
from ..models.flow_transformer import FlowTransformer
from ..nn.sparse_tensor import SparseTensor
from ..samplers import Latent
from .schedule import plan_steps
from .sequence import FlowSequence, run_blocks
from .stale_kv import PatchAttention, patch_attention
from .stepper import update_piece, update_whole


@torch.no_grad()
def emulate_pipefusion(model: FlowTransformer, noise: Latent, *, cond: dict[str, Any], neg_cond: dict[str, Any] | None,
                       sampler: SamplerConfig, patches: int, warmup: int, concat_cond: SparseTensor | None = None,
                       state: PatchAttention | None = None) -> Latent:
    """Sample ``noise`` → latent with M = ``patches`` patches after W = ``warmup`` synchronous steps.

    ``state`` is for tests only: pass one to share K/V buffers across calls (which a real request
    never does) and show that the per-request reset matters.
    """
    seq = FlowSequence(model, noise, cond, neg_cond, concat_cond)
    plan = plan_steps(sampler, seq.length, patches, warmup)
    if state is None:
        state = PatchAttention(seq.length, keep_kv=not all(s.sync for s in plan))
    blocks = list(model.blocks)
    x = seq.latent(noise)
    with patch_attention(blocks, state):
        for step in plan:
            mod = model.modulation(seq.timestep(step.t, x.device))  # [B, 6C], the same for every patch
            preds: dict[str, list[torch.Tensor]] = {b: [] for b in step.branches}
            x_next = torch.empty_like(x)
            for piece in step.pieces:
                tokens = seq.tokens(seq.payload(x, piece), piece)
                for branch in step.branches:
                    state.point(branch, piece, step.sync)
                    h = run_blocks(blocks, model.embed(tokens), mod, *seq.block_inputs(branch, piece))
                    preds[branch].append(model.head(h))
                if not step.whole_latent:
                    update_piece(seq, sampler, step, piece, x, x_next, {b: p[-1] for b, p in preds.items()})
            x = update_whole(seq, sampler, step, x, preds) if step.whole_latent else x_next
    return seq.wrap(x)
