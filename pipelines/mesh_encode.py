"""Mesh encode stage of a ``--mesh`` run: the user's mesh, placed in the image's frame, → its shape latent.

TRELLIS.2's ``Trellis2TexturingPipeline.encode_shape_slat``: the mesh's flexible dual grid at the decode resolution
(``pixal3d.mesh.voxelize``, pure NumPy/PyTorch where TRELLIS.2 calls o_voxel's C++), then its shape encoder; the
latent takes the place of ``shape_1024``'s and the texture stage samples on it as on the cascade's own. The voxels
are kept (``mesh_voxels``): the texture decoder decodes back to exactly them.

The pose: ``aligned`` takes the mesh's coordinates as they are (it is in the image's frame, as a shape-only output
is); ``estimate`` registers MoGe-2's points of the image to it (``pixal3d.mesh.register``; the camera stage keeps
them for this run). A mesh that a shape-only run of this project wrote, unchanged, carries the latent it was decoded
from and the run's generator state (``pixal3d.mesh.latent_note``): with ``aligned`` that latent is used instead of
encoding the mesh again, so the texture is the full run's, bit for bit.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from pixal3d.config import CascadeConfig

from .stage import CascadeStage
from .state import RunState
from .working_set import decode_bytes

VOXEL_MARGIN_BYTES = 160 * 2**20  # the voxeliser's own temporaries beyond the encoder's (chunked)


class MeshEncodeStage(CascadeStage):
    """``shape_latent``, ``hr_resolution``, ``mesh_voxels`` and ``mesh_pose`` from ``input_mesh``."""

    name = "mesh_encode"
    section = "upsample"  # upsample.hr_resolution: the grid the mesh is voxelised at
    needs = ("shape_encoder",)
    inputs = ("input_mesh", "camera", "scene_points", "generator", "progress")
    draws = "generator"  # sets its state from a shape-only note: records after it keep the state
    outputs = ("shape_latent", "hr_resolution", "mesh_voxels", "mesh_pose")

    def __init__(self, hr_resolution: int, upsample_times: int):
        self.hr_resolution = hr_resolution
        self.upsample_times = upsample_times

    @classmethod
    def from_config(cls, config: CascadeConfig) -> MeshEncodeStage:
        return cls(config.upsample.hr_resolution, config.upsample.times)

    def working_set(self) -> int:
        # the encoder mirrors the shape decoder: its activations at each level are the decode's
        return decode_bytes(self.hr_resolution, self.upsample_times) + VOXEL_MARGIN_BYTES

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
        encoder = models["shape_encoder"]
        encoded = encoder.encode(_on(fields, state.device))
        state.shape_latent = encoded.latent

    def pose(self, state: RunState):
        from pixal3d.mesh.register import ScenePoints, estimate_pose
        from pixal3d.mesh.user_mesh import MeshPose

        mesh = state.input_mesh
        if getattr(mesh, "pose", "aligned") == "aligned":
            return MeshPose()
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
