"""RunState: everything one image's run has produced so far, handed from stage to stage.

Each stage reads the fields earlier stages wrote and writes its own; nothing else is shared. Tensors
live on the run's device except the noise, which is drawn on the CPU generator (reference §7.1)
and kept on the CPU as drawn. ``conditions`` holds the current stage's image conditioning only:
the cascade fingerprints it and clears it when the stage ends, so the large projected features do
not outlive their stage.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pixal3d.mesh.fields import DualGridFields, PbrVoxels
from pixal3d.nn.sparse_tensor import SparseTensor


@dataclass
class RunState:
    """One image's run. Field groups follow the stage that writes them."""

    input_path: Path
    output_path: Path
    seed: int
    device: torch.device
    progress: bool = True                     # tqdm bars for sampler steps
    # preprocess
    image: Any = None                         # PIL.Image, RGB, object cropped and composited on black
    # camera
    camera: Any = None                        # pixal3d.models.camera.Camera
    features: Any = None                      # FeatureCache: DINOv3 tokens once per (image, size); first use
    # structure
    ss_noise: torch.Tensor | None = None      # [1, C, R, R, R] f32, CPU
    ss_latent: torch.Tensor | None = None     # [1, C, R, R, R] f32
    coords_lr: torch.Tensor | None = None     # [N_lr, 4] int32 (b, x, y, z), lexicographic
    # shape_512
    lr_noise: torch.Tensor | None = None      # [N_lr, 32] f32, CPU
    lr_latent: SparseTensor | None = None     # de-normalized shape latent on coords_lr
    # upsample
    coords_hr: torch.Tensor | None = None     # [N_hr, 4] int32, unique (sorted)
    hr_resolution: int | None = None          # decode resolution after the token budget
    # shape_1024
    hr_noise: torch.Tensor | None = None      # [N_hr, 32] f32, CPU
    shape_latent: SparseTensor | None = None  # de-normalized shape latent on coords_hr
    # texture
    tex_noise: torch.Tensor | None = None     # [N_hr, 32] f32, CPU
    tex_latent: SparseTensor | None = None    # de-normalized texture latent on coords_hr
    # decode
    fields: DualGridFields | None = None
    pbr: PbrVoxels | None = None
    # export
    glb_path: Path | None = None
    export_stats: dict[str, Any] = field(default_factory=dict)
    # per stage, transient
    conditions: dict[str, Any] = field(default_factory=dict)

