"""Shape export stage of a shape-only run: fields → an untextured mesh and its GLB bytes, in memory (the export's
mesh steps: extraction, cleanup, simplification; no atlas, no bake). Writing the file is the caller's. An uncompressed
GLB carries the shape latent and the generator state (``pixal3d.mesh.latent_note``): ``--mesh`` of it, unchanged,
textures it as the full run would have."""
from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from .export import ExportStage
from .state import RunState
from .working_set import export_bytes


class ShapeExportStage(ExportStage):
    """``state.mesh``: the untextured ``ExportedMesh`` (no model needed)."""

    name = "shape_export"
    inputs = ("fields", "shape_latent", "generator", "progress")
    outputs = ("mesh",)

    def working_set(self) -> int:
        # the export's estimate without its texture images (texture_size 0, no maps): the mesh steps' share
        return export_bytes(self.hr_resolution, self.upsample_times, self.settings.decimation_target, 0,
                            normal_map=False, occlusion_map=False, forked=self.settings.workers != 1)

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        from pixal3d.mesh.export import export_shape  # the mesh code: only when it runs

        from pixal3d.mesh.latent_note import add_note

        mesh = export_shape(state.fields, settings=self.settings, progress=state.progress)
        if self.settings.compression is None:  # the note that lets --mesh of this file continue the run exactly
            mesh.glb = add_note(mesh.glb, state.shape_latent, state.generator.get_state())
            mesh.report.file_bytes = len(mesh.glb)
        state.mesh = mesh
