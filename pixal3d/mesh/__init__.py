"""Decoder outputs to a textured GLB: flexible dual grid, cleanup, optional remesh, simplification, UV atlas,
baking, quality metrics, export. The names below are imported on first use: the config needs only
``ExportSettings`` (``settings.py``), and importing the export code costs half a second that ``--plan`` and
``--help`` never need."""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"STEPS": "export", "ExportedMesh": "records", "ExportReport": "records", "ExportSettings": "settings",
          "StepReport": "records", "export_glb": "export", "export_mesh": "export", "PBR_LAYOUT": "fields",
          "DualGridFields": "fields", "PbrVoxels": "fields"}

__all__ = ["PBR_LAYOUT", "STEPS", "DualGridFields", "ExportReport", "ExportSettings", "ExportedMesh", "PbrVoxels",
           "StepReport", "export_glb", "export_mesh"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
