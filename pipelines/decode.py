"""Decode stage: shape decoder → flexible-dual-grid fields and subdivision logits; texture decoder,
guided by those logits, → PBR voxels on exactly the shape's voxels (reference §1.9, §1.10)."""
from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from pixal3d.config import CascadeConfig

from .stage import CascadeStage
from .state import RunState
from .working_set import decode_bytes


class DecodeStage(CascadeStage):
    """Latents → ``DualGridFields`` and ``PbrVoxels`` at the run's decode resolution."""

    name = "decode"
    section = "upsample"  # upsample.hr_resolution: the size of the decode
    needs = ("shape_slat_decoder", "tex_slat_decoder")
    inputs = ("shape_latent", "tex_latent", "hr_resolution")
    outputs = ("fields", "pbr")

    def __init__(self, hr_resolution: int):
        self.hr_resolution = hr_resolution

    @classmethod
    def from_config(cls, config: CascadeConfig) -> DecodeStage:
        return cls(config.upsample.hr_resolution)

    def working_set(self) -> int:
        return decode_bytes(self.hr_resolution)

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        shape_decoder = models["shape_slat_decoder"]
        shape_decoder.set_resolution(state.hr_resolution)
        fields, subs = shape_decoder.decode_fields(state.shape_latent)
        state.fields = fields
        state.pbr = models["tex_slat_decoder"].decode_pbr(state.tex_latent, subs, state.hr_resolution)
