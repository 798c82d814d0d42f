"""MoGe-2 in the package (pixal3d/models/moge.py) against MoGe itself.

- The released checkpoint's structure: the network built on meta at the released model_config has exactly the
  tensors of ``assets/moge_checkpoint.json`` (made from MoGe's own model definition by
  ``scripts/make_moge_fixture.py``); strict loading names every missing, unexpected and mis-shaped key.
- Parity, offline: the stored fixture (``tests/fixtures/moge_parity.*``, MoGe's outputs for the offline demo's
  MoGe-2 on the example image, float32 and float16 autocast): bit for bit with the kernels, threads and versions
  it was made with (the suite's pins, ``pixal3d.kernels``) on the kinds of CPU it was verified on, float32 within
  1e-4 elsewhere. A control shows the comparison
  fails for a near miss (the position embedding resized to a size, as transformers' DINOv2 does).
- Parity, live, where the MoGe source is importable (skipped otherwise): random weights, two configs, both
  precisions, every output bit for bit.
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from pixal3d.config import load_config
from pixal3d.models.loading import CheckpointError
from pixal3d.models.moge import (
    MoGe2,
    build_moge,
    checkpoint_bytes,
    load_moge,
    recover_focal_shift,
)
from pixal3d.staging.fingerprint import fingerprint_tensor
from pixal3d.tiny_weights import MOGE_CONFIG, _write_moge
from scripts.make_moge_fixture import (
    RELEASED_MODEL_CONFIG,
    fixture_images,
    horizontal_fov,
    moge_reference_model,
    platform_key,
)

REPO = Path(__file__).resolve().parents[3]
MANIFEST = json.loads((REPO / "assets" / "moge_checkpoint.json").read_text())
FIXTURE = REPO / "tests" / "fixtures" / "moge_parity"
RELEASED_BYTES = 1_304_836_908  # float32 payload of the released model.pt (326,209,227 parameters)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("moge")
    _write_moge(folder)
    return folder / "model.pt"


@pytest.fixture(scope="module")
def tiny_moge(tiny_file) -> MoGe2:
    return load_moge(tiny_file)


# -- the released checkpoint ----------------------------------------------------------------------

def test_released_checkpoint_tensors_are_the_network_built_on_meta_at_its_model_config():
    assert MANIFEST["model_config"] == RELEASED_MODEL_CONFIG
    model = build_moge(MANIFEST["model_config"], device="meta")
    state = model.state_dict()
    assert {k: list(t.shape) for k, t in state.items()} == MANIFEST["tensors"]
    assert {t.dtype for t in state.values()} == {torch.float32} and MANIFEST["dtype"] == "F32"
    assert sum(t.numel() for t in state.values()) == MANIFEST["params"] == 326_209_227  # model card: 326M
    assert all(t.is_meta for t in state.values())


def test_the_cascades_pin_the_revision_the_checkpoint_list_describes():
    for name in ("1024_cascade", "1536_cascade"):
        source = load_config(REPO / "configs" / f"{name}.yaml").weights.moge
        assert (source.repo, source.revision, source.files) == (MANIFEST["repo"], MANIFEST["revision"], ("model.pt",))


def test_the_plan_reads_the_bytes_from_the_checkpoint_index_without_its_data(tmp_path):
    """A real-size ``model.pt`` saved from meta: its index says 1.30 GB, the file is a few kB, and loading it is
    refused (it stores no data)."""
    path = tmp_path / "model.pt"
    torch.save({"model_config": RELEASED_MODEL_CONFIG, "model": build_moge(RELEASED_MODEL_CONFIG).state_dict()}, path)
    assert checkpoint_bytes(path) == RELEASED_BYTES and path.stat().st_size < 200_000
    with pytest.raises(CheckpointError, match="stores no data"):
        load_moge(path)


def _resave(source: Path, target: Path, change) -> Path:
    checkpoint = torch.load(source, weights_only=True)
    change(checkpoint)
    torch.save(checkpoint, target)
    return target


def test_strict_loading_names_missing_unexpected_and_misshaped_tensors(tiny_file, tmp_path):
    def drop(c):
        del c["model"]["encoder.backbone.mask_token"]

    def extra(c):
        c["model"]["encoder.backbone.register_tokens"] = torch.zeros(1, 4, 32)

    def reshape(c):
        c["model"]["neck.input_blocks.4.weight"] = torch.zeros(8, 3, 1, 1)

    for change, words in ((drop, "missing: encoder.backbone.mask_token"),
                          (extra, "unexpected: encoder.backbone.register_tokens"),
                          (reshape, "shape mismatch: neck.input_blocks.4.weight: file [8, 3, 1, 1] vs model "
                                    "[8, 2, 1, 1]")):
        with pytest.raises(CheckpointError, match=words.replace("[", r"\[").replace("]", r"\]")):
            load_moge(_resave(tiny_file, tmp_path / f"{change.__name__}.pt", change))


def test_config_errors_name_the_key_and_what_a_moge2_config_is(tiny_file, tmp_path):
    def moge1(c):
        c["model_config"]["trained_area_range"] = [250000, 1000000]

    def backbone(c):
        c["model_config"]["encoder"]["backbone"] = "dinov3_vitl16"

    with pytest.raises(CheckpointError, match=r"unknown keys \['trained_area_range'\].*MoGe-1"):
        load_moge(_resave(tiny_file, tmp_path / "v1.pt", moge1))
    with pytest.raises(CheckpointError, match="encoder.backbone 'dinov3_vitl16' is not one of"):
        load_moge(_resave(tiny_file, tmp_path / "bb.pt", backbone))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable torch checkpoint.*download it again"):
        load_moge(tmp_path / "junk.pt")
    with pytest.raises(CheckpointError, match="do not exist.*fov=DEG"):
        load_moge(tmp_path / "absent.pt")


def test_loaded_weights_are_the_files_float32_tensors_in_eval_mode(tiny_file, tiny_moge):
    stored = torch.load(tiny_file, weights_only=True)["model"]
    state = tiny_moge.state_dict()
    assert state.keys() == stored.keys() and all(torch.equal(state[k], stored[k]) for k in stored)
    assert not tiny_moge.training and not any(p.requires_grad for p in tiny_moge.parameters())


# -- parity with the stored fixture ---------------------------------------------------------------

def _fixture() -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads(FIXTURE.with_suffix(".json").read_text()), load_file(str(FIXTURE.with_suffix(".safetensors")))


def _same_platform(meta: dict) -> bool:
    """The fixture's kernels, threads and versions, on a kind of CPU it was verified on."""
    from pixal3d import kernels

    return platform_key() == meta["platform"] and kernels.cpu_kind() in meta["verified_on"]


