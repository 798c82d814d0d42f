"""Decoder outputs to a textured GLB: flexible dual grid, cleanup, optional remesh, simplification, UV atlas,
baking, quality metrics, export."""
from .export import STEPS, ExportedMesh, ExportReport, ExportSettings, StepReport, export_glb, export_mesh
from .fields import PBR_LAYOUT, DualGridFields, PbrVoxels

__all__ = [
    "PBR_LAYOUT",
    "STEPS",
    "DualGridFields",
    "ExportedMesh",
    "ExportReport",
    "ExportSettings",
    "PbrVoxels",
    "StepReport",
    "export_glb",
    "export_mesh",
]
