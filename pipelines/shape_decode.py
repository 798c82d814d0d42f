"""Shape decode stage of a shape-only run: the shape decoder alone → flexible-dual-grid fields (reference §1.9).

The same fields as the full cascade's ``decode`` (the shape half of its work, tiled alike under a budget), with no
texture decoder loaded: the stage a ``--shape-only`` run ends with, before its untextured export.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from pixal3d.models.decoder_tiling import decode_tiled

from .decode import DecodeStage
from .state import RunState


class ShapeDecodeStage(DecodeStage):
    """``shape_latent`` → ``DualGridFields`` at the run's decode resolution. Its working set is the decode's (both
    decoders' outputs): an upper bound, so a shape-only plan never asks for less than it may use."""

    name = "shape_decode"
    needs = ("shape_slat_decoder",)
    inputs = ("shape_latent", "hr_resolution")
    outputs = ("fields",)

    @torch.no_grad()
    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        decoder = models["shape_slat_decoder"]
        decoder.set_resolution(state.hr_resolution)
        if self.tile_plan is None:
            state.fields, _ = decoder.decode_fields(state.shape_latent)
        else:
            state.fields, _, _ = decode_tiled(decoder, state.shape_latent, self.tile_plan,
                                              resolution=state.hr_resolution)