def _platform_difference(meta: dict) -> str:
    """What differs between the fixture's platform and this one, as ``name: the fixture's → here``."""
    from pixal3d import kernels

    here, made = platform_key(), meta["platform"]
    differ = [f"{name}: {made[name]} → {here.get(name)}" for name in made if here.get(name) != made[name]]
    if kernels.cpu_kind() not in meta["verified_on"]:
        differ.append(f"CPU: {', '.join(meta['verified_on'])} → {kernels.cpu_kind()}")
    return "; ".join(differ)


def _outputs(model: MoGe2, image: torch.Tensor, fp16: bool) -> dict[str, torch.Tensor]:
    """What the fixture holds for one case, computed here."""
    with torch.inference_mode():
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            low, high = model.num_tokens_range
            raw = model.forward(image[None], int(low + (high - low)))
        points, mask = raw["points"].float(), raw["mask"].float()
    focal, shift = recover_focal_shift(points, mask > 0.5)
    out = model.infer(image, use_fp16=fp16)
    return {"raw_points": points, "raw_mask": mask, "focal": focal, "shift": shift, "points": out.points,
            "depth": out.depth, "mask": out.mask, "intrinsics": out.intrinsics}


def _compare(ours: dict[str, torch.Tensor], stored: dict[str, torch.Tensor], *, exact: bool) -> list[str]:
    """Names of the outputs that differ (bit for bit, or beyond 1e-4 with equal masks and inf placement)."""
    differ = []
    for name, want in stored.items():
        got = ours[name]
        if exact or want.dtype == torch.bool:
            same = torch.equal(got, want)
        else:
            finite = torch.isfinite(want)
            same = torch.equal(finite, torch.isfinite(got)) and torch.allclose(got[finite], want[finite], rtol=1e-4,
                                                                               atol=1e-4)
        if not same:
            differ.append(name)
    return differ


