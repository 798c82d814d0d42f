"""Camera stage: the field of view (given, or estimated by MoGe-2) and the distance that frames the
``[-0.5, 0.5]`` cube (reference §1.2). With a fixed field of view the stage needs no model."""
from __future__ import annotations

import math
from collections.abc import Mapping

from torch import nn

from pixal3d.models.camera import camera_from_fov, estimate_camera
from pixal3d.staging import preserved_rng

from .stage import Stage
from .state import RunState


class CameraStage(Stage):
    """``state.camera`` from ``fov_deg`` when given, else from MoGe-2 (``use_moge``), else the fallback."""

    name = "camera"
    outputs = ("camera",)

    def __init__(self, fov_deg: float | None, *, use_moge: bool):
        if fov_deg is not None and not 0.0 < fov_deg < 180.0:
            raise ValueError(f"field of view {fov_deg} degrees is not in (0, 180); pass e.g. --fov 49")
        self.fov_deg = fov_deg
        self.use_moge = use_moge and fov_deg is None
        self.needs = ("moge",) if self.use_moge else ()

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        if self.fov_deg is not None:
            state.camera = camera_from_fov(math.radians(self.fov_deg))
        else:
            # The reference estimates the camera before seeding: whatever MoGe draws must not move
            # the four noise draws that follow.
            with preserved_rng():
                state.camera = estimate_camera(state.image, models["moge"] if self.use_moge else None)
