"""Decode stage: shape decoder → flexible-dual-grid fields and subdivision logits; texture decoder,
guided by those logits, → PBR voxels on exactly the shape's voxels (reference §1.9, §1.10)."""
from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from .stage import Stage
from .state import RunState


class DecodeStage(Stage):
    """Latents → ``DualGridFields`` and ``PbrVoxels`` at the cascade's resolution."""

    name = "decode"
    needs = ("shape_slat_decoder", "tex_slat_decoder")
    outputs = ("fields", "pbr")

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        shape_decoder = models["shape_slat_decoder"]
        shape_decoder.set_resolution(state.hr_resolution)
        fields, subs = shape_decoder.decode_fields(state.shape_latent)
        state.fields = fields
        state.pbr = models["tex_slat_decoder"].decode_pbr(state.tex_latent, subs, state.hr_resolution)
