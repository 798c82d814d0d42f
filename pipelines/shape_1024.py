"""Shape stage at 1024 (HR): the HR shape flow on the upsampled coords (reference §1.7).

Noise ``randn(N_hr, 32)`` (CPU) on ``coords_hr``; projection grid = the HR token grid (64³ for
1024) with DINOv3 at 1024 px and NAF to 512²; de-normalized with ``shape_slat_normalization``.
"""
from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from pixal3d.nn.sparse_tensor import SparseTensor

from .flow_stage import (
    CONDITION_INPUTS,
    HrFlowStage,
    draw_noise,
    extractor,
    norm_tensors,
    sample,
    stage_condition,
)
from .state import RunState


class Shape1024Stage(HrFlowStage):
    """HR shape latent on the cascade's coords."""

    name = "shape_1024"
    section = "shape_1024"
    needs = ("naf", "shape_slat_flow_model_1024")
    flow_model = "shape_slat_flow_model_1024"
    inputs = (*CONDITION_INPUTS, "coords_hr", "hr_resolution", "shape_normalization")
    outputs = ("hr_noise", "shape_latent")
    transient = ("cond",)

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        cfg = self.config
        coords = state.coords_hr.to(state.device)
        grid = self.grid(state)
        with self.bounded():
            cond = stage_condition(state, models, extractor("shape_1024", cfg.condition, grid), coords,
                                   naf_mode=self.naf_mode, views=self.view_count is not None)
            state.hr_noise = draw_noise(state.generator, coords.shape[0], cfg.latent_channels)  # [N_hr, C], CPU
            latent = sample(models[self.flow_model], SparseTensor(state.hr_noise.to(state.device), coords),
                            cond, cfg.sampler, state=state, stage=self.name)
        mean, std = norm_tensors(state.shape_normalization, state.device)
        state.shape_latent = latent.replace(latent.feats * std + mean)
