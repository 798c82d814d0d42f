"""Plain structures that carry the decoders' output to the mesh code (no network knows about meshes)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

PBR_LAYOUT: dict[str, slice] = {
    "base_color": slice(0, 3),
    "metallic": slice(3, 4),
    "roughness": slice(4, 5),
    "alpha": slice(5, 6),
}


@dataclass(frozen=True)
class DualGridFields:
    """Flexible-dual-grid fields of the shape decoder at ``resolution`` (voxels per axis).

    coords:         [M, 3] int32 voxel indices (x, y, z) in [0, resolution)
    dual_vertices:  [M, 3] float32 offset of the voxel's dual vertex, in voxel units, in (-0.5, 1.5)
    intersected:    [M, 3] bool, the voxel's owned x/y/z edge crosses the surface
    split_weight:   [M] float32 > 0, chooses the quad diagonal (w0*w2 > w1*w3 → 0-2)
    """

    coords: torch.Tensor
    dual_vertices: torch.Tensor
    intersected: torch.Tensor
    split_weight: torch.Tensor
    resolution: int


@dataclass(frozen=True)
class PbrVoxels:
    """Texture decoder output: ``attrs [M, 6]`` float32 (``PBR_LAYOUT``) on ``coords [M, 3]`` int32 (x, y, z)."""

    coords: torch.Tensor
    attrs: torch.Tensor
    resolution: int
