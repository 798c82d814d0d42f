"""Decoder outputs to a textured GLB: flexible dual grid, cleanup, simplification, UV atlas, baking, export."""
from .export import STEPS, ExportReport, ExportSettings, StepReport, export_glb
from .fields import PBR_LAYOUT, DualGridFields, PbrVoxels

__all__ = [
    "PBR_LAYOUT",
    "STEPS",
    "DualGridFields",
    "ExportReport",
    "ExportSettings",
    "PbrVoxels",
    "StepReport",
    "export_glb",
]
