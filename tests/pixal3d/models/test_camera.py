"""Camera: the reference distance rule, fov validation, the fov from MoGe-2's intrinsics, the fallback (a config
without MoGe-2) with a warning; the cascade's camera stage on the offline demo's MoGe-2."""
import logging
import math
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from pixal3d.models.camera import (
    FALLBACK_FOV,
    Camera,
    camera_from_degrees,
    camera_from_fov,
    estimate_camera,
)
from tests.support.cascade_fixtures import tiny, tiny_cache  # noqa: F401


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


def test_a_config_without_moge_gets_the_fallback_fov_with_a_warning_naming_the_config_key(caplog):
    with caplog.at_level(logging.WARNING, logger="pixal3d.models.camera"):
        camera = estimate_camera(Image.new("RGB", (64, 48)), None)
    assert camera == camera_from_fov(FALLBACK_FOV)
    assert "weights.moge" in caplog.text and "fallback" in caplog.text and "fov=DEG" in caplog.text


class FakeMoGe(torch.nn.Module):
    """Returns width-normalised intrinsics with fx_n = 1 (a 2·atan(0.5) horizontal fov)."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.seen = None

    def infer(self, image, *, use_fp16=True, band_rows=None):
        self.seen = image
        return SimpleNamespace(intrinsics=torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.3, 0.5], [0.0, 0.0, 1.0]]))


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

    def infer(self, image, *, use_fp16=True, band_rows=None):
        return SimpleNamespace(intrinsics=torch.tensor([[self.fx_normalised, 0.0, 0.5], [0.0, 1.1, 0.5],
                                                        [0.0, 0.0, 1.0]]))


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


# -- MoGe-2 in the cascades ------------------------------------------------------------------------

def test_the_shipped_cascades_estimate_the_camera_with_moge_unless_a_fov_is_given():
    from pipelines.camera import CameraStage
    from pixal3d.config import CameraConfig, load_config
    from pixal3d.memory_budget import CAMERA_FLOAT16_BYTES

    for name in ("1024_cascade", "1536_cascade", "tiny"):
        config = load_config(name)
        stage = CameraStage.from_config(config)
        assert stage.needs == ("moge",) and stage.working_set() == CAMERA_FLOAT16_BYTES, name
        fixed = CameraStage.from_config(config.with_overrides(camera=CameraConfig(fov_deg=49.1)))
        assert fixed.needs == () and fixed.working_set() == 0, name


def test_the_demo_estimates_its_fov_with_moge_logs_it_without_warnings_and_a_fixed_fov_differs(tiny, caplog):
    from pixal3d.config import CameraConfig
    from tests.support.cascade_fixtures import run_tiny

    from pixal3d.staging.events import EventLog

    log = EventLog()
    with caplog.at_level(logging.INFO):
        estimated = run_tiny(tiny, "staged", until="structure", events=log)
    moves = [(e.kind, e.model, e.stage) for e in log.events if e.kind in ("load", "release")]
    # loaded for the camera stage; released as the next stage starts, before that stage loads anything
    assert moves[0] == ("load", "moge", "camera")
    assert moves[1] == ("release", "moge", "features") and moves[2] == ("load", "dinov3", "features")
    assert sum(1 for kind, model, _ in moves if model == "moge") == 2
    camera = estimated.record()["camera"]
    assert camera["source"] == "MoGe-2" and 50.0 < camera["fov_deg"] < 70.0  # the demo model's ~59 degrees
    assert camera["moge_precision"] == "float32"  # auto on the CPU
    assert estimated.camera_line() == f"camera: {camera['fov_deg']:.2f}° horizontal field of view (MoGe-2, float32)"
    assert "MoGe-2 estimated a horizontal field of view of" in caplog.text
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []  # no missing package
    assert [r.used for r in estimated.stages][:2] == [[], ["moge"]] and "moge" not in estimated.stages[2].used
    fixed = run_tiny(tiny.with_overrides(camera=CameraConfig(fov_deg=49.1)), "staged", until="camera")
    assert fixed.record()["camera"]["source"] == "given" and fixed.stages[1].used == []
    assert fixed.fingerprints()["camera"]["camera.fov"] != estimated.fingerprints()["camera"]["camera.fov"]


def test_the_plan_of_the_default_cascade_counts_moges_checkpoint_bytes_at_the_camera_stage(tiny_cache, tmp_path):
    """The 1024 cascade's stages on the demo's files, with a real-size MoGe-2 index (saved from meta: the plan
    reads the tensor sizes, not the data)."""
    from pipelines import Pixal3D
    from pixal3d.memory_budget import CAMERA_FLOAT32_BYTES
    from pixal3d.models.moge import build_moge
    from scripts.make_moge_fixture import RELEASED_MODEL_CONFIG

    (tmp_path / "moge").mkdir()
    torch.save({"model_config": RELEASED_MODEL_CONFIG, "model": build_moge(RELEASED_MODEL_CONFIG).state_dict()},
               tmp_path / "moge" / "model.pt")
    (tmp_path / "config.yaml").write_text(
        "base: 1024_cascade.yaml\nweights:\n  pixal3d: {generate: tiny}\n  dinov3: {generate: tiny}\n"
        "  naf: {generate: tiny, files: [naf.safetensors]}\n  moge: {local: moge, files: [model.pt]}\n"
        + "".join(f"{stage}: {{sampler: {{guidance_interval: [0.6, 1.0]}}}}\n"  # the demo's pipeline.json has none
                  for stage in ("structure", "shape_512", "shape_1024", "texture")))
    plan = Pixal3D.plan(tmp_path / "config.yaml", device="cpu")
    camera = next(s for s in plan.memory.stages if s.name == "camera")
    assert camera.models == ("moge",) and camera.weight_bytes == 1_304_836_908
    # the released model: the measured figure, unscaled; float32's, what 'auto' runs on the CPU (issue 44 item 12)
    assert camera.working_bytes == CAMERA_FLOAT32_BYTES
    row = next(line for line in plan.table().splitlines() if line.startswith("camera"))
    assert "moge" in row and "1.22 GiB" in row
    # the demo's MoGe-2: its few hundred kB scale the working set by the square root of the bytes
    demo = next(s for s in Pixal3D.plan("tiny", device="cpu").memory.stages if s.name == "camera")
    assert 0 < demo.weight_bytes < 2**20
    assert demo.working_bytes == int(CAMERA_FLOAT32_BYTES * math.sqrt(demo.weight_bytes / 1_304_836_908)) < 2**27


def test_offline_without_moges_checkpoint_the_fetcher_names_it_with_the_command(tiny, tmp_path, monkeypatch):
    import dataclasses

    from huggingface_hub import constants

    from pixal3d.config import load_config
    from pixal3d.hub import MissingWeightsError
    from pixal3d.pipeline_json import planned_sizes, resolve_weights

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = load_config("1024_cascade").weights.moge
    weights = dataclasses.replace(tiny.weights, moge=source)
    with pytest.raises(MissingWeightsError) as info:
        resolve_weights(weights, need_moge=True)
    lines = str(info.value).splitlines()
    assert lines[1] == f"  weights.moge from Ruicheng/moge-2-vitl@{source.revision}:" and lines[2] == "    model.pt"
    assert f"or this source alone (online): hf download Ruicheng/moge-2-vitl model.pt --revision {source.revision}" in lines
    sizes, notes = planned_sizes(weights, models=["moge"])
    assert sizes["moge"] == 0 and "model.pt: size unknown offline" in notes


def test_moge_precision_reaches_infer_auto_is_float32_only_on_the_cpu_and_the_demo_fov_moves_only_slightly(
        tiny, tmp_path):
    """``camera.moge_precision`` decides ``infer(use_fp16=)``; on the demo float32 and MoGe's float16 autocast agree
    to ~1e-3 rad, and ``auto`` on the CPU is the float32 run bit for bit."""
    from pipelines.camera import CameraStage
    from pixal3d.config import CameraConfig, ConfigError, load_config
    from tests.support.cascade_fixtures import run_tiny

    seen = []

    class Recording(FakeMoGe):
        def infer(self, image, *, use_fp16=True, band_rows=None):
            seen.append(use_fp16)
            return super().infer(image)

    cases = [("auto", "cpu", False), ("auto", "cuda", True), ("auto", "mps", True), ("float16", "cpu", True),
             ("float32", "cuda", False)]
    for precision, device, _ in cases:
        state = SimpleNamespace(fov_deg=None, image=Image.new("RGB", (64, 48)), device=torch.device(device))
        config = tiny.with_overrides(camera=CameraConfig(moge_precision=precision))
        CameraStage.from_config(config).run(state, {"moge": Recording()})
    assert seen == [fp16 for *_, fp16 in cases]
    with pytest.raises(ValueError, match="precision 'half' is not one of auto, float16, float32"):
        CameraStage(None, use_moge=True, precision="half")
    with pytest.raises(ConfigError, match="camera.moge_precision' must be auto, float16, float32"):
        (tmp_path / "bad.yaml").write_text("base: tiny.yaml\ncamera: {moge_precision: fp16}\n")
        load_config(tmp_path / "bad.yaml")

    runs = {p: run_tiny(tiny.with_overrides(camera=CameraConfig(moge_precision=p)), "staged", until="camera")
            for p in ("auto", "float16", "float32")}
    fov = {p: r.state.camera.fov for p, r in runs.items()}
    assert fov["auto"] == fov["float32"] and fov["float16"] != fov["float32"]
    assert abs(fov["float16"] - fov["float32"]) < 1e-3
    assert runs["float16"].record()["camera"]["moge_precision"] == "float16 autocast"
