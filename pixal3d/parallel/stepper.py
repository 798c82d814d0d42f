"""The sampler's update in a patch schedule: per piece, or once for the whole latent.

Both use ``pixal3d.samplers``' own maths (``combine_predictions``, ``euler_step``), so a step with one
piece is bit-for-bit the single-process step.

* ``update_piece``: CFG mix and Euler step on one piece's rows (element-wise, hence exact per piece).
* ``update_whole``: after the last piece, when CFG rescale needs the per-sample std of x0 over every
  token. The owner rank holds every piece's prediction at that point, so it assembles them into the
  layout ``forward`` returns and evaluates the single-process std on it: the exact statistic of this
  step's predictions, with no extra communication (the issue's alternative, all-reduced sums and sums
  of squares, is needed only when no rank sees every piece). The price: in such a step the next
  step's first patch waits for this step's last one (the pipeline drains once per rescaled step).
"""
from __future__ import annotations

import torch

from ..config import SamplerConfig
from ..samplers import combine_predictions, euler_step
from .schedule import StepPlan
from .sequence import FlowSequence


def update_piece(seq: FlowSequence, sampler: SamplerConfig, step: StepPlan, piece: slice, x: torch.Tensor,
                 x_next: torch.Tensor, preds: dict[str, torch.Tensor]) -> None:
    """Write the Euler update of ``piece`` into ``x_next`` from the piece's branch predictions."""
    xp = seq.piece(x, piece)
    v = combine_predictions(xp, step.t, {b: seq.pred_piece(p) for b, p in preds.items()}, step.strength,
                            sampler.guidance_rescale, sampler.sigma_min, std=None)
    seq.piece(x_next, piece).copy_(euler_step(xp, step.t, step.t_prev, v))


def update_whole(seq: FlowSequence, sampler: SamplerConfig, step: StepPlan, x: torch.Tensor,
                 preds: dict[str, list[torch.Tensor]]) -> torch.Tensor:
    """The Euler update of the whole latent from every piece's branch predictions (CFG rescale exact)."""
    full = {b: seq.assemble(pieces) for b, pieces in preds.items()}
    v = combine_predictions(x, step.t, full, step.strength, sampler.guidance_rescale, sampler.sigma_min, seq.ops.std)
    return euler_step(x, step.t, step.t_prev, v)
