"""Flow-matching Euler sampler with classifier-free guidance, a guidance interval and CFG rescale.

Reproduces TRELLIS.2's ``FlowEulerGuidanceIntervalSampler`` (used for all three Pixal3D flow stages):

* time grid ``t = linspace(1, 0, steps + 1)`` (float64), rescaled ``t' = r·t / (1 + (r − 1)·t)``;
* the model is called as ``model(x_t, 1000·t as a float32 [B] tensor, cond)`` and predicts the velocity;
* inside the inclusive interval ``lo <= t <= hi`` the velocity is the CFG mix ``s·v(cond) + (1 − s)·v(neg)``
  (two forwards, positive first; ``s == 1`` → positive only, ``s == 0`` → negative only), outside it is
  the positive prediction alone;
* CFG rescale ``g`` (Lin et al. 2024, "Common Diffusion Noise Schedules and Sample Steps are Flawed"):
  the x0 predicted by the mix is rescaled to the per-sample std of the positive x0 and blended by ``g``.
  Dense latents use ``torch.std`` (Bessel-corrected); sparse latents ``sqrt(E[x²] − E[x]²)`` per sample
  (population), as the reference's ``VarLenTensor.std``;
* Euler step ``x_prev = x_t − (t − t_prev)·v``.

Latents are dense ``Tensor [B, ...]`` or ``SparseTensor`` (features ``[N, C]``, one row slice per sample).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from .nn.sparse_tensor import SparseTensor

Latent = torch.Tensor | SparseTensor
FlowModel = Callable[[Latent, torch.Tensor, Any], Latent]


def rescaled_timesteps(steps: int, rescale_t: float) -> np.ndarray:
    """The ``steps + 1`` float64 times from 1 to 0: ``r·t / (1 + (r − 1)·t)`` of ``linspace(1, 0, steps + 1)``."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    if rescale_t <= 0:
        raise ValueError(f"rescale_t must be > 0; got {rescale_t}")
    t = np.linspace(1, 0, steps + 1)
    return rescale_t * t / (1 + (rescale_t - 1) * t)


def time_pairs(steps: int, rescale_t: float) -> list[tuple[float, float]]:
    """``(t, t_prev)`` of each step as Python floats (the reference's scalar maths)."""
    return list(itertools.pairwise(rescaled_timesteps(steps, rescale_t).tolist()))


def dense_std(x: torch.Tensor) -> torch.Tensor:
    """Per-sample std of a dense latent ``[B, ...]`` (Bessel-corrected), shape ``[B, 1, ...]``."""
    return x.std(dim=list(range(1, x.dim())), keepdim=True)


def packed_std(feats: torch.Tensor, layout: list[slice]) -> torch.Tensor:
    """Per-sample population std ``sqrt(E[x²] − E[x]²)`` of packed features ``[N, C]``, shape ``[B, 1]``."""
    lengths = [s.stop - s.start for s in layout]
    counts = torch.tensor(lengths, device=feats.device)
    sample = torch.arange(len(lengths), device=feats.device).repeat_interleave(counts, output_size=feats.shape[0])
    mean = segment_mean(feats.mean(dim=1), sample, counts)  # [B]
    mean_sq = segment_mean((feats ** 2).mean(dim=1), sample, counts)
    return (mean_sq - mean ** 2).sqrt()[:, None]


