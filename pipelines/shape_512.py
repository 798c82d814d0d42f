"""Shape stage at 512 (LR): the shape flow on noise at the structure's coords (reference §1.5).

Noise ``randn(N_lr, 32)`` (CPU) on ``coords_lr``; projection grid = the coords grid (32³) with
DINOv3 at 512 px and NAF to 512²; the sampled latent is de-normalized with pipeline.json's
``shape_slat_normalization`` (``latent · std + mean``).
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


class Shape512Stage(Stage):
    """LR shape latent on the sparse-structure coords."""

    name = "shape_512"
    needs = ("dinov3", "naf", "shape_slat_flow_model_512")
    outputs = ("lr_noise", "lr_latent")

    def __init__(self, config: ShapeConfig, normalization: Normalization, coords_resolution: int):
        self.config = config
        self.normalization = normalization
        self.coords_resolution = coords_resolution

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        cfg = self.config
        coords = state.coords_lr.to(state.device)
        cond = stage_condition(state, models, extractor("shape_512", cfg.condition, self.coords_resolution), coords)
        state.lr_noise = draw_noise(coords.shape[0], cfg.latent_channels)  # [N_lr, C] f32, CPU
        latent = sample(models["shape_slat_flow_model_512"], SparseTensor(state.lr_noise.to(state.device), coords),
                        cond, cfg.sampler, progress=state.progress)
        mean, std = norm_tensors(self.normalization, state.device)
        state.lr_latent = latent.replace(latent.feats * std + mean)
