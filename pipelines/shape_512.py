"""Shape stage at 512 (LR): the shape flow on noise at the structure's coords (reference §1.5).

Noise ``randn(N_lr, 32)`` (CPU) on ``coords_lr``; projection grid = the coords grid (32³) with
DINOv3 at 512 px and NAF to 512²; the sampled latent is de-normalized with pipeline.json's
``shape_slat_normalization`` (``latent · std + mean``).
"""
from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from pixal3d.config import CascadeConfig, ShapeConfig
from pixal3d.nn.sparse_tensor import SparseTensor

from .flow_stage import (
    CONDITION_INPUTS,
    draw_noise,
    extractor,
    norm_tensors,
    sample,
    stage_condition,
)
from .stage import CascadeStage
from .state import RunState
from .working_set import flow_stage_bytes, lr_tokens


class Shape512Stage(CascadeStage):
    """LR shape latent on the sparse-structure coords."""

    name = "shape_512"
    section = "shape_512"
    needs = ("dinov3", "naf", "shape_slat_flow_model_512")
    flow_model = "shape_slat_flow_model_512"
    inputs = (*CONDITION_INPUTS, "coords_lr", "shape_normalization")
    outputs = ("lr_noise", "lr_latent")
    transient = ("cond",)

    def __init__(self, config: ShapeConfig, coords_resolution: int):
        self.config = config
        self.coords_resolution = coords_resolution

    @classmethod
    def from_config(cls, config: CascadeConfig) -> Shape512Stage:
        return cls(config.shape_512, config.structure.coords_resolution)

    def working_set(self) -> int:
        return flow_stage_bytes(lr_tokens(self.coords_resolution), self.config.condition.image_size, 2048, naf=True)

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        cfg = self.config
        coords = state.coords_lr.to(state.device)
        cond = stage_condition(state, models, extractor("shape_512", cfg.condition, self.coords_resolution), coords)
        state.lr_noise = draw_noise(state.generator, coords.shape[0], cfg.latent_channels)  # [N_lr, C] f32, CPU
        latent = sample(models[self.flow_model], SparseTensor(state.lr_noise.to(state.device), coords),
                        cond, cfg.sampler, state=state, stage=self.name)
        mean, std = norm_tensors(state.shape_normalization, state.device)
        state.lr_latent = latent.replace(latent.feats * std + mean)
