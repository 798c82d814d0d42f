"""Export stage of a ``--mesh`` run: the decoded PBR voxels baked onto the user's own mesh (``pixal3d.mesh.onto``)."""
from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from .export import ExportStage
from .stage import StageBudget
from .state import RunState
from .working_set import export_bytes


class MeshExportStage(ExportStage):
    """``state.mesh``: the user's mesh, textured (no model needed)."""

    name = "mesh_export"
    inputs = ("pbr", "input_mesh", "mesh_pose", "progress")
    outputs = ("mesh",)

    def working_set(self) -> int:
        # the export's estimate at this texture size, without the shading maps this bake does not make
        return export_bytes(self.hr_resolution, self.upsample_times, self.settings.decimation_target,
                            self.settings.texture_size, normal_map=False, occlusion_map=False)

    def fitted(self, budget: StageBudget) -> MeshExportStage:
        return self  # no remesh here: the user's mesh is baked as it is, so there are no slab workers to bound

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        from pixal3d.mesh.onto import export_onto

        state.mesh = export_onto(state.input_mesh, state.mesh_pose, state.pbr, settings=self.settings,
                                 progress=state.progress)
