"""RunState: everything one image's run has produced so far, handed from stage to stage.

``Pixal3D.run`` provides the first group (``PROVIDED``); each stage reads the fields earlier stages
wrote and writes its own, as its ``inputs`` and ``outputs`` declare. Tensors live on the run's device
except the noise, which is drawn from the run's CPU generator (reference §7.1) and kept on the CPU as
drawn. ``cond`` holds the current stage's image conditioning only: stages declare it transient, so the
runner fingerprints it and clears it when the stage ends and the large projected features do not
outlive their stage. ``features`` (DINOv3's tokens at each size the flow stages read) is written once, by the
features stage, and read by every flow stage; ``input_image`` is preprocess's input.

Every field a stage writes declares how it is stored between stages (``stored(kind)``, a kind of
``state_codec``): a stage writing a field without one is refused when the cascade is built.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pixal3d.mesh.fields import DualGridFields, PbrVoxels
from pixal3d.nn.sparse_tensor import SparseTensor
from pixal3d.pipeline_json import Normalization

PROVIDED = ("input_image", "input_views", "input_mesh", "generator", "device", "fov_deg", "shape_normalization",
            "tex_normalization", "progress", "callback", "parallel")
"""The fields ``Pixal3D.run`` sets before the first stage."""


def stored(kind: str) -> Any:
    """A field stages write, stored as ``kind`` (``state_codec.KINDS``) in a work directory or a spilled batch."""
    return field(default=None, metadata={"codec": kind})


@dataclass
class RunState:
    """One image's run. Field groups follow the stage that writes them."""

    # provided by the run
    input_image: Any                          # PIL.Image, upright RGB or RGBA (pixal3d.models.preprocess.as_image)
    generator: torch.Generator                # CPU, seeded once: the four noises are its only draws
    device: torch.device
    shape_normalization: Normalization        # from pipeline.json
    tex_normalization: Normalization
    fov_deg: float | None = None              # this run's field of view; None: the camera stage decides
    progress: bool = False                    # tqdm bars for sampler steps and export steps
    callback: Callable[[dict[str, Any]], None] | None = None  # progress reports (Pixal3D.run)
    parallel: Any = None                      # pixal3d.parallel.ParallelRuntime under torchrun (rank 0), else None
    input_views: Any = None                   # pixal3d.models.views.ViewSet: the multi-view cascade's input, else None
    input_mesh: Any = None                    # pixal3d.mesh.user_mesh.UserMesh: a --mesh run's mesh, else None
    # preprocess
    image: Any = stored("image")                          # PIL.Image, RGB, object cropped and composited on black
    # views (the multi-view cascade, instead of preprocess and camera)
    views: Any = stored("views")                          # pixal3d.models.multiview.PosedViews: matted, posed
    # camera
    camera: Any = stored("camera")                        # pixal3d.models.camera.Camera
    scene_points: torch.Tensor | None = stored("tensor")  # [K, 3] f32 MoGe-2's object points (a --mesh run's)
    # features
    features: Any = stored("features")                    # pixal3d.models.conditioning.ImageFeatures
    # structure
    ss_noise: torch.Tensor | None = stored("tensor")      # [1, C, R, R, R] f32, CPU
    ss_latent: torch.Tensor | None = stored("tensor")     # [1, C, R, R, R] f32
    coords_lr: torch.Tensor | None = stored("tensor")     # [N_lr, 4] int32 (b, x, y, z), lexicographic
    # shape_512
    lr_noise: torch.Tensor | None = stored("tensor")      # [N_lr, 32] f32, CPU
    lr_latent: SparseTensor | None = stored("sparse")     # de-normalized shape latent on coords_lr
    # upsample
    coords_hr: torch.Tensor | None = stored("tensor")     # [N_hr, 4] int32, unique (sorted)
    hr_resolution: int | None = stored("value")           # decode resolution after the token budget
    # shape_1024
    hr_noise: torch.Tensor | None = stored("tensor")      # [N_hr, 32] f32, CPU
    shape_latent: SparseTensor | None = stored("sparse")  # de-normalized shape latent on coords_hr
    # mesh_encode (a --mesh run: in place of structure .. shape_1024)
    mesh_voxels: torch.Tensor | None = stored("tensor")   # [M, 3] int32 the mesh's dual-grid voxels at hr_resolution
    mesh_pose: Any = stored("dataclass")                  # pixal3d.mesh.user_mesh.MeshPose
    # texture
    tex_noise: torch.Tensor | None = stored("tensor")     # [N_hr, 32] f32, CPU
    tex_latent: SparseTensor | None = stored("sparse")    # de-normalized texture latent on coords_hr
    # decode
    fields: DualGridFields | None = stored("dataclass")
    pbr: PbrVoxels | None = stored("dataclass")
    # export
    mesh: Any = stored("mesh")                            # pixal3d.mesh.export.ExportedMesh (GLB bytes + report)
    # per stage, transient
    cond: dict[str, Any] | None = None        # the stage's image conditioning {'global', 'proj'}
