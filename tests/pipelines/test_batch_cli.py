"""The command on several inputs: a bad file is reported in one line and skipped, the others are written, a
summary line and batch.json end the batch and the exit code says whether anything failed; what can be refused
before the run still is, before any weight is read."""
from __future__ import annotations

import json
import shutil

import pytest

from pipelines import cli, loaders
from pipelines.work_dir import LOCK, WorkDir
from pixal3d.locks import exclusive_lock
from tests.support.batch_fixtures import batch_images, fast_config, singles  # noqa: F401
from tests.support.cascade_fixtures import EXAMPLE, TINY_CONFIG, tiny_cache  # noqa: F401


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def no_weights(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("no weight may be read")
    monkeypatch.setattr(loaders, "load_model", forbidden)
    monkeypatch.setattr("pixal3d.models.dinov3.load_dinov3", forbidden)


def test_a_batch_with_one_bad_file_writes_the_others_exits_1_with_the_summary_and_batch_json(
        fast_config, batch_images, singles, tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(batch_images[1], folder / batch_images[1].name)
    (folder / "photo7.png").write_bytes(b"\x89PNG\r\n\x1a\n half a photo")
    out = tmp_path / "out"
    code, _, err = _run(capsys, folder, "--config", fast_config, "-o", out, "--memory-policy", "staged",
                             "--quiet")
    assert code == 1
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("pixal3d-image-to-mesh: skipped photo7.png: ") and "not an image" in lines[0]
    assert lines[-1] == "1 written, 1 failed: photo7.png: not an image Pillow can read"
    assert sorted(p.name for p in out.iterdir()) == ["b.glb", "b.run.json", "batch.json"]
    batch = json.loads((out / "batch.json").read_text())
    assert batch["order"] == "stage" and (batch["written"], batch["failed"]) == (1, 1)
    assert [(i["name"], i["status"]) for i in batch["images"]] == [("b", "written"), ("photo7", "failed")]
    assert batch["images"][0]["output"] == str(out / "b.glb") and batch["summary"] == lines[-1]
    assert "not an image" in batch["images"][1]["error"]
    record = json.loads((out / "b.run.json").read_text())
    assert {s["stage"]: s["fingerprints"] for s in record["stages"] if s["fingerprints"]} == singles["prints"]["b"]


def test_a_single_bad_input_exits_2_before_any_weight_is_read(tiny_cache, tmp_path, capsys, no_weights):
    bad = tmp_path / "photo7.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n half a photo")
    code, _, err = _run(capsys, bad, "--config", TINY_CONFIG, "-o", tmp_path / "out" / "o.glb")
    assert code == 2 and "photo7.png is not an image" in err and len(err.strip().splitlines()) == 1


def test_a_batch_without_a_usable_image_exits_2_before_any_weight_is_read(tiny_cache, tmp_path, capsys, no_weights):
    for name in ("x.png", "y.jpg"):
        (tmp_path / name).write_bytes(b"not an image")
    code, _, err = _run(capsys, tmp_path / "x.png", tmp_path / "y.jpg", "--config", TINY_CONFIG, "-o",
                        tmp_path / "out")
    assert code == 2 and "none of the 2 inputs is a usable image" in err.splitlines()[-1]
    assert not (tmp_path / "out" / "batch.json").exists()


def test_a_work_dir_that_holds_other_files_is_refused_before_any_weight_is_read(tiny_cache, tmp_path, capsys,
                                                                                 no_weights):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "thesis.tex").write_text("precious")
    code, _, err = _run(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", tmp_path / "o.glb", "--work-dir",
                        tmp_path / "docs")
    assert code == 2 and "not a pixal3d work directory" in err
    assert sorted(p.name for p in (tmp_path / "docs").iterdir()) == ["thesis.tex"]


def test_a_work_dir_in_use_by_another_run_is_refused_before_any_weight_is_read(tiny_cache, tmp_path, capsys,
                                                                               no_weights):
    work = tmp_path / "work"
    WorkDir(work)
    with exclusive_lock(work / LOCK, wait=False):  # as a run using it holds it
        code, _, err = _run(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", tmp_path / "o.glb", "--work-dir", work)
    assert code == 2 and "another run" in err and str(work) in err
    assert not (tmp_path / "o.glb").exists()


def test_plan_for_a_batch_says_its_order_and_the_memory_its_states_may_hold(batch_images, fast_config, tmp_path,
                                                                            capsys, no_weights):
    """--plan on several inputs ends with the batch line (what the batch itself prints before running), without
    reading a weight; --batch-order image says so instead."""
    folder = tmp_path / "in"
    folder.mkdir()
    for image in batch_images[:2]:
        shutil.copy(image, folder / image.name)
    code, out, _ = _run(capsys, folder, "--config", fast_config, "--memory-policy", "staged", "--plan")
    assert code == 0
    last = out.strip().splitlines()[-1]
    assert last.startswith("batch: 2 images, stage by stage, image states kept in memory up to ") and \
        last.endswith("GiB between stages (more wait on disk)"), last
    code, out, _ = _run(capsys, folder, "--config", fast_config, "--memory-policy", "staged", "--plan",
                        "--batch-order", "image")
    assert code == 0 and out.strip().splitlines()[-1] == "batch: 2 images, image by image"
    code, out, _ = _run(capsys, batch_images[0], "--config", fast_config, "--plan")
    assert code == 0 and "batch:" not in out  # one image is not a batch


def test_a_memory_budget_bounds_the_memory_a_batch_keeps_states_in(fast_config, tiny_cache, tmp_path, capsys,
                                                                    monkeypatch):
    """What a batch may hold in image states between stages comes out of the budget too (it bounds the whole
    process): the budget less the interpreter less the largest stage. Control: a budget above the machine's
    memory changes nothing; a budget the largest stage fills sends every state to disk, and the line says so.
    The machine is read once, so the plans compare budgets, not two moments of a busy machine's memory."""
    from pipelines import Pixal3D, pipeline
    from pixal3d.memory_budget import PROCESS_BYTES

    machine = pipeline.detect_machine("cpu")
    monkeypatch.setattr(pipeline, "detect_machine", lambda device=None: machine)

    free = Pixal3D.plan(fast_config, policy="staged", device="cpu")
    two = Pixal3D.plan(fast_config, policy="staged", device="cpu", memory_budget="2G")
    assert two.state_budget() == 2 * 2**30 - PROCESS_BYTES - two.memory.staged_peak < free.state_budget()
    assert Pixal3D.plan(fast_config, policy="staged", device="cpu", memory_budget="4096G").state_budget() == \
        free.state_budget()
    tight = PROCESS_BYTES + two.memory.staged_peak
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("a.png", "b.png"):
        shutil.copy(EXAMPLE, folder / name)
    code, out, _ = _run(capsys, folder, "--config", fast_config, "--memory-policy", "staged", "--plan",
                        "--memory-budget", str(tight))
    assert code == 0 and out.strip().splitlines()[-1] == ("batch: 2 images, stage by stage, image states waiting on "
                                                          "disk between stages (the largest stage leaves no memory "
                                                          "for them)")
