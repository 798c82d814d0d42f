"""Upsample stage: the cascade's LR→HR coords (reference §1.6, §1.12).

The shape decoder subdivides the LR latent ``times`` times (32³ → 512³ coords); the coords are
quantized to the HR token grid ``G = resolution / 2^times`` with Pixal3D's rule
``round((c + 0.5) / U · (G − 1))`` (U = the upsampled grid, 512) and made unique (sorted). While
there are at least ``max_tokens`` HR tokens and the resolution is above ``min_resolution``, the
resolution steps down by ``resolution_step`` (the 1536 cascade's token budget).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from pixal3d.config import CascadeConfig, UpsampleConfig

from .stage import CascadeStage
from .state import RunState
from .structure import EmptyStructureError
from .working_set import upsample_bytes


class UpsampleStage(CascadeStage):
    """LR latent → HR token coords and the decode resolution."""

    name = "upsample"
    section = "upsample"
    needs = ("shape_slat_decoder",)
    inputs = ("lr_latent",)
    outputs = ("coords_hr", "hr_resolution")

    def __init__(self, config: UpsampleConfig, coords_resolution: int):
        self.config = config
        self.coords_resolution = coords_resolution

    @classmethod
    def from_config(cls, config: CascadeConfig) -> UpsampleStage:
        return cls(config.upsample, config.structure.coords_resolution)

    def working_set(self) -> int:
        return upsample_bytes(self.coords_resolution, self.config.times)

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        cfg = self.config
        fine = models["shape_slat_decoder"].upsample(state.lr_latent, times=cfg.times)  # [M, 4] int32
        if fine.shape[0] == 0:
            raise EmptyStructureError(
                f"the shape decoder kept no voxel when upsampling the {state.lr_latent.feats.shape[0]} LR tokens "
                f"(every subdivision logit <= 0); try another seed or image")
        upsampled = self.coords_resolution * 2 ** cfg.times
        resolution = cfg.hr_resolution
        while True:
            coords = quantize_coords(fine, upsampled, resolution // 2 ** cfg.times)
            if coords.shape[0] < cfg.max_tokens or resolution <= cfg.min_resolution:
                break
            resolution -= cfg.resolution_step
        state.coords_hr = coords
        state.hr_resolution = resolution


def quantize_coords(coords: torch.Tensor, upsampled: int, grid: int) -> torch.Tensor:
    """``[M, 4]`` int32 coords on an ``upsampled``³ grid → unique sorted ``[N, 4]`` int32 on ``grid``³."""
    xyz = ((coords[:, 1:].float() + 0.5) / upsampled * (grid - 1)).round().int()
    return torch.unique(torch.cat([coords[:, :1], xyz], dim=1), dim=0)
