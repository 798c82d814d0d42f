"""Texture stage: the texture flow, conditioned on the image and on the shape latent (reference §1.8).

The de-normalized shape latent is normalized again (a float round trip the reference does, kept for
bit-exactness) and concatenated to the noise ``randn(N_hr, 32)`` (CPU) inside the flow; the result is
de-normalized with ``tex_slat_normalization``.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping

from torch import nn

from pixal3d.config import ShapeConfig
from pixal3d.hub import Normalization
from pixal3d.nn.sparse_tensor import SparseTensor

from .flow_stage import draw_noise, extractor, norm_tensors, sample, stage_condition
from .stage import Stage
from .state import RunState


class TextureStage(Stage):
    """PBR texture latent on the HR coords."""

    name = "texture"
    needs = ("dinov3", "naf", "tex_slat_flow_model_1024")
    outputs = ("tex_noise", "tex_latent")

    def __init__(self, config: ShapeConfig, shape_normalization: Normalization, tex_normalization: Normalization,
                 upsample_times: int):
        self.config = config
        self.shape_normalization = shape_normalization
        self.tex_normalization = tex_normalization
        self.upsample_times = upsample_times

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        cfg = self.config
        shape = state.shape_latent
        grid = state.hr_resolution // 2 ** self.upsample_times
        cond = stage_condition(state, models, extractor("tex_1024", cfg.condition, grid), shape.coords)
        shape_mean, shape_std = norm_tensors(self.shape_normalization, state.device)
        shape_norm = shape.replace((shape.feats - shape_mean) / shape_std)
        state.tex_noise = draw_noise(shape.coords.shape[0], cfg.latent_channels)  # [N_hr, C] f32, CPU
        flow = functools.partial(models["tex_slat_flow_model_1024"], concat_cond=shape_norm)
        latent = sample(flow, SparseTensor(state.tex_noise.to(state.device), shape.coords), cond, cfg.sampler,
                        progress=state.progress)
        mean, std = norm_tensors(self.tex_normalization, state.device)
        state.tex_latent = latent.replace(latent.feats * std + mean)
