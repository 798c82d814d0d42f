"""build_cascade: the 1024 (or 1536) cascade's stage objects and loaders from a config.

The returned ``Cascade`` keeps its stages in a plain list, so a caller may swap one before running,
e.g. a benchmark replacing the structure stage by a subclass with synthetic coords::

    cascade = build_cascade(with_sampler_steps(config, 1), weights, device="cuda")
    cascade.stages[2] = SyntheticStructure(config.structure)
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pixal3d.config import CascadeConfig
from pixal3d.hub import Normalization, ResolvedWeights
from pixal3d.models.camera import moge_available
from pixal3d.staging.events import Event

from .camera import CameraStage
from .cascade import Cascade
from .decode import DecodeStage
from .export import ExportStage
from .loaders import model_loaders
from .preprocess import PreprocessStage, rembg_loader
from .shape_512 import Shape512Stage
from .shape_1024 import Shape1024Stage
from .structure import StructureStage
from .texture import TextureStage
from .upsample import UpsampleStage


def build_stages(config: CascadeConfig, weights: ResolvedWeights, *, fov_deg: float | None = None,
                 use_moge: bool | None = None) -> list:
    """The nine stages in run order. ``fov_deg`` overrides the config's field of view."""
    if use_moge is None:
        use_moge = weights.moge is not None and moge_available()
    return _stages(config, weights.shape_normalization, weights.tex_normalization, fov_deg, use_moge)


def stage_needs(config: CascadeConfig, *, fov_deg: float | None = None, use_moge: bool = False
                ) -> dict[str, tuple[str, ...]]:
    """Stage name → model names, in run order, without resolving any weights (for ``--plan``)."""
    unused = Normalization(mean=(0.0,), std=(1.0,))  # the stages are only asked for their needs
    return {s.name: tuple(s.needs) for s in _stages(config, unused, unused, fov_deg, use_moge)}


def _stages(config: CascadeConfig, shape_norm: Normalization, tex_norm: Normalization, fov_deg: float | None,
            use_moge: bool) -> list:
    fov = fov_deg if fov_deg is not None else config.camera.fov_deg
    coords_res = config.structure.coords_resolution
    times = config.upsample.times
    return [
        PreprocessStage(use_remover=config.weights.rembg is not None),
        CameraStage(fov, use_moge=use_moge),
        StructureStage(config.structure),
        Shape512Stage(config.shape_512, shape_norm, coords_res),
        UpsampleStage(config.upsample, coords_res),
        Shape1024Stage(config.shape_1024, shape_norm, times),
        TextureStage(config.texture, shape_norm, tex_norm, times),
        DecodeStage(),
        ExportStage(config.export),
    ]


def build_cascade(config: CascadeConfig, weights: ResolvedWeights, *, device: str | torch.device = "cpu",
                  policy: Any = "staged", fov_deg: float | None = None, events: Callable[[Event], None] | None = None,
                  strict: bool = False, preserve_rng: bool = True) -> Cascade:
    """A ready-to-run ``Cascade`` (models load lazily on first use; nothing is read here)."""
    device = torch.device(device)
    stages = build_stages(config, weights, fov_deg=fov_deg)
    remover = rembg_loader(config.weights.rembg) if config.weights.rembg is not None else None
    loaders = model_loaders(weights, device, moge=any(s.needs == ("moge",) for s in stages), remover=remover)
    return Cascade(stages, loaders, policy=policy, events=events, strict=strict, preserve_rng=preserve_rng)
