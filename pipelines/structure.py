"""Structure stage: sparse-structure flow on dense noise, decoder to occupancy, max-pool to coords.

Reference §1.4: noise ``randn(1, 8, 16, 16, 16)`` (CPU), 12 guided Euler steps, decoder → logits
``[1, 1, 64, 64, 64]``, ``max_pool3d`` down to the coords grid (32³), ``argwhere(logits > 0)`` →
coords ``[N, 4]`` int32 ``(b, x, y, z)`` in lexicographic order.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from pixal3d.config import CascadeConfig, StructureConfig

from .flow_stage import (
    CONDITION_INPUTS,
    DEFAULT_CHUNKS,
    draw_noise,
    extractor,
    sample,
    stage_condition,
)
from .stage import CascadeStage
from .state import RunState
from .working_set import attention_route_bytes, structure_bytes


class EmptyStructureError(RuntimeError):
    """The sparse-structure decoder found no occupied voxel: there is nothing to build a mesh on."""


class StructureStage(CascadeStage):
    """Dense flow + decoder → the sparse coords every later stage works on."""

    name = "structure"
    section = "structure"
    needs = ("sparse_structure_flow_model", "sparse_structure_decoder")
    flow_model = "sparse_structure_flow_model"
    inputs = CONDITION_INPUTS
    outputs = ("ss_noise", "ss_latent", "coords_lr")
    transient = ("cond",)
    draws = "generator"
    attention_route = "sdpa"  # the resolved attention route (the plan sets it for the run's device)

    def __init__(self, config: StructureConfig):
        self.config = config

    @classmethod
    def from_config(cls, config: CascadeConfig) -> StructureStage:
        return cls(config.structure)

    def working_set(self) -> int:
        tokens = self.config.noise_resolution ** 3
        return structure_bytes(self.config.noise_resolution, views=self.view_count or 1,
                               image_size=self.config.condition.image_size) + attention_route_bytes(
            self.attention_route, tokens, DEFAULT_CHUNKS.attention_scores)

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        cfg = self.config
        cond = stage_condition(state, models, extractor("ss", cfg.condition, cfg.noise_resolution), None,
                               views=self.view_count is not None)
        r = cfg.noise_resolution
        state.ss_noise = draw_noise(state.generator, 1, cfg.latent_channels, r, r, r)  # [1, C, R, R, R] f32, CPU
        latent = sample(models[self.flow_model], state.ss_noise.to(state.device), cond, cfg.sampler,
                        state=state, stage=self.name)
        state.ss_latent = latent
        state.coords_lr = occupied_coords(models["sparse_structure_decoder"](latent), cfg.coords_resolution)


def occupied_coords(logits: torch.Tensor, resolution: int) -> torch.Tensor:
    """``argwhere`` of positive logits ``[B, 1, D, D, D]`` after max-pooling to ``resolution``³ → ``[N, 4]`` int32."""
    size = logits.shape[-1]
    if size % resolution:
        raise ValueError(f"decoder output {size}³ cannot be pooled to {resolution}³ (not a divisor)")
    if size != resolution:
        factor = size // resolution
        logits = F.max_pool3d(logits, kernel_size=factor, stride=factor)
    coords = torch.argwhere(logits[:, 0] > 0).int()  # [N, 4] (b, x, y, z), lexicographic
    if coords.shape[0] == 0:
        raise EmptyStructureError("the sparse structure is empty (no voxel occupied); try another seed or image")
    return coords
