"""Issue 30, item 11: run.json says what happened. Its ``command`` is the command as typed (a run of
``scripts/image_to_mesh.py`` is recorded as that, not as ``pixal3d-image-to-mesh``), and on a resume the stages
taken from the work directory are marked ``reused`` in run.json and in the per-stage table, whose total counts
only this run's seconds (it used to repeat the old seconds as if they were spent now)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from pipelines import Pixal3D
from tests.support.batch_fixtures import batch_images, fast_config, singles  # noqa: F401
from tests.support.cascade_fixtures import EXAMPLE, REPO, TINY_CONFIG, tiny_cache  # noqa: F401


def test_run_json_records_the_script_command_as_typed(tiny_cache, tmp_path):
    out = tmp_path / "o.glb"
    argv = ["scripts/image_to_mesh.py", str(EXAMPLE), "--config", str(TINY_CONFIG), "-o", str(out), "--quiet"]
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO), "PIXAL3D_CACHE": str(tiny_cache)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.with_name("o.run.json").read_text())["command"] == ["python", *argv]


def test_resumed_stages_are_marked_reused_and_cost_this_run_nothing(fast_config, batch_images, singles, tmp_path):
    work = tmp_path / "work"
    with Pixal3D.from_config(fast_config, policy="staged", device="cpu") as pipe:
        first = list(pipe.run_batch(batch_images[:1], work_dir=work))[0].result
        again = list(pipe.run_batch(batch_images[:1], work_dir=work))[0].result
    assert not any(r.reused for r in first.stages) and all(r.reused for r in again.stages)
    record = again.record()
    assert [s["reused"] for s in record["stages"]] == [True] * len(again.stages)
    assert record["total_seconds"] == 0 and first.seconds > 0
    rows = {row[0]: row for row in again.stage_rows()}
    structure = next(r for r in first.stages if r.stage == "structure")
    assert rows["structure"][1] == f"reused ({structure.seconds:.2f} then)"
    assert rows["total"][1] == "0.00"
    assert again.fingerprints() == first.fingerprints() == singles["prints"]["a"]
