"""A batch with a work directory survives anything: killed (SIGKILL) as every stage starts, mid-sampler and
between a stage's two record files, interrupted (SIGINT) halfway through writing a GLB, terminated (SIGTERM)
mid-stage. Each run continues where the last one stopped, recomputes no recorded stage, and the final GLBs
carry the fingerprints of uninterrupted one-by-one runs. One harness process (tests/support/interrupt_harness.py)
forks a child per step, so the whole chain pays for its imports once."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.batch_fixtures import batch_images, fast_config, singles  # noqa: F401
from tests.support.cascade_fixtures import REPO, tiny_cache  # noqa: F401

STAGES = ("preprocess", "camera", "features", "structure", "shape_512", "upsample", "shape_1024", "texture", "decode", "export")


def _kill(event: str, stage: str, image: str = "a") -> dict:
    return {"run": "library", "at": {"event": event, "stage": stage, "image": image}, "signal": "SIGKILL"}


@pytest.fixture(scope="module")
def chain(fast_config, batch_images, tmp_path_factory, tiny_cache):
    root = tmp_path_factory.mktemp("chain")
    work, out = root / "work", root / "out"
    images = [str(p) for p in batch_images[:2]]
    argv = [*images, "--config", str(fast_config), "-o", str(out), "--memory-policy", "staged", "--work-dir",
            str(work), "--quiet"]
    steps = [
        _kill("stage", "camera"),                    # 0: boundary preprocess | camera
        _kill("stage", "structure"),                 # 1
        _kill("step", "structure", "b"),             # 2: mid-stage: a's structure recorded, b's sampler running
        _kill("stage", "shape_512"),                 # 3
        _kill("record", "shape_512", "b"),           # 4: b's shape_512 safetensors written, its record not
        _kill("stage", "upsample"),                  # 5
        _kill("stage", "shape_1024"),                # 6
        _kill("stage", "texture"),                   # 7
        {"run": "cli", "argv": argv, "at": {"event": "step", "stage": "texture", "image": "b"},
         "signal": "SIGTERM"},                       # 8: the command, terminated mid-stage
        _kill("stage", "decode"),                    # 9
        _kill("stage", "export"),                    # 10
        {"run": "cli", "argv": argv, "at": {"event": "glb", "image": "a"}, "signal": "SIGINT"},  # 11: Ctrl-C mid-GLB
        {"run": "cli", "argv": argv},                # 12: to the end
    ]
    plan = root / "plan.json"
    plan.write_text(json.dumps({"config": str(fast_config), "images": images, "work_dir": str(work),
                                "out": str(out), "steps": steps}))
    report = root / "report.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "tests.support.interrupt_harness", str(plan), str(report)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"steps": json.loads(report.read_text()), "out": out, "work": work}


def _pairs(entries) -> set[tuple[str, str]]:
    return {tuple(e) for e in entries}


def test_a_batch_killed_at_every_stage_boundary_and_mid_stage_resumes_to_the_uninterrupted_fingerprints(
        chain, singles):
    steps = chain["steps"]
    assert [s["status"] for s in steps] == [-9] * 8 + [143, -9, -9, 130, 0], [s["stderr"][-500:] for s in steps]
    for step in steps:
        # what the runs before it had recorded, a run never starts again
        assert not _pairs(step["started"]) & _pairs(step["records_before"]), step["step"]
    # each stage-start kill left both images recorded up to the stage before it, and nothing of that stage
    for index, step in enumerate(steps[:-1]):
        at = step["step"].get("at", {})
        if step["step"]["run"] == "library" and at["event"] == "stage":
            done = _pairs(steps[index + 1]["records_before"])
            previous = STAGES[STAGES.index(at["stage"]) - 1]
            assert {("a", previous), ("b", previous)} <= done and ("a", at["stage"]) not in done
    # mid-stage: a's structure survived, b's did not; between b's two shape_512 files: b's stage is rerun
    assert ("a", "structure") in _pairs(steps[3]["records_before"])
    assert ["b", "structure"] in steps[3]["started"]
    assert ("b", "shape_512") not in _pairs(steps[5]["records_before"]) and ["b", "shape_512"] in steps[5]["started"]
    assert _pairs(steps[-1]["records_after"]) == {(i, s) for i in "ab" for s in STAGES}
    for name in "ab":
        record = json.loads((chain["out"] / f"{name}.run.json").read_text())
        prints = {s["stage"]: s["fingerprints"] for s in record["stages"] if s["fingerprints"]}
        assert prints == singles["prints"][name]
    summary = json.loads((chain["out"] / "batch.json").read_text())
    assert summary["written"] == 2 and [len(i["resumed"]) for i in summary["images"]] == [
        len(STAGES), len(STAGES) - 1]


def test_sigint_and_sigterm_exit_130_and_143_leaving_no_partial_file_and_a_resumable_work_dir(chain):
    steps = chain["steps"]
    terminated, interrupted = steps[8], steps[11]
    assert terminated["status"] == 143 and interrupted["status"] == 130
    for step in (terminated, interrupted):
        assert step["temporary_files"] == []  # no half-written record, GLB or temporary file anywhere
        line, = [ln for ln in step["stderr"].splitlines() if ln.startswith("pixal3d-image-to-mesh:")]
        assert "resume from" in line and str(chain["work"]) in line
    assert "stopped by SIGTERM" in terminated["stderr"] and "SIGINT" in interrupted["stderr"]
    # SIGINT came halfway through a's GLB, after a's export was recorded: no GLB at all afterwards, and the next
    # run wrote both without exporting a again
    assert interrupted["outputs"] == [] and terminated["outputs"] == []
    assert ("a", "export") in _pairs(interrupted["records_after"])
    assert ["a", "export"] not in steps[12]["started"]
    assert sorted(p.name for p in chain["out"].glob("*.glb")) == ["a.glb", "b.glb"]
