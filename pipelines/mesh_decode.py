"""Texture decode of a ``--mesh`` run: the texture latent → PBR voxels on exactly the mesh's voxels.

TRELLIS.2's texturing decodes with no shape decoder: its texture decoder's channel-to-space blocks undo the shape
encoder's space-to-channel ones (their cached children), so the PBR voxels are the mesh's own dual-grid voxels. Here
the same children are explicit: ``guide_to_voxels`` turns the mesh's voxels into the subdivision logits the texture
decoder takes (``guide_subs``), parent by parent in its order. Under a budget the whole decode does not fit, it runs
over the decode's spatial tiles (``decode_texture_to_voxels``), each tile's guide from its own rows.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from pixal3d.models.decoder_tiling import decode_texture_to_voxels

from .decode import DecodeStage
from .state import RunState


class MeshDecodeStage(DecodeStage):
    """``tex_latent`` → ``PbrVoxels`` on ``mesh_voxels`` at the run's decode resolution (no shape decoder)."""

    name = "mesh_decode"
    needs = ("tex_slat_decoder",)
    inputs = ("tex_latent", "mesh_voxels", "hr_resolution")
    outputs = ("pbr",)

    @torch.no_grad()
    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        voxels = state.mesh_voxels.to(state.tex_latent.coords.device)
        state.pbr = decode_texture_to_voxels(models["tex_slat_decoder"], state.tex_latent, voxels,
                                             state.hr_resolution, plan=self.tile_plan)
