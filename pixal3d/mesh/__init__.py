"""Decoder outputs to a textured GLB: flexible dual grid, cleanup, simplification, UV atlas, baking, export."""
from .fields import DualGridFields, PbrVoxels

__all__ = ["DualGridFields", "PbrVoxels"]
