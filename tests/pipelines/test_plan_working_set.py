"""Working-set estimates, declared by each stage from its config section (pipelines/working_set.py, on the
constants measured at the reference's counts in benchmarks/full_work.md), and each stage fitted to the memory
the plan gives it: NAF's mode, the decode's tiles, the flow stages' chunks (pipelines/stage.py StageBudget)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipelines import working_set as ws
from pipelines.build import build_stages
from pipelines.stage import StageBudget
from pixal3d import memory_budget as mb
from pixal3d.config import load_config
from pixal3d.models.conditioning import naf_peak_bytes

REFERENCE = "configs/1024_cascade.yaml"
GiB = 2**30
DECODER_WEIGHTS = int(1.77 * GiB)  # shape + texture decoders (benchmarks/full_work.md)
FLOW_WEIGHTS = int(3.75 * GiB)     # a 1.3B flow + DINOv3 + NAF


def estimates(config) -> dict[str, int]:
    return {s.name: s.working_set() for s in build_stages(config)}


def stage(name: str, config=None):
    return next(s for s in build_stages(config or load_config(REFERENCE)) if s.name == name)


def test_reference_counts_match_the_measured_figures():
    """At ~3.9k LR, 20k HR tokens and ~9M decoded voxels, the estimates are the full-work measurements."""
    est = estimates(load_config(REFERENCE))
    assert est["shape_1024"] == 20_000 * mb.FLOW_BYTES_PER_TOKEN + mb.FLOW_FIXED_BYTES  # frugal-NAF line, auto
    # benchmarks/full_work.md (measured working sets): shape_1024 1.53 GiB, upsample 1.23, decode 8.61 + outputs;
    # the export with two forked slab workers: its process group 2.65 GiB at 9M voxels, 2.37 above the bench's
    # interpreter (benchmarks/export_speed.md)
    assert est["shape_1024"] / GiB == pytest.approx(1.53, abs=0.01)
    assert est["upsample"] / GiB == pytest.approx(1.23, rel=0.05)
    assert est["decode"] / GiB == pytest.approx(9.94, abs=0.02)
    assert est["export"] / GiB == pytest.approx(2.44, abs=0.01) and est["export"] > 2.37 * GiB
    # the slabs one at a time (what the plan picks where the forked workers do not fit): the 9M-voxel export's group
    # peaked at 2.29 GiB in a cgroup, 2.01 above the bench's interpreter (benchmarks/export_speed.md)
    serial = stage("export").fitted(StageBudget(0, 0)).working_set()
    assert serial / GiB == pytest.approx(2.02, abs=0.01) and serial > 2.01 * GiB
    assert est["structure"] / GiB == pytest.approx(0.56, abs=0.01)
    assert est["preprocess"] == 0
    assert est["camera"] == mb.CAMERA_FLOAT16_BYTES  # moge_precision auto: the device decides, the larger counted


def test_moges_working_sets_are_never_under_the_camera_benchmark_and_at_most_a_tenth_over():
    """benchmarks/camera.json's measured working sets (518 and 1126 px, each precision) against the constants the
    plan counts for the camera stage."""
    results = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "camera.json").read_text())["results"]
    for fp16, planned in ((True, mb.CAMERA_FLOAT16_BYTES), (False, mb.CAMERA_FLOAT32_BYTES)):
        measured = max(r["working_set"] for r in results if r["fp16"] is fp16)
        assert measured <= planned <= 1.1 * measured, (fp16, measured, planned)
    assert {r["side"] for r in results} >= {518, 1126}  # the largest preprocessed crop: int(1.1 * 1024)
    for precision, planned in (("float32", mb.CAMERA_FLOAT32_BYTES), ("float16", mb.CAMERA_FLOAT16_BYTES),
                               ("auto", mb.CAMERA_FLOAT16_BYTES)):
        config = load_config(REFERENCE)
        config = config.with_overrides(camera=dataclasses.replace(config.camera, moge_precision=precision))
        assert stage("camera", config).working_set() == planned, precision


def test_estimate_grows_with_the_token_counts():
    config = load_config(REFERENCE)
    bigger = dataclasses.replace(config, upsample=dataclasses.replace(config.upsample, hr_resolution=1536),
                                 structure=dataclasses.replace(config.structure, coords_resolution=48))
    small, large = estimates(config), estimates(bigger)
    for name in ("shape_512", "upsample", "shape_1024", "texture", "decode", "export"):
        assert large[name] > small[name], name
    assert large["structure"] == small["structure"]  # dense 16³ tokens either way


def test_every_stage_of_every_shipped_config_declares_an_estimate():
    for name in ("1024_cascade", "1536_cascade", "tiny"):
        assert all(isinstance(v, int) and v >= 0 for v in estimates(load_config(f"configs/{name}.yaml")).values())


def test_naf_auto_is_the_reference_exact_full_mode_when_it_fits_and_frugal_when_not():
    texture = stage("texture")  # NAF at 1024 px: the full mode needs ~1.7 GiB
    assert texture.naf_mode == "auto"
    roomy = texture.fitted(StageBudget(16 * GiB, FLOW_WEIGHTS))
    tight = texture.fitted(StageBudget(FLOW_WEIGHTS + mb.PROCESS_BYTES + GiB, FLOW_WEIGHTS))  # 1 GiB of work
    assert roomy.naf_mode == "full" and tight.naf_mode == "frugal"
    assert texture.naf_mode == "auto" and roomy is not texture  # fitting makes a copy
    assert roomy.choices() == {"naf_mode": "full"}
    forced = dataclasses.replace(texture.config, condition=dataclasses.replace(texture.config.condition,
                                                                                naf_mode="full"))
    assert type(texture)(forced, 4, 1024).fitted(StageBudget(FLOW_WEIGHTS + mb.PROCESS_BYTES + GiB,
                                                             FLOW_WEIGHTS)).naf_mode == "full"  # asked


# NAF alone, full (TiledEncoder), at real width: benchmarks/full_work.md "NAF full, tiled"
# (python scripts/bench_naf_modes.py --modes whole full --image-size S --naf-size T --points P)
NAF_FULL_MEASURED = {(512, 512, 4000): 0.51, (1024, 512, 20_000): 1.53, (1024, 1024, 20_000): 1.53}
STREAMED_FLOW_WEIGHTS = int(0.20 * GiB)  # NAF and a streamed flow's resident parts and two blocks (the 4G plan)


def test_naf_full_estimate_covers_its_measurement_and_keeps_full_at_4g_and_2_5g():
    """The tiled encoder's peak is never under the estimate's measurement and within a tenth of it; with the flows
    streamed, --memory-budget 4G and 2.5G keep full (the reference's bits) for all three NAF stages, each within
    the budget, as 8.5G did when the encoder held the whole map (3.8 GiB); 1 GiB of work is too little."""
    for (image_size, naf_size, points), measured in NAF_FULL_MEASURED.items():
        estimate = naf_peak_bytes("full", image_size, naf_size, points=points) / GiB
        assert measured <= estimate <= measured * 1.1, (image_size, naf_size)
    for budget in (4 * GiB, int(2.5 * GiB)):
        for name in ("shape_512", "shape_1024", "texture"):
            fitted = stage(name).fitted(StageBudget(budget, STREAMED_FLOW_WEIGHTS, explicit=True))
            assert fitted.naf_mode == "full", (name, budget)
            assert STREAMED_FLOW_WEIGHTS + mb.PROCESS_BYTES + fitted.working_set() <= budget, (name, budget)
    tight = StageBudget(STREAMED_FLOW_WEIGHTS + mb.PROCESS_BYTES + GiB, STREAMED_FLOW_WEIGHTS)  # 1 GiB of work
    assert stage("shape_1024").fitted(tight).naf_mode == "frugal"  # the control: where full does not fit


def test_the_decode_tiles_under_a_budget_smaller_tiles_under_a_smaller_one_and_refuses_an_impossible_one():
    decode = stage("decode")
    assert decode.fitted(StageBudget(16 * GiB, DECODER_WEIGHTS, explicit=True)).tile_plan is None  # fits whole
    assert decode.fitted(StageBudget(8 * GiB, DECODER_WEIGHTS)).tile_plan is None  # no explicit budget: untiled
    eight = decode.fitted(StageBudget(8 * GiB, DECODER_WEIGHTS, explicit=True))
    six = decode.fitted(StageBudget(6 * GiB, DECODER_WEIGHTS, explicit=True))
    assert eight.tile_plan is not None and six.tile_plan is not None
    assert (six.tile_plan.start_level, six.tile_plan.tile_voxels) < (eight.tile_plan.start_level,
                                                                     eight.tile_plan.tile_voxels)
    assert mb.PROCESS_BYTES + DECODER_WEIGHTS + eight.working_set() == 8 * GiB  # bounded to the budget
    with pytest.raises(mb.MemoryBudgetError, match=r"stage 'decode' needs at least .* but the memory budget is "
                                                   r"2\.00 GiB; raise memory_budget"):
        decode.fitted(StageBudget(2 * GiB, DECODER_WEIGHTS, explicit=True))


def test_the_camera_stage_counts_the_precision_its_device_runs():
    """Issue 44 item 12: the plan counted MoGe-2's float16 working set (2.14 GiB) on a CPU that runs it in
    float32 (1.44 GiB measured). Fitted to its device, ``auto`` counts what runs there: float32 on the CPU, float16
    autocast on CUDA and MPS; an explicit precision is counted as given."""
    config = load_config(REFERENCE)
    for device, precision, planned in (("cpu", "auto", mb.CAMERA_FLOAT32_BYTES),
                                       ("cuda:0", "auto", mb.CAMERA_FLOAT16_BYTES),
                                       ("mps", "auto", mb.CAMERA_FLOAT16_BYTES),
                                       ("cpu", "float16", mb.CAMERA_FLOAT16_BYTES),
                                       ("cuda:0", "float32", mb.CAMERA_FLOAT32_BYTES)):
        chosen = config.with_overrides(camera=dataclasses.replace(config.camera, moge_precision=precision))
        fitted = stage("camera", chosen).fitted(StageBudget(8 << 30, mb.CAMERA_MEASURED_WEIGHT_BYTES,
                                                             device=device))
        assert fitted.working_set() == planned, (device, precision)
