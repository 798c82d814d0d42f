"""Texture stage: the texture flow, conditioned on the image and on the shape latent (reference §1.8).

The de-normalized shape latent is normalized again (a float round trip the reference does, kept for
bit-exactness) and concatenated to the noise ``randn(N_hr, 32)`` (CPU) inside the flow; the result is
de-normalized with ``tex_slat_normalization``.
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


class TextureStage(HrFlowStage):
    """PBR texture latent on the HR coords."""

    name = "texture"
    section = "texture"
    needs = ("naf", "tex_slat_flow_model_1024")
    flow_model = "tex_slat_flow_model_1024"
    inputs = (*CONDITION_INPUTS, "shape_latent", "hr_resolution", "shape_normalization", "tex_normalization")
    outputs = ("tex_noise", "tex_latent")
    transient = ("cond",)

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        cfg = self.config
        shape = state.shape_latent
        grid = self.grid(state)
        with self.bounded():
            cond = stage_condition(state, models, extractor("tex_1024", cfg.condition, grid), shape.coords,
                                   naf_mode=self.naf_mode, views=self.view_count is not None)
            shape_mean, shape_std = norm_tensors(state.shape_normalization, state.device)
            shape_norm = shape.replace((shape.feats - shape_mean) / shape_std)
            state.tex_noise = draw_noise(state.generator, shape.coords.shape[0], cfg.latent_channels)  # [N_hr, C]
            noise = SparseTensor(state.tex_noise.to(state.device), shape.coords)
            latent = sample(models[self.flow_model], noise, cond, cfg.sampler, state=state, stage=self.name,
                            concat_cond=shape_norm)
        mean, std = norm_tensors(state.tex_normalization, state.device)
        state.tex_latent = latent.replace(latent.feats * std + mean)
