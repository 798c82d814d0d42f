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
    SparseFlowStage,
    draw_noise,
    extractor,
    norm_tensors,
    sample,
    stage_condition,
)
from .state import RunState
from .working_set import lr_tokens


class Shape512Stage(SparseFlowStage):
    """LR shape latent on the sparse-structure coords."""

    name = "shape_512"
    section = "shape_512"
    needs = ("naf", "shape_slat_flow_model_512")
    flow_model = "shape_slat_flow_model_512"
    inputs = (*CONDITION_INPUTS, "coords_lr", "shape_normalization")
    outputs = ("lr_noise", "lr_latent")
    transient = ("cond",)

    def __init__(self, config: ShapeConfig, coords_resolution: int):
        self.config = config
        self.coords_resolution = coords_resolution
        self.naf_mode = config.condition.naf_mode

    @classmethod
    def from_config(cls, config: CascadeConfig) -> Shape512Stage:
        return cls(config.shape_512, config.structure.coords_resolution)

    def estimated_tokens(self) -> int:
        return lr_tokens(self.coords_resolution)

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        cfg = self.config
        coords = state.coords_lr.to(state.device)
        with self.bounded():
            cond = stage_condition(state, models, extractor("shape_512", cfg.condition, self.coords_resolution),
                                   coords, naf_mode=self.naf_mode, views=self.view_count is not None)
            state.lr_noise = draw_noise(state.generator, coords.shape[0], cfg.latent_channels)  # [N_lr, C], CPU
            latent = sample(models[self.flow_model], SparseTensor(state.lr_noise.to(state.device), coords),
                            cond, cfg.sampler, state=state, stage=self.name)
        mean, std = norm_tensors(state.shape_normalization, state.device)
        state.lr_latent = latent.replace(latent.feats * std + mean)
