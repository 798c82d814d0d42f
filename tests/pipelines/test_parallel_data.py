"""``--parallel data`` (issue 28): every rank of a torchrun job runs whole images of one batch; ranks joined by
env:// on loopback (gloo carries only the job's small messages), the tiny config, one thread per rank.

Fingerprints are compared with single-process runs of the same images at the same thread count (one), so
"equal" is bitwise; the images differ from each other (mirrored, flipped, rotated), so a mix-up shows.
"""
from __future__ import annotations

import collections
import json

import pytest
from PIL import Image, ImageOps

from pipelines.data_parallel import CLAIM
from tests.support.cascade_fixtures import (  # noqa: F401
    EXAMPLE,
    TINY_CONFIG,
    one_thread_fingerprints,
    tiny,
    tiny_cache,
)
from tests.support.parallel_cascade_harness import data_worker
from tests.support.parallel_harness import spawn

VARIANTS = {"a": lambda im: im, "b": ImageOps.mirror, "c": ImageOps.flip,
            "d": lambda im: im.rotate(90), "e": lambda im: im.rotate(270)}
STAGES = ["preprocess", "camera", "features", "structure", "shape_512", "upsample", "shape_1024", "texture", "decode", "export"]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data-in")
    source = Image.open(EXAMPLE)
    for name, variant in VARIANTS.items():
        variant(source).save(folder / f"{name}.png")
    return folder


@pytest.fixture(scope="module")
def single(tiny, images):
    """Each image's per-stage fingerprints from one process, one thread (the command's policy: auto)."""
    return one_thread_fingerprints(tiny, {name: images / f"{name}.png" for name in VARIANTS})


def _argv(inputs, out, work=None, timeout=60):
    return [inputs, "--config", TINY_CONFIG, "-o", out, "--quiet", "--parallel", "data",
            "--parallel-timeout", str(timeout), *(["--work-dir", work] if work else [])]


def _fingerprints(out, name):
    record = json.loads((out / f"{name}.run.json").read_text())
    return {s["stage"]: s["fingerprints"] for s in record["stages"] if s["fingerprints"]}


def _stage_log(folder):
    return [tuple(line.split()) for line in (folder / "stages.log").read_text().splitlines()]


def test_two_ranks_share_five_images_each_run_once_with_the_single_process_bits(tiny_cache, images, single, tmp_path):
    """2 ranks, 5 images, a shared work dir: 5 GLBs whose fingerprints equal single runs; each image's stages
    all ran on one rank, which batch.json and the image's claim name; each rank loaded each model once; one
    summary (rank 0's) and exit 0 on both. Control: the single runs of two images differ."""
    out, work = tmp_path / "out", tmp_path / "work"
    run = spawn(2, data_worker, str(tiny_cache), _argv(images, out, work), str(tmp_path), 1, folder=tmp_path,
                timeout_s=120)
    assert run.exitcodes == [0, 0], run.errors
    assert sorted(p.name for p in out.glob("*.glb")) == [f"{n}.glb" for n in VARIANTS]
    for name in VARIANTS:
        assert _fingerprints(out, name) == single[name], name
    assert single["a"]["structure"] != single["b"]["structure"]
    log = _stage_log(tmp_path)
    by_image = collections.defaultdict(list)
    for rank, image, stage in log:
        by_image[image].append((rank, stage))
    batch = json.loads((out / "batch.json").read_text())
    assert batch["summary"] == "5 written, 0 failed"
    ranks = {row["name"]: str(row["rank"]) for row in batch["images"]}
    for name in VARIANTS:
        assert [stage for _, stage in by_image[name]] == STAGES, name  # every stage once
        assert {rank for rank, _ in by_image[name]} == {ranks[name]}, name  # all on one rank
        claim = json.loads((work / name / CLAIM).read_text())
        assert (claim["status"], str(claim["rank"])) == ("done", ranks[name])
    assert set(ranks.values()) == {"0", "1"}  # both ranks took images
    for rank in ("0", "1"):
        loads = (tmp_path / f"loads.rank{rank}").read_text().split()
        assert len(loads) == len(set(loads)) > 0, loads  # each model once on this rank
    assert (tmp_path / "rank1.stderr").read_text() == ""


