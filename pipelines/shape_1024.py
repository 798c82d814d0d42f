"""Shape stage at 1024 (HR): the HR shape flow on the upsampled coords (reference §1.7).

Noise ``randn(N_hr, 32)`` (CPU) on ``coords_hr``; projection grid = the HR token grid (64³ for
1024) with DINOv3 at 1024 px and NAF to 512²; de-normalized with ``shape_slat_normalization``.
"""
from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from pixal3d.config import ShapeConfig
from pixal3d.hub import Normalization
from pixal3d.nn.sparse_tensor import SparseTensor

from .flow_stage import draw_noise, extractor, norm_tensors, sample, stage_condition
from .stage import Stage
from .state import RunState


class Shape1024Stage(Stage):
    """HR shape latent on the cascade's coords."""

    name = "shape_1024"
    needs = ("dinov3", "naf", "shape_slat_flow_model_1024")
    outputs = ("hr_noise", "shape_latent")

    def __init__(self, config: ShapeConfig, normalization: Normalization, upsample_times: int):
        self.config = config
        self.normalization = normalization
        self.upsample_times = upsample_times

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        cfg = self.config
        coords = state.coords_hr.to(state.device)
        grid = state.hr_resolution // 2 ** self.upsample_times
        cond = stage_condition(state, models, extractor("shape_1024", cfg.condition, grid), coords)
        state.hr_noise = draw_noise(coords.shape[0], cfg.latent_channels)  # [N_hr, C] f32, CPU
        latent = sample(models["shape_slat_flow_model_1024"], SparseTensor(state.hr_noise.to(state.device), coords),
                        cond, cfg.sampler, progress=state.progress)
        mean, std = norm_tensors(self.normalization, state.device)
        state.shape_latent = latent.replace(latent.feats * std + mean)
