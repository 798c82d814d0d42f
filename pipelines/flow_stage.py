"""What the four flow stages share: drawing noise on the CPU generator, conditioning, sampling.

Noise is drawn with ``torch.randn`` on the CPU default generator, then moved to the run's device,
at exactly the reference's four points (structure, shape 512, shape 1024, texture; reference
§7.1), so the same seed gives the same noise on every device. Nothing else in a run draws from
that generator: models are loaded inside ``preserved_rng()`` by the registry.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from pixal3d.config import ConditionConfig, SamplerConfig
from pixal3d.hub import Normalization
from pixal3d.models.conditioning import ExtractorConfig, FeatureCache, condition, negative_condition
from pixal3d.samplers import sample_flow_euler

from .state import RunState


def draw_noise(*shape: int) -> torch.Tensor:
    """``torch.randn(*shape)`` from the CPU default generator (the run's only random draws)."""
    return torch.randn(*shape)


def extractor(name: str, cfg: ConditionConfig, grid_resolution: int) -> ExtractorConfig:
    """The projection extractor of a stage (``grid_resolution`` when the config leaves it open)."""
    return ExtractorConfig(name, image_size=cfg.image_size, grid_resolution=cfg.grid_resolution or grid_resolution,
                           naf_size=cfg.naf_size)


def stage_condition(state: RunState, models: Any, ext: ExtractorConfig,
                    coords: torch.Tensor | None) -> dict[str, Any]:
    """``{'global', 'proj'}`` for one extractor (recorded in ``state.conditions`` for fingerprints)."""
    naf = models["naf"] if ext.naf_size is not None else None
    if state.features is None:
        state.features = FeatureCache()  # lives for this run: one backbone forward per (image, size)
    cond = condition(ext, state.image, state.camera, coords, backbone=models["dinov3"], naf=naf,
                     cache=state.features)
    state.conditions.update(cond)
    return cond


def sample(model: Callable[..., Any], noise: Any, cond: dict[str, Any], sampler: SamplerConfig, *,
           progress: bool) -> Any:
    """Run the flow-Euler sampler with the stage's parameters; the negative condition is zeros."""
    params = asdict(sampler)
    params["guidance_interval"] = tuple(params["guidance_interval"])
    return sample_flow_euler(model, noise, cond=cond, neg_cond=negative_condition(cond), progress=progress,
                             **params)


def norm_tensors(norm: Normalization, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean [1, C], std [1, C])`` float32 on ``device``."""
    mean = torch.tensor(norm.mean, dtype=torch.float32, device=device)[None]
    std = torch.tensor(norm.std, dtype=torch.float32, device=device)[None]
    return mean, std
