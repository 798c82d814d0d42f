"""Issue 38: the web app's and the job server's results follow the commit-point rule of the command's
(``tests/pipelines/test_kill_safety.py``): they are written by the one writer (``pipelines.session.Session.write``), the GLB
renamed last, so a SIGKILL between any two renames never leaves a GLB without its complete run.json.

Each front end's own write path runs in a child process on a stub result (``tests.support.stub_result``) and is killed
with SIGKILL just before its n-th rename into the job's folder. Control: the same kill on the order the app and
the server wrote in before (the GLB, then run.json) leaves a GLB without its record, which the check finds."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.cascade_fixtures import EXAMPLE, REPO, TINY_CONFIG, tiny_cache  # noqa: F401

KILL_AT = """
    import os, signal, sys
    from pathlib import Path
    from tests.support.stub_result import patch_run
    patch_run(glb=b"glTF killed run")
    real, count, folder = os.replace, [0], Path(sys.argv[2]).resolve()
    def replace(src, dst, *args, **kwargs):
        if folder in Path(dst).resolve().parents:
            count[0] += 1
            if count[0] == int(sys.argv[1]):
                os.kill(os.getpid(), signal.SIGKILL)
        return real(src, dst, *args, **kwargs)
    def arm():  # from here on, the n-th rename into the folder is never done
        os.replace = replace
"""

APP = KILL_AT + """
    from pipelines.app.job import run_job
    from pipelines.job import Job
    from pipelines.session import Session
    from pixal3d.config import load_config
    job = Job.from_form({"seed": 3}, load_config(sys.argv[3]))
    arm()
    updates = list(run_job(Session("app", device="cpu"), sys.argv[4], job, outputs=folder, poll=0.05))
    print(updates[-1].error or "done")
"""

SERVE = KILL_AT + """
    from pipelines.job import Job, plan_key
    from pipelines.serve.db import open_queue
    from pipelines.serve.store import DataFolder, new_id
    from pipelines.serve.worker import Where, run_group
    from pipelines.session import Session
    from pixal3d.config import load_config
    config, data = load_config(sys.argv[3]), DataFolder(folder)
    queue, job_id = open_queue(None, data.root), new_id()
    settings = Job.from_request({"seed": 3}, config).settings()
    name = data.write_input(job_id, Path(sys.argv[4]).read_bytes(), ".png")
    queue.submit(job_id, settings, plan_key(settings), name, queue_size=None)
    [claim] = queue.claim("test", 0, "cpu", group_size=1, lease=600)
    job = {"id": claim.id, "input": claim.input, "settings": claim.settings, "attempt": claim.attempt}
    arm()
    run_group(Session("serve", device="cpu"), config, Where(data, queue, "test"), [job], timeout=None, cancelled={},
              send=print)
"""

GLB_FIRST = KILL_AT + """
    from pipelines import Pixal3D
    from pixal3d.files import write_json_atomic
    # the order the app and the server wrote in before issue 38: the GLB, then its run.json
    with Pixal3D.from_config(sys.argv[3], device="cpu") as pipe:
        [item] = pipe.run_batch([sys.argv[4]], names=["example"])
    glb = folder / "example.glb"
    arm()
    item.result.save(glb)
    write_json_atomic(folder / "example.run.json", item.result.record(output=glb))
"""


def _kill(script: str, rename: int, folder: Path, cache: Path) -> subprocess.CompletedProcess:
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), str(rename), str(folder), str(TINY_CONFIG),
                           str(EXAMPLE)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), "PIXAL3D_CACHE": str(cache)})


def _glbs_without_their_record(folder: Path) -> list[str]:
    """Every visible GLB under ``folder`` whose run.json is missing or names other bytes."""
    lonely = []
    for glb in folder.rglob("*.glb"):
        record = glb.with_name("run.json") if glb.name == "result.glb" else glb.with_name(f"{glb.stem}.run.json")
        if not record.exists() or json.loads(record.read_text())["export"].get("glb_sha256") != \
                hashlib.sha256(glb.read_bytes()).hexdigest():
            lonely.append(str(glb.relative_to(folder)))
    return lonely


@pytest.mark.parametrize("front_end", ["app", "serve"])
def test_a_sigkill_before_any_rename_never_leaves_a_glb_without_its_record(front_end, tiny_cache, tmp_path):
    script = APP if front_end == "app" else SERVE
    finished = _kill(script, 0, tmp_path / "whole", tiny_cache)  # never killed: how many renames, what is written
    assert finished.returncode == 0, finished.stderr
    written = sorted(p.name for p in (tmp_path / "whole").rglob("*") if p.suffix in (".glb", ".json"))
    assert ("result.glb" in written and "run.json" in written) if front_end == "serve" else \
        written == ["example.glb", "example.run.json"], written
    for rename in (1, 2, 3):  # each writes two files (the server's end is then a row of its queue, not a file)
        folder = tmp_path / f"kill{rename}"
        proc = _kill(script, rename, folder, tiny_cache)
        if rename == 3:
            assert proc.returncode == 0, proc.stderr  # nothing is renamed after the GLB
            continue
        assert proc.returncode == -signal.SIGKILL, (rename, proc.stdout, proc.stderr)
        assert _glbs_without_their_record(folder) == [], rename
        glbs = list(folder.rglob("*.glb"))
        assert glbs == [] if rename <= 2 else len(glbs) == 1, (rename, glbs)  # the GLB is the last of its group


def test_control_the_old_order_killed_between_its_renames_leaves_a_glb_without_its_record(tiny_cache, tmp_path):
    proc = _kill(GLB_FIRST, 2, tmp_path / "old", tiny_cache)  # killed before run.json's rename
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert _glbs_without_their_record(tmp_path / "old") == ["example.glb"]
