"""What the four flow stages share: drawing noise from the run's generator, conditioning, sampling.

Noise is drawn with ``torch.randn`` from the run's CPU generator (``RunState.generator``, seeded once), then
moved to the run's device, at exactly the reference's four points (structure, shape 512, shape 1024,
texture; reference §7.1): the reference seeds the global CPU generator and draws from it, and a CPU
``torch.Generator`` seeded the same gives the same bits, on every device. Nothing else draws from it.

Sampling goes through ``sample``: today's single-process sampler, or, when the run has a parallel
runtime (``RunState.parallel``, rank 0 under torchrun), ``pixal3d.parallel.parallel_sample`` with the
same inputs, which the other ranks join (``pipelines/parallel.py``).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from pixal3d.config import ConditionConfig, SamplerConfig
from pixal3d.models.conditioning import (
    ExtractorConfig,
    FeatureCache,
    condition,
    negative_condition,
)
from pixal3d.nn.sparse_tensor import SparseTensor
from pixal3d.parallel import parallel_sample
from pixal3d.pipeline_json import Normalization
from pixal3d.samplers import sample_flow_euler

from .state import RunState

CONDITION_INPUTS = ("image", "camera", "device", "generator", "progress", "callback", "parallel")
"""The ``RunState`` fields every flow stage reads besides its own."""


def draw_noise(generator: torch.Generator, *shape: int) -> torch.Tensor:
    """``torch.randn(*shape)`` from the run's CPU generator (float32, on the CPU)."""
    return torch.randn(*shape, generator=generator)


def extractor(name: str, cfg: ConditionConfig, grid_resolution: int) -> ExtractorConfig:
    """The projection extractor of a stage (``grid_resolution`` when the config leaves it open)."""
    return ExtractorConfig(name, image_size=cfg.image_size, grid_resolution=cfg.grid_resolution or grid_resolution,
                           naf_size=cfg.naf_size)


def stage_condition(state: RunState, models: Any, ext: ExtractorConfig,
                    coords: torch.Tensor | None) -> dict[str, Any]:
    """``{'global', 'proj'}`` for one extractor, kept in ``state.cond`` (transient: fingerprinted, cleared)."""
    naf = models["naf"] if ext.naf_size is not None else None
    if state.features is None:
        state.features = FeatureCache()  # lives for this run: one backbone forward per (image, size)
    cond = condition(ext, state.image, state.camera, coords, backbone=models["dinov3"], naf=naf,
                     cache=state.features)
    state.cond = dict(cond)
    return cond


def sample(model: Callable[..., Any], noise: Any, cond: dict[str, Any], sampler: SamplerConfig, *,
           state: RunState, stage: str, concat_cond: SparseTensor | None = None) -> Any:
    """Run the flow-Euler sampler with the stage's parameters; the negative condition is zeros;
    ``concat_cond`` (texture: the shape latent) is passed to every model call. Each step is reported to
    ``state.callback`` as ``{"kind": "step", "stage", "step", "steps"}`` (from 1). With
    ``state.parallel`` set, every rank of the job samples together (``parallel_sample``; ``model`` is
    this rank's shard) and the result is the same latent (bit for bit under CFG-parallel)."""
    report = None
    if state.callback is not None:
        def report(info: dict[str, Any]) -> None:
            state.callback({"kind": "step", "stage": stage, "step": info["step"] + 1, "steps": sampler.steps})
    if state.parallel is not None:
        return parallel_sample(model, noise, cond=cond, neg_cond=negative_condition(cond), concat_cond=concat_cond,
                               sampler=sampler, runtime=state.parallel, callback=report)
    params = asdict(sampler)
    params["guidance_interval"] = tuple(params["guidance_interval"])
    flow = model if concat_cond is None else functools.partial(model, concat_cond=concat_cond)
    return sample_flow_euler(flow, noise, cond=cond, neg_cond=negative_condition(cond), progress=state.progress,
                             callback=report, **params)


def norm_tensors(norm: Normalization, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean [1, C], std [1, C])`` float32 on ``device``."""
    mean = torch.tensor(norm.mean, dtype=torch.float32, device=device)[None]
    std = torch.tensor(norm.std, dtype=torch.float32, device=device)[None]
    return mean, std
