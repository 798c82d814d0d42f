"""The camera the projection conditioning assumes: a field of view and the distance that frames the cube.

Pixal3D places a pinhole camera at world ``(0, -distance, 0)`` looking along ``+y`` and picks the
distance so that the ``[-0.5, 0.5]`` cube's x-extremes land exactly on the image's left/right borders:
``distance = 0.5 / tan(fov / 2)``. The field of view comes from the user (``--fov``), from MoGe-2
(``pixal3d.models.moge``, as the reference's ``get_camera_params_wild_moge``), or, for a config that names no
MoGe-2 weights, from the reference pipeline's fallback.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from pixal3d.config import FOV, check_fov

from .moge import MoGe2

logger = logging.getLogger(__name__)

FALLBACK_FOV = 0.8575560450553894
"""The reference pipeline's default ``camera_angle_x`` in radians (about 49.1 degrees)."""


@dataclass(frozen=True)
class Camera:
    """Horizontal field of view ``fov`` (radians, the reference's ``camera_angle_x``), camera distance
    from the origin, and the mesh scale the grid is divided by (1 in the cascade)."""

    fov: float
    distance: float
    mesh_scale: float = 1.0


def camera_from_fov(fov: float) -> Camera:
    """The camera for a horizontal field of view in radians, with the reference's distance rule."""
    if not (isinstance(fov, (int, float)) and math.isfinite(fov) and FOV.contains(math.degrees(fov))):
        raise ValueError(f"field of view {fov!r} rad is not in (0, pi); pass a field of view in degrees between 0 "
                         f"and 180 (exclusive), e.g. fov=49")
    # Reference `distance_from_fov`: the grid point (-1, 0, 0) -> world (-0.5, 0, 0) must land on pixel
    # column 0 of a virtual 512-px image. The focal length (`compute_f_pixels`) is a float32 tensor
    # (16 / tan, then * 512 / 32), read out as a Python float; the rest is Python float math.
    focal_px = ((16.0 / torch.tan(torch.tensor(fov / 2.0, dtype=torch.float32))) * 512 / 32.0).item()
    x_ndc = 0.0 - 256.0
    distance = focal_px * -0.5 / x_ndc - 0.0
    return Camera(fov=float(fov), distance=distance, mesh_scale=1.0)


def camera_from_degrees(fov_degrees: float) -> Camera:
    """``camera_from_fov`` for a field of view given in degrees (the CLI's ``--fov``)."""
    if fov_degrees is None:
        raise TypeError("camera_from_degrees needs a field of view in degrees, not None")
    check_fov(fov_degrees)
    return camera_from_fov(math.radians(fov_degrees))


def estimate_camera(image: Image.Image, estimator: MoGe2 | None, *, use_fp16: bool = True,
                    band_rows: int | None = None) -> Camera:
    """See ``estimate_camera_and_points`` (the camera alone)."""
    return estimate_camera_and_points(image, estimator, use_fp16=use_fp16, band_rows=band_rows)[0]


def estimate_camera_and_points(image: Image.Image, estimator: MoGe2 | None, *, use_fp16: bool = True,
                               band_rows: int | None = None, points: bool = False
                               ) -> tuple[Camera, torch.Tensor | None]:
    """Camera for a preprocessed RGB image: MoGe-2's horizontal fov (``infer`` with the reference's defaults;
    ``use_fp16``: its float16 autocast; ``band_rows``: its conv neck and heads in row bands, the same bits), or the
    fallback when ``estimator`` is None (a config without MoGe-2)."""
    if estimator is None:
        logger.warning("the config names no MoGe-2 weights (weights.moge) and no field of view: using the "
                       "reference's fallback field of view %.4f rad (%.2f deg); pass fov=DEG to choose one",
                       FALLBACK_FOV, math.degrees(FALLBACK_FOV))
        return camera_from_fov(FALLBACK_FOV), None
    # As the reference: the RGB pixels (its PNG round trip is lossless) / 255 in float32, [3, H, W].
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    tensor = torch.from_numpy(pixels).permute(2, 0, 1).to(next(estimator.parameters()).device)  # [3, H, W]
    output = estimator.infer(tensor, use_fp16=use_fp16, band_rows=band_rows)
    # MoGe intrinsics are normalised by the image width/height: fx_n = fx / width. As the reference
    # (`get_camera_params_wild_moge`), fx and width / (2 fx) stay numpy scalars of the intrinsics' dtype
    # (float32); only atan runs in float64.
    intrinsics = output.intrinsics.squeeze().cpu().numpy()
    width = image.width
    fx = intrinsics[0, 0] * width
    fov = 2 * math.atan(width / (2 * fx))
    logger.info("MoGe-2 estimated a horizontal field of view of %.2f deg (%s)", math.degrees(fov),
                "float16 autocast" if use_fp16 else "float32")
    return camera_from_fov(fov), (object_points(output, pixels) if points else None)


def object_points(output, pixels: np.ndarray) -> torch.Tensor:
    """MoGe-2's camera-space points ``[K, 3]`` float32 (CPU) of the object's pixels: valid in its mask and not the
    black the preprocessed image composites the object on (for ``--mesh-pose estimate``)."""
    pts = output.points.squeeze(0).float().cpu()  # [H, W, 3]
    valid = output.mask.squeeze(0).cpu() & torch.from_numpy(pixels.max(axis=2) > 0)
    return pts[valid & torch.isfinite(pts).all(dim=-1)].contiguous()