@pytest.mark.parametrize("case", ["square", "tall"])
def test_float32_matches_moge_bit_for_bit_on_the_fixture_platform_else_within_1e4(tiny_moge, case):
    meta, tensors = _fixture()
    image = tensors[f"{case}.image"]
    assert torch.equal(image, fixture_images()[case])  # the inputs are rebuilt the same way
    key = f"{case}.fp32"
    stored = {name.split(".", 2)[2]: t for name, t in tensors.items() if name.startswith(key + ".")}
    ours = _outputs(tiny_moge, image, fp16=False)
    assert _compare(ours, stored, exact=_same_platform(meta)) == []
    fov = horizontal_fov(ours["intrinsics"], image.shape[-1])
    assert fov == meta["fov"][key] if _same_platform(meta) else fov == pytest.approx(meta["fov"][key], abs=1e-4)
    assert 0.8 < fov < 1.1  # the demo model's lens: ~50-60 degrees, not the fallback's 49.1


@pytest.mark.parametrize("case", ["square", "tall"])
def test_float16_autocast_matches_moge_bit_for_bit(tiny_moge, case):
    meta, tensors = _fixture()
    if not _same_platform(meta):
        pytest.skip(f"the float16 fixture holds on its own platform only ({_platform_difference(meta)}): CPU "
                    f"half-precision kernels differ; the live test (MoGe importable) compares here")
    key = f"{case}.fp16"
    ours = _outputs(tiny_moge, tensors[f"{case}.image"], fp16=True)
    assert {k: fingerprint_tensor(v) for k, v in ours.items()} == meta["fingerprints"][key]
    assert horizontal_fov(ours["intrinsics"], tensors[f"{case}.image"].shape[-1]) == meta["fov"][key]


def test_recover_focal_shift_gives_moges_focal_and_shift_on_its_point_map():
    """On MoGe's own raw point map (stored), the focal and shift are MoGe's: the same 64×64 sample, the same
    MINPACK fit. Control: a 32×32 sample (a near miss) gives another focal."""
    meta, tensors = _fixture()
    for case in ("square", "tall"):
        points, mask = tensors[f"{case}.fp32.raw_points"], tensors[f"{case}.fp32.raw_mask"] > 0.5
        focal, shift = recover_focal_shift(points, mask)
        want_focal, want_shift = tensors[f"{case}.fp32.focal"], tensors[f"{case}.fp32.shift"]
        if _same_platform(meta):
            assert torch.equal(focal, want_focal) and torch.equal(shift, want_shift)
        else:
            assert torch.allclose(focal, want_focal, rtol=1e-5) and torch.allclose(shift, want_shift, atol=1e-4)
        near, _ = recover_focal_shift(points, mask, downsample_size=(32, 32))
        assert not torch.allclose(near, want_focal, rtol=1e-5)
    assert recover_focal_shift(torch.ones(1, 8, 8, 3), torch.zeros(1, 8, 8, dtype=torch.bool)) == (
        torch.tensor([1.0]), torch.tensor([0.0]))  # fewer than two valid samples: MoGe's (1, 0)


