"""Camera stage: the field of view (given, or estimated by MoGe-2) and the distance that frames the
``[-0.5, 0.5]`` cube (reference §1.2). With a fixed field of view the stage needs no model."""
from __future__ import annotations

import math
from collections.abc import Mapping

from torch import nn

from pixal3d.config import CascadeConfig
from pixal3d.models.camera import camera_from_fov, estimate_camera, moge_available
from pixal3d.staging import preserved_rng

from .stage import CascadeStage
from .state import RunState


class CameraStage(CascadeStage):
    """``state.camera`` from the run's ``fov_deg``, else the config's, else MoGe-2 (``use_moge``), else the
    reference's fallback field of view."""

    name = "camera"
    section = "camera"
    inputs = ("image", "fov_deg")
    outputs = ("camera",)

    def __init__(self, fov_deg: float | None, *, use_moge: bool):
        if fov_deg is not None and not 0.0 < fov_deg < 180.0:
            raise ValueError(f"field of view {fov_deg} degrees is not in (0, 180); pass e.g. fov=49")
        self.fov_deg = fov_deg
        self.use_moge = use_moge and fov_deg is None
        self.needs = ("moge",) if self.use_moge else ()

    @classmethod
    def from_config(cls, config: CascadeConfig) -> CameraStage:
        """MoGe-2 is used when no field of view is configured, a source is, and the package is installed."""
        fov = config.camera.fov_deg
        return cls(fov, use_moge=fov is None and config.weights.moge is not None and moge_available())

    def working_set(self) -> int:
        return 0  # MoGe-2's activations at 512 px are small beside its weights

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        fov = state.fov_deg if state.fov_deg is not None else self.fov_deg
        if fov is not None:
            state.camera = camera_from_fov(math.radians(fov))
        else:
            # The reference estimates the camera before seeding: whatever MoGe draws must not move
            # the four noise draws that follow.
            with preserved_rng():
                state.camera = estimate_camera(state.image, models["moge"] if self.use_moge else None)
