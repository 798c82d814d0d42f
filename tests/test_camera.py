"""Camera: the reference distance rule, fov validation, MoGe-2 when present, fallback with a warning."""
import logging
import math

import pytest
import torch
from PIL import Image

from pixal3d.models import camera as camera_module
from pixal3d.models.camera import (
    FALLBACK_FOV,
    Camera,
    camera_from_degrees,
    camera_from_fov,
    estimate_camera,
    load_moge,
)


@pytest.mark.parametrize("fov", [0.3, FALLBACK_FOV, 1.2, 2.5])
def test_distance_frames_the_unit_cube(fov):
    camera = camera_from_fov(fov)
    assert camera.fov == fov and camera.mesh_scale == 1.0
    assert camera.distance == pytest.approx(0.5 / math.tan(fov / 2), rel=1e-6)


def reference_distance(fov: float) -> float:
    """Pixal3D inference.py `distance_from_fov(fov, (-1,0,0), (0, 511), 1, 512)` written out: the focal
    length is a float32 tensor (`compute_f_pixels`), read out with .item()."""
    focal32 = (16.0 / torch.tan(torch.tensor(fov / 2.0))) * 512 / 32.0  # float32 throughout
    return focal32.item() * -0.5 / (0 - 512 / 2.0) - 0.0


@pytest.mark.parametrize("fov", [FALLBACK_FOV, 0.1, 0.7, 1.3, 2.9])
def test_distance_is_bit_exact_to_the_reference_float32_focal_length(fov):
    assert camera_from_fov(fov).distance == reference_distance(fov)
    # controls: a float64 focal length from the float32 tan (the earlier bug), or all-float64, differ
    tan32 = torch.tan(torch.tensor(fov / 2, dtype=torch.float32)).item()
    assert (16 / tan32) * 512 / 32 * -0.5 / -256 != reference_distance(fov)
    assert 0.5 / math.tan(fov / 2) != reference_distance(fov)


def test_degrees_are_converted():
    assert camera_from_degrees(49.0).fov == pytest.approx(math.radians(49.0))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.pi, float("nan"), float("inf")])
def test_invalid_fov_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="field of view"):
        camera_from_fov(bad)


@pytest.mark.parametrize("bad", [0.0, 180.0, 400.0])
def test_invalid_fov_degrees_names_the_setting(bad):
    with pytest.raises(ValueError, match="fov="):
        camera_from_degrees(bad)


def test_without_moge_the_fallback_fov_is_used_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(camera_module, "moge_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="pixal3d.models.camera"):
        estimator = load_moge()
        camera = estimate_camera(Image.new("RGB", (64, 48)), estimator)
    assert estimator is None
    assert camera == camera_from_fov(FALLBACK_FOV)
    assert "moge" in caplog.text and "fallback" in caplog.text


class FakeMoGe(torch.nn.Module):
    """Returns width-normalised intrinsics with fx_n = 1 (a 2·atan(0.5) horizontal fov)."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.seen = None

    def infer(self, image):
        self.seen = image
        return {"intrinsics": torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.3, 0.5], [0.0, 0.0, 1.0]])}


def test_estimator_intrinsics_give_the_horizontal_fov():
    moge = FakeMoGe()
    camera = estimate_camera(Image.new("RGB", (64, 48), (255, 0, 0)), moge)
    assert camera.fov == pytest.approx(2 * math.atan(0.5))
    assert moge.seen.shape == (3, 48, 64) and moge.seen.dtype == torch.float32
    assert float(moge.seen[0].max()) == 1.0 and float(moge.seen[1].max()) == 0.0
    assert isinstance(camera, Camera)


class FixedFxMoGe(FakeMoGe):
    def __init__(self, fx_normalised: float):
        super().__init__()
        self.fx_normalised = fx_normalised

    def infer(self, image):
        return {"intrinsics": torch.tensor([[self.fx_normalised, 0.0, 0.5], [0.0, 1.1, 0.5], [0.0, 0.0, 1.0]])}


def test_estimated_fov_uses_the_reference_float32_fx():
    # reference get_camera_params_wild_moge: intrinsics float32 numpy; fx = fx_n * width and
    # width / (2 * fx) stay float32 scalars, math.atan turns them into a Python float
    width, fx_n = 517, 0.8123
    intrinsics = torch.tensor([[fx_n]]).numpy()
    fx = intrinsics[0, 0] * width
    expected = 2 * math.atan(width / (2 * fx))
    camera = estimate_camera(Image.new("RGB", (width, 300)), FixedFxMoGe(fx_n))
    assert camera.fov == expected
    assert camera == camera_from_fov(expected)
    control = 2 * math.atan(width / (2 * float(intrinsics[0, 0]) * width))  # float64 arithmetic differs
    assert control != expected
