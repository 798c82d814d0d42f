"""Sparse-structure flow: the dense DiT over the 16³×8 occupancy latent, conditioned on the global
image tokens and on pixel-aligned features of every grid point (Pixal3D ``proj`` mode).

Tokens are the grid voxels flattened with x slowest and z fastest (``n = x·R² + y·R + z``), the same
order as the projection grid's points; RoPE phases come from the integer grid positions.
"""
from __future__ import annotations

import torch

from ..nn.rope import grid_positions, rope_phases
from .flow_transformer import FlowTransformer
from .loading import register_model


@register_model("SparseStructureFlowModel")
class SparseStructureFlowModel(FlowTransformer):
    """``forward(x [B, Cin, R, R, R] f32, t [B] f32 (1000·t), cond {'global': [B, S, Cc], 'proj': [B, R³, Cp]})
    -> [B, Cout, R, R, R] f32``."""

    def rope_phases(self, device: torch.device) -> torch.Tensor:
        """RoPE phases ``[R³, head_dim/2]`` of the grid, derived on the fly (not a buffer). Computed on the
        CPU and moved, as the reference builds its phase buffer on the CPU at construction (CPU and GPU
        sin/cos may differ in the last bit)."""
        phases = rope_phases(grid_positions(self.resolution), self.head_dim, rope_freq=self.rope_freq)
        return phases.to(device)

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        r, batch = self.resolution, x.shape[0]
        if tuple(x.shape[1:]) != (self.in_channels, r, r, r):
            raise ValueError(f"x must be [B, {self.in_channels}, {r}, {r}, {r}]; got {tuple(x.shape)}")
        context, proj = cond["global"], cond["proj"]
        if proj.shape[:2] != (batch, r ** 3) or proj.shape[2] != self.proj_channels:
            raise ValueError(f"cond['proj'] must be [{batch}, {r ** 3}, {self.proj_channels}] (one feature row per "
                             f"grid point, x slowest); got {tuple(proj.shape)}")
        h = x.reshape(batch, self.in_channels, -1).transpose(1, 2)  # [B, R³, Cin]
        h = self._trunk(h, t, context, proj, self.rope_phases(x.device), None)  # [B, R³, Cout]
        return h.transpose(1, 2).reshape(batch, self.out_channels, r, r, r).contiguous()
