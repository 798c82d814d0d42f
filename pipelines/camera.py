"""Camera stage: the field of view (given, or estimated by MoGe-2) and the distance that frames the
``[-0.5, 0.5]`` cube (reference §1.2). With a fixed field of view the stage needs no model."""
from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from pixal3d.config import MOGE_PRECISIONS, CascadeConfig, check_fov
from pixal3d.devices import kind
from pixal3d.memory_budget import (
    CAMERA_BAND_ROWS,
    CAMERA_FLOAT16_BYTES,
    CAMERA_FLOAT32_BANDED_BYTES,
    CAMERA_FLOAT32_BYTES,
    CAMERA_MEASURED_WEIGHT_BYTES,
)
from pixal3d.models.camera import camera_from_fov, estimate_camera_and_points
from pixal3d.staging import preserved_rng

from .stage import CascadeStage, StageBudget
from .state import RunState


class CameraStage(CascadeStage):
    """``state.camera`` from the run's ``fov_deg``, else the config's, else MoGe-2 (``use_moge``: the config
    names its weights), else the reference's fallback field of view."""

    name = "camera"
    section = "camera"
    inputs = ("image", "fov_deg")
    outputs = ("camera",)

    def __init__(self, fov_deg: float | None, *, use_moge: bool, precision: str = "auto"):
        check_fov(fov_deg)
        if precision not in MOGE_PRECISIONS:
            raise ValueError(f"MoGe-2 precision {precision!r} is not one of {', '.join(MOGE_PRECISIONS)}")
        self.fov_deg = fov_deg
        self.use_moge = use_moge and fov_deg is None
        self.precision = precision  # CameraConfig.moge_precision
        self.weight_bytes = 0  # MoGe-2's, once fitted (0: unknown)
        self.device: str | None = None  # the device it runs on, once fitted (None: unknown)
        self.band_rows: int | None = None  # MoGe-2's 3×3 convs in row bands of this many rows (None: whole)
        self.needs = ("moge",) if self.use_moge else ()
        self.keep_points = False  # a --mesh run's camera also keeps MoGe-2's object points (``with_points``)

    @classmethod
    def from_config(cls, config: CascadeConfig) -> CameraStage:
        """MoGe-2 is used when no field of view is configured and the config names its weights."""
        fov = config.camera.fov_deg
        return cls(fov, use_moge=fov is None and config.weights.moge is not None,
                   precision=config.camera.moge_precision)

    def with_points(self) -> CameraStage:
        """A copy that also writes ``scene_points``: MoGe-2's points of the object, for ``--mesh-pose estimate``
        (None when MoGe-2 does not run: a field of view was given)."""
        stage = copy.copy(self)
        stage.keep_points = True
        stage.outputs = (*self.outputs, "scene_points")
        return stage

    def fitted(self, budget: StageBudget) -> CameraStage:
        """A copy that knows its MoGe-2's weight bytes (``working_set`` scales with them: the whole model's, also
        when its blocks stream) and its device (which decides whether ``auto`` runs float16 autocast or float32);
        under an explicit budget on the CPU, MoGe-2's conv neck and heads run in row bands (``CAMERA_BAND_ROWS``: the
        same bits there, checked; a GPU's conv kernels are chosen by size too and were not checked, so they run
        whole there)."""
        stage = copy.copy(self)
        stage.weight_bytes, stage.device = budget.model_bytes or budget.weight_bytes, budget.device
        checked = budget.device is not None and kind(budget.device).banded_convs  # the CPU's kernels
        stage.band_rows = CAMERA_BAND_ROWS if budget.explicit and self.use_moge and checked else None
        return stage

    def working_set(self) -> int:
        """MoGe-2's ``infer`` as measured for the released ViT-L (benchmarks/camera.md; its token count does not
        grow with the image); nothing without it. What runs is counted: float16 autocast's (the larger: it keeps a
        float16 copy of the weights) where ``moge_fp16`` says the device runs it, float32's elsewhere (``auto`` on
        the CPU); before the plan has given the stage its device, float16's, the larger. A smaller checkpoint
        (the demo's) scales it by √(its bytes / the released bytes): activations go with width × depth, weights
        with width² × depth, so for a model no deeper than the release the square root bounds the activations'
        ratio from above. Unknown bytes (0) count the release. In row bands (``band_rows``), float32's banded
        measurement; float16's stays the whole one (not measured banded: on this CPU its emulated kernels take
        ~45 min a run), an upper bound."""
        if not self.use_moge:
            return 0
        half = moge_fp16(self.precision, self.device) if self.device is not None else self.precision != "float32"
        if half:
            measured = CAMERA_FLOAT16_BYTES
        else:
            measured = CAMERA_FLOAT32_BANDED_BYTES if self.band_rows is not None else CAMERA_FLOAT32_BYTES
        if 0 < self.weight_bytes < CAMERA_MEASURED_WEIGHT_BYTES:
            return int(measured * math.sqrt(self.weight_bytes / CAMERA_MEASURED_WEIGHT_BYTES))
        return measured

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        fov = state.fov_deg if state.fov_deg is not None else self.fov_deg
        if fov is not None:
            state.camera = camera_from_fov(math.radians(fov))
            if self.keep_points:
                state.scene_points = None
        else:
            # The reference estimates the camera before seeding: whatever MoGe draws must not move
            # the four noise draws that follow.
            with preserved_rng():
                state.camera, points = estimate_camera_and_points(
                    state.image, models["moge"] if self.use_moge else None,
                    use_fp16=moge_fp16(self.precision, state.device), band_rows=self.band_rows,
                    points=self.keep_points)
            if self.keep_points:
                state.scene_points = points

    def choices(self) -> dict[str, Any]:
        return {"conv_band_rows": self.band_rows} if self.band_rows is not None else {}


def moge_fp16(precision: str, device: torch.device | str) -> bool:
    """Whether MoGe-2 runs under float16 autocast: ``float16``, or ``auto`` on any device but the CPU (whose
    float16 kernels are emulated; see ``CameraConfig``)."""
    return precision == "float16" or (precision == "auto" and kind(device).half_default)


def camera_source(config: CascadeConfig, fov_deg: float | None) -> str:
    """Where a run's field of view came from: ``given`` (the run's or the config's), ``MoGe-2``, or ``fallback``
    (a config naming no MoGe-2 weights)."""
    if fov_deg is not None or config.camera.fov_deg is not None:
        return "given"
    return "MoGe-2" if config.weights.moge is not None else "fallback"