def _resized_to_size(self, tokens, height, width):
    """The near miss: the position embedding resized to the target size (transformers' DINOv2), no 0.1 offset."""
    embed = self.pos_embed.float()
    grid = int(math.sqrt(embed.shape[1] - 1))
    patches = embed[:, 1:].reshape(1, grid, grid, -1).permute(0, 3, 1, 2)
    patches = F.interpolate(patches, size=(height // 14, width // 14), mode="bicubic", align_corners=False)
    patches = patches.permute(0, 2, 3, 1).flatten(1, 2)
    return torch.cat((embed[:, :1], patches), dim=1).to(tokens.dtype)


def test_control_the_fixture_comparison_catches_transformers_position_embedding(tiny_moge, monkeypatch):
    from pixal3d.models import moge

    meta, tensors = _fixture()
    monkeypatch.setattr(moge.DinoV2, "position_embedding", _resized_to_size)
    ours = _outputs(tiny_moge, tensors["square.image"], fp16=False)
    stored = {name.split(".", 2)[2]: t for name, t in tensors.items() if name.startswith("square.fp32.")}
    assert {"raw_points", "points", "depth"} <= set(_compare(ours, stored, exact=False))
    assert {"raw_points", "points", "depth", "intrinsics"} <= set(_compare(ours, stored, exact=True))


def test_transformers_dinov2_does_not_resize_position_embeddings_as_moges_copy_does(tiny_moge):
    """Why the ViT is ours: transformers' Dinov2Embeddings resize the stored grid to the target size, DINOv2 (and
    MoGe's copy of it) by the offset scale factor; on the same weights the embeddings differ."""
    from transformers import Dinov2Config, Dinov2Model

    vit = tiny_moge.encoder.backbone
    config = Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=14, image_size=518)
    hf = Dinov2Model(config).eval()
    with torch.no_grad():
        hf.embeddings.position_embeddings.copy_(vit.pos_embed)
        tokens = torch.zeros(1, 1 + 12 * 12, 32)
        theirs = hf.embeddings.interpolate_pos_encoding(tokens, 168, 168)
        ours = vit.position_embedding(tokens, 168, 168)
    assert theirs.shape == ours.shape and not torch.allclose(theirs, ours, atol=1e-3)


# -- parity with the MoGe source, where it is importable ---------------------------------------------

def _moge_source():
    try:
        import moge.model.v2  # noqa: F401
        import moge.utils.geometry_torch  # noqa: F401
    except ImportError as err:
        pytest.skip(f"the MoGe source is not importable ({err}); it is not on the package index: "
                    f'pip install "git+https://github.com/microsoft/MoGe.git" to run the live parity test')


def _small_vits_config() -> dict:
    config = copy.deepcopy(MOGE_CONFIG)
    config["encoder"] = {"backbone": "dinov2_vits14", "intermediate_layers": 4, "dim_out": 32}
    config["scale_head"] = {"dims": [384, 32, 1]}
    config["normal_head"] = copy.deepcopy(config["points_head"])  # the '-normal' checkpoints' extra head
    return config


@pytest.mark.parametrize("which", ["tiny", "vits14"])
def test_live_parity_with_the_moge_source_bit_for_bit(tiny_file, which):
    _moge_source()
    from moge.utils.geometry_torch import recover_focal_shift as moge_recover_focal_shift

    torch.manual_seed(0)
    if which == "tiny":  # the demo weights, with the UV-carrying last level (a meaningful focal)
        config = MOGE_CONFIG
        reference = moge_reference_model(config)
        reference.load_state_dict(torch.load(tiny_file, weights_only=True)["model"], strict=True)
    else:  # MoGe's own random init; a normal head; intermediate_layers as a count
        config = _small_vits_config()
        reference = moge_reference_model(config)
    ours = build_moge(config)
    ours.load_state_dict(reference.state_dict(), strict=True, assign=True)
    ours.eval()
    for image in fixture_images().values():
        for fp16 in (True, False):
            theirs, mine = reference.infer(image, use_fp16=fp16), ours.infer(image, use_fp16=fp16)
            for name in ("points", "depth", "mask", "intrinsics", "normal"):
                if name in theirs or getattr(mine, name) is not None:
                    assert torch.equal(theirs[name], getattr(mine, name)), (which, fp16, name)
            width = image.shape[-1]
            assert horizontal_fov(theirs["intrinsics"], width) == horizontal_fov(mine.intrinsics, width)
    points = torch.randn(2, 40, 56, 3) + torch.tensor([0.0, 0.0, 4.0])
    mask = torch.rand(2, 40, 56) > 0.3
    assert all(torch.equal(a, b) for a, b in zip(moge_recover_focal_shift(points, mask),
                                                  recover_focal_shift(points, mask)))
