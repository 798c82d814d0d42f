"""Decode stage: shape decoder → flexible-dual-grid fields and subdivision logits; texture decoder,
guided by those logits, → PBR voxels on exactly the shape's voxels (reference §1.9, §1.10).

Under an explicit memory budget that the whole decode does not fit, both decoders run over spatial tiles
with the halo their convolutions need (``pixal3d.models.decoder_tiling``): the same fields and voxels, bit
for bit with the released half-precision decoders, in bounded memory.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from torch import nn

from pixal3d.config import CascadeConfig
from pixal3d.memory_budget import plan_decode
from pixal3d.models.decoder_tiling import TilePlan, decode_shape_and_texture

from .stage import CascadeStage, StageBudget
from .state import RunState
from .working_set import decode_bytes, hr_tokens


class DecodeStage(CascadeStage):
    """Latents → ``DualGridFields`` and ``PbrVoxels`` at the run's decode resolution."""

    name = "decode"
    section = "upsample"  # upsample.hr_resolution and times: the size of the decode
    needs = ("shape_slat_decoder", "tex_slat_decoder")
    inputs = ("shape_latent", "tex_latent", "hr_resolution")
    outputs = ("fields", "pbr")

    def __init__(self, hr_resolution: int, upsample_times: int, tile_plan: TilePlan | None = None):
        self.hr_resolution = hr_resolution
        self.upsample_times = upsample_times
        self.tile_plan = tile_plan
        self.bounded_bytes: int | None = None

    @classmethod
    def from_config(cls, config: CascadeConfig) -> DecodeStage:
        return cls(config.upsample.hr_resolution, config.upsample.times)

    def working_set(self) -> int:
        if self.bounded_bytes is not None:
            return self.bounded_bytes
        return decode_bytes(self.hr_resolution, self.upsample_times)

    def fitted(self, budget: StageBudget) -> DecodeStage:
        """Tiles when an explicit budget is smaller than the whole decode, or when one of its tensors would
        exceed the device's largest array (``budget.array_bytes``: the 1536 cascade's ~20M voxels on mps);
        ``MemoryBudgetError`` when even the smallest tile is too much."""
        if not budget.explicit and budget.array_bytes is None:
            return self
        plan = plan_decode(budget.total_bytes, latent_tokens=hr_tokens(self.hr_resolution),
                           weight_bytes=budget.weight_bytes, levels=self.upsample_times,
                           array_bytes=budget.array_bytes)
        if plan is None:
            return self
        stage = copy.copy(self)
        stage.tile_plan = plan
        stage.bounded_bytes = budget.work_bytes if budget.explicit else None
        return stage

    def choices(self) -> dict[str, Any]:
        if self.tile_plan is None:
            return {}
        return {"tiles": {"start_level": self.tile_plan.start_level, "tile_voxels": self.tile_plan.tile_voxels}}

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        state.fields, state.pbr = decode_shape_and_texture(
            models["shape_slat_decoder"], models["tex_slat_decoder"], state.shape_latent, state.tex_latent,
            state.hr_resolution, plan=self.tile_plan)
