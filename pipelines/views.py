"""Views stage: the multi-view cascade's first stage, in place of preprocess and camera (upstream ``load_views``).

Each view of the checked folder (``RunState.input_views``, a ``ViewSet``) is decoded; a view with transparency
keeps its alpha, one without is matted by the background remover (the alpha only: no crop, no rescale, since
``transforms.json`` describes the framing as given). The cameras come from ``transforms.json``: the matrices
and fields of view as float32 tensors, as upstream reads them. A config without a remover refuses opaque views
before any weight is read (``check_input``).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from PIL import Image
from torch import nn

from pixal3d.config import CascadeConfig
from pixal3d.models.multiview import PosedViews
from pixal3d.models.preprocess import (
    NEEDS_ALPHA_ADVICE,
    has_transparency,
    to_rgb_or_rgba,
)
from pixal3d.models.views import ViewsError, ViewSet, load_view
from pixal3d.staging import preserved_rng

from .stage import CascadeStage
from .state import RunState


class ViewsStage(CascadeStage):
    """``state.views``: every view matted (RGBA) with its camera."""

    name = "views"
    section = "weights"  # weights.rembg: the background remover, if any
    inputs = ("input_views",)
    outputs = ("views",)

    def __init__(self, *, remover: str | None):
        self.remover = remover
        self.needs = ("rembg",) if remover is not None else ()

    @classmethod
    def from_config(cls, config: CascadeConfig) -> ViewsStage:
        return cls(remover=config.weights.rembg)

    def working_set(self) -> int:
        return 0  # the views' pixels, next to nothing beside the models

    def check_input(self, views: Any) -> None:
        """Without a remover every view must carry the object's mask as alpha: say so before any weight is read."""
        if not isinstance(views, ViewSet):
            raise ViewsError(f"the multi-view cascade takes a views folder (a folder with a transforms.json), not "
                             f"{type(views).__name__}; pass views=FOLDER")
        if self.remover is None:
            for frame in views.frames:
                if not has_transparency(to_rgb_or_rgba(load_view(frame))):
                    raise ViewsError(f"view {frame.name} ({frame.path}) has no transparency, {NEEDS_ALPHA_ADVICE}")

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        views: ViewSet = state.input_views
        images = tuple(self._matted(load_view(frame), frame.name, models) for frame in views.frames)
        transforms = torch.tensor([frame.transform for frame in views.frames], dtype=torch.float32)  # [V, 4, 4]
        fovs = torch.tensor([frame.fov for frame in views.frames], dtype=torch.float32)  # [V]
        state.views = PosedViews(images, transforms, fovs, views.mesh_scale, tuple(f.name for f in views.frames))

    def _matted(self, image: Image.Image, name: str, models: Mapping[str, nn.Module]) -> Image.Image:
        """``image`` as RGBA: its own alpha when it has transparency, else the remover's mask (upstream:
        ``rembg_model(image.convert('RGB')).convert('RGBA')``)."""
        image = to_rgb_or_rgba(image)
        if has_transparency(image):
            return image
        if not self.needs:
            raise ViewsError(f"view {name} has no transparency, {NEEDS_ALPHA_ADVICE}")
        with preserved_rng():  # matting must not move the noise draws that follow
            return models["rembg"](image.convert("RGB")).convert("RGBA")