def test_a_rank_killed_mid_batch_is_named_and_the_same_command_again_finishes_every_image_once(
        tiny_cache, images, single, tmp_path):
    """Rank 1 dies (SIGKILL) right after recording the third stage of its first image: rank 0 runs the other
    images, takes the dead rank's image over from its records (its lock is gone), names rank 1 after the
    timeout and exits 1. The same command again: 5 GLBs with the single-process fingerprints, and over both
    runs every stage of every image was computed exactly once."""
    out, work = tmp_path / "out", tmp_path / "work"
    argv = _argv(images, out, work, timeout=8)
    first = spawn(2, data_worker, str(tiny_cache), argv, str(tmp_path / "run1"), 1, (1, 3),
                  folder=tmp_path / "run1", timeout_s=120)
    assert first.exitcodes[1] == -9 and first.exitcodes[0] == 1, first.errors
    stderr = (tmp_path / "run1" / "rank0.stderr").read_text()
    assert "rank 1 of the --parallel data job sent no report" in stderr and "run the same command again" in stderr
    killed = [(rank, image, stage) for rank, image, stage in _stage_log(tmp_path / "run1") if rank == "1"]
    assert len(killed) == 3  # its first image's first three stages
    taken = killed[0][1]
    second = spawn(2, data_worker, str(tiny_cache), argv, str(tmp_path / "run2"), 1,
                   folder=tmp_path / "run2", timeout_s=120)
    assert second.exitcodes == [0, 0], second.errors
    for name in VARIANTS:
        assert _fingerprints(out, name) == single[name], name
    computed = _stage_log(tmp_path / "run1") + (_stage_log(tmp_path / "run2") if (tmp_path / "run2" /
                                                                                    "stages.log").exists() else [])
    counts = collections.Counter((image, stage) for _, image, stage in computed)
    assert counts == collections.Counter({(name, stage): 1 for name in VARIANTS for stage in STAGES})
    assert {rank for rank, image, stage in computed if image == taken and stage not in STAGES[:3]} == {"0"}


def test_a_bad_image_is_skipped_by_its_group_with_one_summary_and_exit_1(tiny_cache, images, tmp_path):
    """No work dir: the static split (image i to rank i mod 2). The fully transparent image (index 1, rank 1's)
    fails in preprocessing: rank 1 prints its skip line, rank 0 the one summary and batch.json naming it, both
    exit 1; the other two images are written."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    for name in ("a", "c"):
        (inputs / f"{name}.png").write_bytes((images / f"{name}.png").read_bytes())
    Image.new("RGBA", (64, 64), (255, 255, 255, 0)).save(inputs / "b_empty.png")
    out = tmp_path / "out"
    run = spawn(2, data_worker, str(tiny_cache), _argv(inputs, out), str(tmp_path), 1, folder=tmp_path,
                timeout_s=120)
    assert [(tmp_path / f"rank{r}.code").read_text() for r in (0, 1)] == ["1", "1"], run.errors
    rank1 = (tmp_path / "rank1.stderr").read_text().strip().splitlines()
    assert len(rank1) == 1 and rank1[0].startswith("pixal3d-image-to-mesh: skipped b_empty.png: no object found")
    rank0 = (tmp_path / "rank0.stderr").read_text().strip().splitlines()
    assert rank0 == [l for l in rank0 if l.startswith("2 written, 1 failed: b_empty.png: no object found")] != []
    batch = json.loads((out / "batch.json").read_text())
    assert [(i["name"], i["status"], i["rank"]) for i in batch["images"]] == [
        ("a", "written", 0), ("b_empty", "failed", 1), ("c", "written", 0)]
    assert sorted(p.name for p in out.glob("*.glb")) == ["a.glb", "c.glb"]
