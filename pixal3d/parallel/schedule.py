"""The patch schedule of one flow stage: for every sampler step, which CFG branches run, over which
token pieces, synchronously or streamed, and when the sampler may update a piece.

The same plan drives the single-process emulator and every rank of the distributed run, which is what
makes their results identical (PipeFusion's fresh/stale pattern depends only on the patch order, M and
W, never on the number of ranks).

* Steps ``i < W`` are *synchronous*: one piece, the whole sequence (exact). With ``M == 1`` every step
  is synchronous: one patch that covers everything always sees fresh K/V, so there is no stale
  buffer to keep.
* Later steps stream the M patches in order ``0..M-1``.
* Steps outside the guidance interval run the positive branch only. A branch that sits steps out
  keeps its K/V buffers; if it comes back (an interval that starts below t = 1) its first streamed
  step reads K/V as old as its last step. The shipped configs start the interval at t = 1, so the
  negative branch only ever stops.
* A step whose guided velocity needs a statistic of the whole latent (CFG rescale: the per-sample std
  of x0) updates after its last piece (``whole_latent``); every other step updates each piece as soon
  as its branches are in (Euler and the CFG mix are element-wise).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import SamplerConfig
from ..samplers import guidance_branches, needs_whole_latent, step_strength, time_pairs
from .sequence import split_tokens


@dataclass(frozen=True)
class StepPlan:
    """One sampler step of the schedule."""

    index: int
    t: float
    t_prev: float
    strength: float
    branches: tuple[str, ...]   # model passes in call order: ("pos",), ("neg",) or ("pos", "neg")
    sync: bool                  # one piece = the whole sequence, attention over fresh K/V only
    pieces: tuple[slice, ...]   # token ranges in processing order
    whole_latent: bool          # the update waits for the last piece (CFG rescale)


def plan_steps(sampler: SamplerConfig, tokens: int, patches: int, warmup: int) -> list[StepPlan]:
    """The schedule of ``sampler.steps`` steps over ``tokens`` tokens with M = ``patches``, W = ``warmup``."""
    lo, hi = sampler.guidance_interval
    if not lo <= hi:
        raise ValueError(f"guidance_interval {sampler.guidance_interval} must be (lo, hi) with lo <= hi")
    patched = split_tokens(tokens, patches)
    whole = (slice(0, tokens),)
    plan = []
    for i, (t, t_prev) in enumerate(time_pairs(sampler.steps, sampler.rescale_t)):
        strength = step_strength(t, sampler.guidance_strength, tuple(sampler.guidance_interval))
        sync = i < warmup or patches == 1
        plan.append(StepPlan(index=i, t=t, t_prev=t_prev, strength=strength, branches=guidance_branches(strength),
                             sync=sync, pieces=whole if sync else patched,
                             whole_latent=needs_whole_latent(strength, sampler.guidance_rescale)))
    return plan