def segment_mean(values: torch.Tensor, sample: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Mean of ``values [N]`` per sample (``sample [N]``: row → sample index, rows of a sample in order;
    ``count [B]``: each sample's rows, as integers), in the values' dtype.

    The sums accumulate in fp32 (fp64 for fp64 values) on every device, whatever the values' dtype: one slot
    takes a sample's ~20k rows, which half precision cannot hold (bf16 stops adding 1 at 256), and Metal's
    ``index_add`` upcasts fp16/bf16 accumulators to fp32 only in some cases (pytorch/pytorch#187109), so the
    upcast is done here. For fp32 values this is bitwise ``torch.segment_reduce(values, "mean", lengths=...)``
    on the CPU: both add a sample's rows one by one in row order from zero (``index_add_`` on a 1-D
    accumulator is that sequential loop), then divide by the row count. ``segment_reduce`` has no MPS kernel;
    ``index_add_`` has (on a GPU the adds are atomic, so the order, and the last bits, vary).
    """
    wide = torch.float64 if values.dtype == torch.float64 else torch.float32
    sums = values.new_zeros(count.shape[0], dtype=wide).index_add_(0, sample, values.to(wide))  # [B]
    return (sums / count.to(wide)).to(values.dtype)


class LatentOps:
    """How the sampler sees one latent kind: features as a plain tensor, the model call, the std."""

    def __init__(self, template: Latent):
        self.template = template
        self.sparse = isinstance(template, SparseTensor)
        self.batch = template.batch_size if self.sparse else template.shape[0]

    def features(self, x: Latent) -> torch.Tensor:
        return x.feats if isinstance(x, SparseTensor) else x

    def wrap(self, feats: torch.Tensor) -> Latent:
        return self.template.replace(feats) if self.sparse else feats

    def std(self, feats: torch.Tensor) -> torch.Tensor:
        """Per-sample std, broadcastable against ``feats``."""
        if not self.sparse:
            return dense_std(feats)
        layout = self.template.layout
        std = packed_std(feats, layout)  # [B, 1]
        if len(layout) == 1:
            return std
        counts = torch.tensor([s.stop - s.start for s in layout], device=feats.device)
        return std.repeat_interleave(counts, dim=0)  # [N, 1]


def step_strength(t: float, guidance_strength: float, guidance_interval: tuple[float, float]) -> float:
    """The CFG strength at time ``t``: ``guidance_strength`` inside the inclusive interval, else 1 (no CFG)."""
    lo, hi = guidance_interval
    return guidance_strength if lo <= t <= hi else 1


def guidance_branches(strength: float) -> tuple[str, ...]:
    """The model passes a step needs, in call order: ``("pos",)`` at s == 1, ``("neg",)`` at s == 0,
    else ``("pos", "neg")``."""
    if strength == 1:
        return ("pos",)
    if strength == 0:
        return ("neg",)
    return ("pos", "neg")


def combine_predictions(x: torch.Tensor, t: float, preds: Mapping[str, torch.Tensor], strength: float,
                        rescale: float, sigma_min: float, std: Callable[[torch.Tensor], torch.Tensor] | None
                        ) -> torch.Tensor:
    """The guided velocity from the branch predictions of ``guidance_branches(strength)`` (reference
    semantics and op order). ``std`` (per-sample, broadcastable) is only called for CFG rescale, i.e. when
    both branches ran and ``rescale > 0``; everything else is element-wise, so it may run on any
    slice of the tokens."""
    if strength == 1:
        return preds["pos"]
    if strength == 0:
        return preds["neg"]
    pred_pos = preds["pos"]
    pred = strength * pred_pos + (1 - strength) * preds["neg"]
    if rescale > 0:
        if std is None:
            raise ValueError("CFG rescale needs the per-sample std of the whole latent; pass std")
        x0_pos = _to_x0(x, t, pred_pos, sigma_min)
        x0_cfg = _to_x0(x, t, pred, sigma_min)
        x0_rescaled = x0_cfg * (std(x0_pos) / std(x0_cfg))
        x0 = rescale * x0_rescaled + (1 - rescale) * x0_cfg
        pred = ((1 - sigma_min) * x - x0) / (sigma_min + (1 - sigma_min) * t)
    return pred


def needs_whole_latent(strength: float, rescale: float) -> bool:
    """Whether ``combine_predictions`` at this strength reads a statistic of the whole latent (CFG rescale)."""
    return len(guidance_branches(strength)) == 2 and rescale > 0


def euler_step(x: torch.Tensor, t: float, t_prev: float, v: torch.Tensor) -> torch.Tensor:
    """``x_prev = x_t − (t − t_prev)·v`` (element-wise)."""
    return x - (t - t_prev) * v


def _velocity(model: FlowModel, ops: LatentOps, x: torch.Tensor, t: float, cond: Any) -> torch.Tensor:
    """One forward: the model's velocity features at ``x`` and time ``t`` (passed as 1000·t)."""
    t_in = torch.tensor([1000 * t] * ops.batch, device=x.device, dtype=torch.float32)
    return ops.features(model(ops.wrap(x), t_in, cond))


def _guided_velocity(model: FlowModel, ops: LatentOps, x: torch.Tensor, t: float, cond: Any, neg_cond: Any,
                     strength: float, rescale: float, sigma_min: float) -> torch.Tensor:
    """Classifier-free guided velocity with optional CFG rescale (reference semantics and op order)."""
    branches = guidance_branches(strength)
    if "neg" in branches and neg_cond is None:
        raise ValueError(f"guidance_strength {strength} needs neg_cond; pass the unconditional inputs")
    preds = {b: _velocity(model, ops, x, t, cond if b == "pos" else neg_cond) for b in branches}
    return combine_predictions(x, t, preds, strength, rescale, sigma_min, ops.std)


def _to_x0(x: torch.Tensor, t: float, v: torch.Tensor, sigma_min: float) -> torch.Tensor:
    """Clean-sample estimate from a velocity: ``(1 − σ)·x_t − (σ + (1 − σ)·t)·v``."""
    return (1 - sigma_min) * x - (sigma_min + (1 - sigma_min) * t) * v


@torch.no_grad()
def sample_flow_euler(model: FlowModel, noise: Latent, *, cond: Any, neg_cond: Any, steps: int,
                      guidance_strength: float, guidance_rescale: float, guidance_interval: tuple[float, float],
                      rescale_t: float, sigma_min: float = 1e-5, progress: bool = True,
                      callback: Callable[[dict[str, Any]], None] | None = None) -> Latent:
    """Integrate the flow from ``noise`` (t = 1) to a sample (t = 0) in ``steps`` Euler steps.

    ``model(x, t, cond)`` returns the velocity in x's kind (dense Tensor or SparseTensor); bind extra
    inputs (``concat_cond``) with ``functools.partial``. ``callback`` gets, after each step, a dict with
    ``step``, ``t``, ``t_prev``, ``x_t``, ``velocity`` and ``x_prev`` (latents in the noise's kind).
    Returns the final latent, in the noise's kind.
    """
    lo, hi = guidance_interval
    if not lo <= hi:
        raise ValueError(f"guidance_interval {guidance_interval} must be (lo, hi) with lo <= hi")
    ops = LatentOps(noise)
    x = ops.features(noise)
    pairs = time_pairs(steps, rescale_t)
    for i, (t, t_prev) in enumerate(tqdm(pairs, desc="flow sampling", disable=not progress)):
        strength = step_strength(t, guidance_strength, guidance_interval)
        v = _guided_velocity(model, ops, x, t, cond, neg_cond, strength, guidance_rescale, sigma_min)
        x_prev = euler_step(x, t, t_prev, v)
        if callback is not None:
            callback({"step": i, "t": t, "t_prev": t_prev, "x_t": ops.wrap(x),
                      "velocity": ops.wrap(v), "x_prev": ops.wrap(x_prev)})
        x = x_prev
    return ops.wrap(x)
