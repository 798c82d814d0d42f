"""Mesh encode stage of a ``--mesh`` run: the user's mesh, placed in the image's frame, → its shape latent.

TRELLIS.2's ``Trellis2TexturingPipeline.encode_shape_slat``: the mesh's flexible dual grid at the decode resolution
(``pixal3d.mesh.voxelize``, pure NumPy/PyTorch where TRELLIS.2 calls o_voxel's C++), then its shape encoder; the
latent takes the place of ``shape_1024``'s and the texture stage samples on it as on the cascade's own. The voxels
are kept (``mesh_voxels``): the texture decoder decodes back to exactly them.

The pose: ``aligned`` takes the mesh's coordinates as they are (it is in the image's frame, as a shape-only output
is); ``estimate`` registers MoGe-2's points of the image to it (``pixal3d.mesh.register``; the camera stage keeps
them for this run); ``normalize`` centres and scales it into the cube as TRELLIS.2's ``preprocess_mesh`` does. A mesh that a shape-only run of this project wrote, unchanged, carries the latent it was decoded
from and the run's generator state (``pixal3d.mesh.latent_note``): with ``aligned`` that latent is used instead of
encoding the mesh again, so the texture is the full run's, bit for bit.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from pixal3d.config import CascadeConfig

from .stage import CascadeStage, StageBudget
from .state import RunState
from .working_set import mesh_encode_bytes

VOXEL_MARGIN_BYTES = 160 * 2**20  # the stage's own temporaries beyond the encoder's
HEAD_RADII = {1: 1, 2: 14, 3: 56, 4: 204}
"""``FlexiDualGridVaeEncoder.head_radius`` of the released encoder (tested): the plan sizes tiles before it loads."""


class MeshEncodeStage(CascadeStage):
    """``shape_latent``, ``hr_resolution``, ``mesh_voxels`` and ``mesh_pose`` from ``input_mesh``."""

    name = "mesh_encode"
    section = "upsample"  # upsample.hr_resolution: the grid the mesh is voxelised at
    needs = ("shape_encoder",)
    inputs = ("input_mesh", "camera", "scene_points", "generator", "progress")
    draws = "generator"  # sets its state from a shape-only note: records after it keep the state
    outputs = ("shape_latent", "hr_resolution", "mesh_voxels", "mesh_pose")

    def __init__(self, hr_resolution: int, upsample_times: int, tiles=None):
        self.hr_resolution = hr_resolution
        self.upsample_times = upsample_times
        self.tiles = tiles  # pixal3d.models.shape_encoder.EncodeTiles under a budget the whole encoder does not fit

    @classmethod
    def from_config(cls, config: CascadeConfig) -> MeshEncodeStage:
        return cls(config.upsample.hr_resolution, config.upsample.times)

    def working_set(self) -> int:
        # the voxeliser (~200 B per voxel, chunked) runs before the encoder and is freed: the encoder sets the peak
        tiles = self.tiles
        if tiles is None:
            return mesh_encode_bytes(self.hr_resolution, self.upsample_times) + VOXEL_MARGIN_BYTES
        return mesh_encode_bytes(self.hr_resolution, self.upsample_times, tiles.levels, tiles.tile_voxels,
                                 HEAD_RADII.get(tiles.levels, 0)) + VOXEL_MARGIN_BYTES

    def fitted(self, budget: StageBudget) -> MeshEncodeStage:
        """Under an explicit budget the whole encoder does not fit: its first stages over tiles (``encode_tiled``),
        the fewest levels and the largest tiles that fit (the smallest when none does: the plan then refuses)."""
        if not budget.explicit or self.working_set() <= budget.work_bytes:
            return self
        from pixal3d.models.shape_encoder import EncodeTiles

        options = [EncodeTiles(levels, tile) for levels in (2, 3) for tile in (1 << 21, 1 << 20, 1 << 19, 1 << 18)]
        for tiles in options:
            stage = copy.copy(self)
            stage.tiles = tiles
            if stage.working_set() <= budget.work_bytes:
                return stage
        return stage

    def choices(self) -> dict:
        if self.tiles is None:
            return {}
        return {"tiles": {"levels": self.tiles.levels, "tile_voxels": self.tiles.tile_voxels}}

    @torch.no_grad()
    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        from pixal3d.mesh.latent_note import usable_note
        from pixal3d.mesh.user_mesh import CUBE, check_in_cube

        mesh = state.input_mesh
        pose = self.pose(state)
        placed = pose.apply(mesh.vertices)
        check_in_cube(placed, mesh.source, pose.kind, tolerance=1.0 / self.hr_resolution)
        # a decoded surface's dual vertices reach half a voxel past the cube: voxelised clamped into it
        inside = np.clip(placed, -CUBE, CUBE * (1 - 1e-6))
        fields = _voxelise(inside, mesh.faces, self.hr_resolution, state.progress)
        state.mesh_voxels = fields.coords
        state.mesh_pose = pose
        state.hr_resolution = self.hr_resolution
        note = usable_note(mesh) if pose.kind == "aligned" else None
        if note is not None:  # this project's own shape-only output, unchanged: the latent it was decoded from
            state.shape_latent = note.latent.to(state.device)
            state.generator.set_state(note.generator_state)
            return
        encoder, fields = models["shape_encoder"], _on(fields, state.device)
        if self.tiles is None:
            state.shape_latent = encoder.encode(fields).latent
        else:
            state.shape_latent = encoder.encode_tiled(fields, self.tiles)

    def pose(self, state: RunState):
        from pixal3d.mesh.register import ScenePoints, estimate_pose
        from pixal3d.mesh.user_mesh import MeshPose

        mesh = state.input_mesh
        if getattr(mesh, "pose", "aligned") == "aligned":
            return MeshPose()
        if mesh.pose == "normalize":  # TRELLIS.2's preprocess_mesh: the bounding box centred, its longest side 0.99999
            low, high = mesh.extent()
            scale = 0.99999 / float((high - low).max())
            return MeshPose("normalize", scale=scale, offset=tuple(float(c) for c in -scale * (low + high) / 2))
        if state.scene_points is None:
            from pixal3d.mesh.user_mesh import MeshError

            raise MeshError(f"--mesh {mesh.source}: --mesh-pose estimate needs MoGe-2's points of the image, and this "
                            f"run's field of view was given (MoGe-2 did not run): drop --fov, or pass --mesh-pose "
                            f"aligned")
        return estimate_pose(mesh.vertices, mesh.faces, ScenePoints(state.scene_points.cpu().numpy()),
                             state.camera.distance, name=mesh.source)


def _voxelise(vertices, faces, resolution: int, progress: bool):
    from pixal3d.mesh.voxelize import mesh_to_dual_grid

    return mesh_to_dual_grid(torch.as_tensor(vertices, dtype=torch.float32), torch.as_tensor(faces),
                             resolution, progress=progress)


def _on(fields, device: torch.device):
    import dataclasses

    return dataclasses.replace(fields, coords=fields.coords.to(device), dual_vertices=fields.dual_vertices.to(device),
                               intersected=fields.intersected.to(device), split_weight=fields.split_weight.to(device))
