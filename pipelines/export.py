"""Export stage: fields + PBR voxels → a textured mesh and its GLB bytes, in memory (mesh extraction,
cleanup, simplification, UV atlas, bake). Writing the file is the caller's: ``Result.save``."""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from torch import nn

from pixal3d.config import CascadeConfig
from pixal3d.mesh.settings import ExportSettings

from .stage import CascadeStage, StageBudget
from .state import RunState
from .working_set import export_bytes


class ExportStage(CascadeStage):
    """``state.mesh``: the ``ExportedMesh`` (no model needed)."""

    name = "export"
    section = "export"
    inputs = ("fields", "pbr", "progress")
    outputs = ("mesh",)

    def __init__(self, settings: ExportSettings, hr_resolution: int, upsample_times: int):
        self.settings = settings
        self.hr_resolution = hr_resolution
        self.upsample_times = upsample_times

    @classmethod
    def from_config(cls, config: CascadeConfig) -> ExportStage:
        return cls(config.export, config.upsample.hr_resolution, config.upsample.times)

    serial_fit = False  # the plan chose one worker (``fitted``)

    def working_set(self) -> int:
        return export_bytes(self.hr_resolution, self.upsample_times, self.settings.decimation_target,
                            self.settings.texture_size, normal_map=self.settings.normal_map,
                            occlusion_map=self.settings.occlusion_map, forked=self.settings.workers != 1)

    def fitted(self, budget: StageBudget) -> ExportStage:
        """Where the slab remesh's forked workers do not fit the memory the stage may use (the budget, or the
        machine's usable memory), a copy that runs its slabs one at a time (``workers: 1``): the same mesh, bit for
        bit, in less memory and more time (benchmarks/export_speed.md)."""
        if self.settings.workers == 1 or self.working_set() <= budget.work_bytes:
            return self
        stage = copy.copy(self)
        stage.settings, stage.serial_fit = dataclasses.replace(self.settings, workers=1), True
        return stage

    def choices(self) -> dict[str, Any]:
        return {"workers": 1} if self.serial_fit else {}

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        from pixal3d.mesh.export import (
            export_mesh,  # the mesh code (scipy's graphs, the baker): only when it runs
        )

        state.mesh = export_mesh(state.fields, state.pbr, settings=self.settings, progress=state.progress)
