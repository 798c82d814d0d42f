"""One flow stage sampled by every rank of the job: CFG-parallel, PipeFusion, or both.

Every rank calls ``parallel_sample`` with its shard; only rank 0's inputs matter (they are broadcast).
Each rank then walks the same ``plan_steps`` schedule in the same order (step → piece → branch) and
does its part of every item:

* the first stage of a group embeds the piece's tokens (the noise at step 0, later the piece the owner
  sent back) and the other stages receive the previous stage's hidden state;
* every stage runs its blocks on the piece for that branch (stale-K/V self-attention in streamed steps)
  and sends the result on; the last stage turns it into the velocity piece;
* the owner (last stage of group 0) collects each piece's branch predictions (the negative branch's
  from group 1 under CFG-parallel), updates that piece (or, for CFG rescale, the whole latent after
  the last piece) and sends the updated pieces to the first stage of every group that runs the next
  step.

Because each rank processes items in one global order and every message goes forward in that order,
no rank ever waits on a rank that waits on it (no deadlock), and the bits equal the emulator's.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..config import SamplerConfig
from ..models.flow_transformer import FlowTransformer
from ..nn.sparse_tensor import SparseTensor
from ..samplers import Latent, sample_flow_euler
from .comm import Inbox, Outbox, Wire, broadcast_object, broadcast_tensor, pack, tensor_specs, unpack
from .runtime import ParallelRuntime
from .schedule import StepPlan, plan_steps
from .sequence import FlowSequence, run_blocks
from .settings import ParallelConfigError
from .shard import owned_blocks, shard_info
from .stale_kv import PatchAttention, patch_attention
from .stepper import update_piece, update_whole

StepCallback = Callable[[dict[str, Any]], None]


@torch.no_grad()
def parallel_sample(model: FlowTransformer, noise: Latent | None, *, cond: dict[str, Any] | None,
                    neg_cond: dict[str, Any] | None, sampler: SamplerConfig, runtime: ParallelRuntime | None,
                    concat_cond: SparseTensor | None = None, callback: StepCallback | None = None) -> Latent:
    """Sample one flow stage on every rank of the job; every rank returns the final latent.

    ``model``: this rank's shard (``load_flow_shard``), the whole model when pp = 1. ``noise``,
    ``cond``, ``neg_cond``, ``concat_cond``: read on rank 0 only (other ranks may pass None).
    ``runtime``: from ``init_parallel``; None (mode "none") runs today's single-process sampler.
    ``callback``: after each step this rank has done its part of, ``{"step", "t", "t_prev"}`` (step from
    0; with runtime None the single-process sampler's dict, which has the latents too).
    """
    if runtime is None:
        flow = model if concat_cond is None else functools.partial(model, concat_cond=concat_cond)
        return sample_flow_euler(flow, noise, cond=cond, neg_cond=neg_cond, progress=False, steps=sampler.steps,
                                 guidance_strength=sampler.guidance_strength,
                                 guidance_rescale=sampler.guidance_rescale,
                                 guidance_interval=tuple(sampler.guidance_interval), rescale_t=sampler.rescale_t,
                                 sigma_min=sampler.sigma_min, callback=callback)
    return runtime.request(functools.partial(_sample, model, noise, cond, neg_cond, concat_cond, sampler, runtime,
                                             callback=callback))


def _sample(model: FlowTransformer, noise: Any, cond: Any, neg_cond: Any, concat_cond: Any, sampler: SamplerConfig,
            runtime: ParallelRuntime, wire: Wire, *, callback: StepCallback | None) -> Latent:
    topo, settings = runtime.topology, runtime.settings
    # 1. Rank 0's inputs on every rank; the same settings everywhere.
    noise, cond, neg_cond, concat_cond = _share_inputs(model, (noise, cond, neg_cond, concat_cond), sampler,
                                                       runtime, wire)
    # 2. The schedule, identical on every rank.
    seq = FlowSequence(model, noise, cond, neg_cond, concat_cond)
    settings.check_stage(steps=sampler.steps, num_blocks=len(model.blocks), tokens=seq.length)
    info = shard_info(model)
    if (info.stage, info.stages) != (topo.stage, topo.pp_degree):
        raise ParallelConfigError(f"rank {topo.rank} is pipeline stage {topo.stage} of {topo.pp_degree} but its "
                                  f"model is shard {info.stage} of {info.stages}; load it with load_flow_shard")
    plan = plan_steps(sampler, seq.length, settings.patches, settings.warmup)
    if any("neg" in s.branches for s in plan) and neg_cond is None:
        raise ValueError(f"guidance_strength {sampler.guidance_strength} needs neg_cond on rank 0")
    # 3. The links of this rank, with every message it will receive.
    inboxes, outboxes = _links(model, seq, plan, runtime, wire)
    # 4. The steps.
    state = PatchAttention(seq.length, keep_kv=not all(s.sync for s in plan))
    x = seq.latent(noise)
    with patch_attention(owned_blocks(model), state):
        for step, next_step in zip(plan, [*plan[1:], None], strict=True):
            x = _step(model, seq, sampler, step, next_step, x, state, runtime, inboxes, outboxes)
            if callback is not None:
                callback({"step": step.index, "t": step.t, "t_prev": step.t_prev})
    for box in outboxes.values():
        box.drain()
    for box in inboxes.values():
        box.finish()
    runtime.last_stats = {"bytes_sent": {name: box.bytes_sent for name, box in outboxes.items()},
                          "messages_sent": {name: box.messages for name, box in outboxes.items()},
                          "waited_s": {**{f"recv {name}": box.waited_s for name, box in inboxes.items()},
                                       **{f"send {name}": box.waited_s for name, box in outboxes.items()}},
                          "kv_buffer_bytes": state.buffer_bytes(), "tokens": seq.length, "steps": len(plan)}
    # 5. The owner's latent on every rank.
    x = broadcast_tensor(x if topo.is_owner else None, tuple(x.shape), x.dtype, topo.owner, wire, runtime.device,
                         "the final latent")
    return seq.wrap(x)


def _step(model: FlowTransformer, seq: FlowSequence, sampler: SamplerConfig, step: StepPlan,
          next_step: StepPlan | None, x: torch.Tensor, state: PatchAttention, runtime: ParallelRuntime,
          inboxes: dict[str, Inbox], outboxes: dict[str, Outbox]) -> torch.Tensor:
    """This rank's part of one sampler step; returns the latent for the next step (owner: updated)."""
    topo = runtime.topology
    mine = [b for b in step.branches if topo.group_of(b) == topo.cfg_index]
    if not mine and not topo.is_owner:
        return x  # this group sits the step out (guidance interval: no negative pass)
    blocks = owned_blocks(model)
    mod = model.modulation(seq.timestep(step.t, x.device)) if mine else None  # [B, 6C]
    preds: dict[str, list[torch.Tensor]] = {b: [] for b in step.branches}
    x_next = torch.empty_like(x) if topo.is_owner else x
    sent = 0  # next step's pieces already sent
    for piece in step.pieces:
        tokens = None
        for branch in step.branches:
            if branch in mine:
                if topo.is_first:
                    if tokens is None:
                        own = step.index == 0 or topo.is_owner
                        tokens = seq.tokens(seq.payload(x, piece) if own else inboxes["x"].take(), piece)
                    h = model.embed(tokens)
                else:
                    h = inboxes["act"].take()
                state.point(branch, piece, step.sync)
                h = run_blocks(blocks, h, mod, *seq.block_inputs(branch, piece))
                if not topo.is_last:
                    outboxes["act"].send(h)
                elif topo.is_owner:
                    preds[branch].append(model.head(h))
                else:
                    outboxes["pred"].send(model.head(h))
            elif topo.is_owner:
                preds[branch].append(inboxes[f"pred{topo.group_of(branch)}"].take())
        if topo.is_owner and not step.whole_latent:
            update_piece(seq, sampler, step, piece, x, x_next, {b: p[-1] for b, p in preds.items()})
            sent = _send_ready(seq, next_step, x_next, piece.stop, sent, runtime, outboxes)
    if not topo.is_owner:
        return x
    if step.whole_latent:
        x_next = update_whole(seq, sampler, step, x, preds)
        _send_ready(seq, next_step, x_next, seq.length, sent, runtime, outboxes)
    return x_next


def _send_ready(seq: FlowSequence, next_step: StepPlan | None, x_next: torch.Tensor, ready: int, sent: int,
                runtime: ParallelRuntime, outboxes: dict[str, Outbox]) -> int:
    """Owner: send the next step's pieces that ``x_next[:ready]`` completes to every group that runs it."""
    if next_step is None:
        return sent
    topo = runtime.topology
    groups = {topo.group_of(b) for b in next_step.branches}
    while sent < len(next_step.pieces) and next_step.pieces[sent].stop <= ready:
        payload = seq.payload(x_next, next_step.pieces[sent])
        for c in sorted(groups):
            if f"x{c}" in outboxes:
                outboxes[f"x{c}"].send(payload)
        sent += 1
    return sent


def _links(model: FlowTransformer, seq: FlowSequence, plan: list[StepPlan], runtime: ParallelRuntime,
           wire: Wire) -> tuple[dict[str, Inbox], dict[str, Outbox]]:
    """This rank's inboxes (``act``, ``x``, ``pred<c>``) with their expected messages, and outboxes."""
    topo, c, device = runtime.topology, runtime.topology.cfg_index, runtime.device
    hidden, latent = model.dtype, seq.ops.template.dtype

    def items(group: int):
        return [(s, p, b) for s in plan for p in s.pieces for b in s.branches if topo.group_of(b) == group]

    inboxes: dict[str, Inbox] = {}
    outboxes: dict[str, Outbox] = {}
    if not topo.is_first:
        src = topo.rank_of(c, topo.stage - 1)
        expected = [(seq.hidden_shape(p, model.model_channels), hidden) for _, p, _ in items(c)]
        inboxes["act"] = Inbox(wire, src, runtime.group("act", src, topo.rank), "hidden state", expected, device)
    if topo.is_first and not topo.is_owner:
        expected = [(seq.payload_shape(p), latent) for s in plan[1:]
                    if any(topo.group_of(b) == c for b in s.branches) for p in s.pieces]
        inboxes["x"] = Inbox(wire, topo.owner, runtime.group("x", topo.owner, topo.rank), "latent piece", expected,
                             device)
    if topo.is_owner:
        for g in range(1, topo.cfg_degree):
            src = topo.rank_of(g, topo.pp_degree - 1)
            expected = [(seq.hidden_shape(p, seq.out_channels), torch.float32) for _, p, _ in items(g)]
            inboxes[f"pred{g}"] = Inbox(wire, src, runtime.group("pred", src, topo.rank), "velocity piece",
                                        expected, device)
        for g in range(topo.cfg_degree):
            dst = topo.rank_of(g, 0)
            if dst != topo.rank:
                outboxes[f"x{g}"] = Outbox(wire, dst, runtime.group("x", topo.rank, dst), "latent piece")
    if not topo.is_last:
        dst = topo.rank_of(c, topo.stage + 1)
        outboxes["act"] = Outbox(wire, dst, runtime.group("act", topo.rank, dst), "hidden state")
    elif not topo.is_owner:
        outboxes["pred"] = Outbox(wire, topo.owner, runtime.group("pred", topo.rank, topo.owner), "velocity piece")
    return inboxes, outboxes


def _share_inputs(model: FlowTransformer, inputs: tuple, sampler: SamplerConfig, runtime: ParallelRuntime,
                  wire: Wire) -> tuple:
    """Rank 0's ``(noise, cond, neg_cond, concat_cond)`` on every rank (on its compute device), after
    checking that every rank runs the same settings, sampler and model."""
    topo = runtime.topology
    signature = repr((runtime.settings.mode, runtime.settings.pp, runtime.settings.patches, runtime.settings.warmup,
                      tuple(sorted(vars(sampler).items())), type(model).__name__, len(model.blocks),
                      model.model_channels, shard_info(model).split))
    tensors: list[torch.Tensor] = []
    header = (pack(inputs, tensors) if topo.rank == 0 else None, signature)
    skeleton, reference = broadcast_object(header, 0, wire, "the input description")
    if reference != signature:
        raise ParallelConfigError(f"rank {topo.rank} runs {signature} but rank 0 runs {reference}; every rank needs "
                                  f"the same config, parallel settings and model")
    specs = tensor_specs(skeleton, {})
    received = [broadcast_tensor(tensors[i] if topo.rank == 0 else None, *specs[i], 0, wire, runtime.device,
                                 f"input tensor {i}").to(runtime.device) for i in range(len(specs))]
    return unpack(skeleton, received)
