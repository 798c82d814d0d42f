"""Export stage: fields + PBR voxels → textured GLB (mesh extraction, cleanup, simplify, UV, bake).

The GLB is written under a temporary name beside the output and renamed when complete, so a failed
or interrupted run never leaves a half-written file at the output path.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from torch import nn

from pixal3d.config import ExportConfig
from pixal3d.mesh.export import export_glb

from .stage import Stage
from .state import RunState


class ExportStage(Stage):
    """``state.glb_path``: the GLB at ``state.output_path`` (no model needed)."""

    name = "export"

    def __init__(self, config: ExportConfig):
        self.config = config

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        out = Path(state.output_path)
        tmp = temporary_path(out)
        try:
            report = export_glb(state.fields, state.pbr, tmp, settings=self.config.settings(),
                                progress=state.progress)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
        state.glb_path = out
        state.export_stats = report.to_dict()


def temporary_path(out: Path) -> Path:
    """``<out>.tmp<pid>.glb`` beside ``out`` (same file system, so the rename is atomic)."""
    return out.with_name(f"{out.name}.tmp{os.getpid()}{out.suffix}")
