"""An older server's data folder (files only, format ``pixal3d-serve/1``: ``jobs/<id>/job.json``, ``status.json`` once
ended, ``attempts.jsonl``) is moved into the queue's database at the first start of today's ``pixal3d-serve``: an
ended job keeps its status and error, a waiting one runs to the end, a folder of a job that was never acknowledged
(``.new-*``) is removed, an unreadable job is left on disk; a second start moves nothing again. Control: the
unreadable job, not moved, is 404 to the same request that finds the moved ones."""
from __future__ import annotations

import json
import time

import pytest

from tests.support.cascade_fixtures import EXAMPLE, TINY_CONFIG, tiny_cache  # noqa: F401
from tests.support.serve_harness import Server

pytest.importorskip("fastapi")

SETTINGS = {"seed": 3, "texture_size": 128, "face_budget": 2000, "memory_policy": "staged"}
FAILED, WAITING, BROKEN = "a" * 32, "b" * 32, "c" * 32


def _old_job(data, job_id: str, sequence: int, status: dict | None = None, attempts: tuple = ()) -> None:
    folder = data / "jobs" / job_id
    folder.mkdir(parents=True)
    (folder / "input.png").write_bytes(EXAMPLE.read_bytes())
    (folder / "job.json").write_text(json.dumps({"format": "pixal3d-serve/1", "sequence": sequence,
                                                 "submitted": time.time() - 100 + sequence,
                                                 "settings": SETTINGS, "input": "input.png"}))
    if status is not None:
        (folder / "status.json").write_text(json.dumps({"format": "pixal3d-serve/1", **status}))
    if attempts:
        (folder / "attempts.jsonl").write_text("".join(json.dumps(a) + "\n" for a in attempts))


def test_an_older_servers_jobs_are_moved_into_the_queue_at_the_first_start(tiny_cache, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "pixal3d-serve.json").write_text(json.dumps({"format": "pixal3d-serve/1"}))
    _old_job(data, FAILED, 1, {"status": "failed", "error": "the old server's one line", "finished": time.time()},
             attempts=({"time": time.time(), "event": "started"}, {"time": time.time(), "event": "ended"}))
    _old_job(data, WAITING, 2)
    _old_job(data, BROKEN, 3)
    (data / "jobs" / BROKEN / "job.json").write_text("{not json")
    (data / "jobs" / ".new-0123").mkdir()  # a submission killed before it was acknowledged

    server = Server.start(data, "--config", str(TINY_CONFIG))
    try:
        assert "moved 2 job(s)" in server.tail(), server.tail()
        failed = server.get(f"/jobs/{FAILED}").json()
        assert failed["status"] == "failed" and failed["error"] == "the old server's one line", failed
        done = server.wait(WAITING, timeout=300)
        assert done["status"] == "done" and done["settings"]["seed"] == 3, done
        assert server.get(f"/jobs/{WAITING}/result.glb").content[:4] == b"glTF"
        assert server.get(f"/jobs/{BROKEN}").status_code == 404  # the control: a job not moved is not found
        assert (data / "jobs" / BROKEN / "job.json").exists()  # left as it was
        assert not (data / "jobs" / ".new-0123").exists()
        marker = json.loads((data / "pixal3d-serve.json").read_text())
        assert marker["format"] == "pixal3d-serve/2" and "migrated_to" in marker
    finally:
        server.stop()
    again = Server.start(data, "--config", str(TINY_CONFIG))
    try:
        assert again.tail().count("moved ") == 1  # the first start's line only (the log keeps both starts)
        assert again.get(f"/jobs/{FAILED}").json()["status"] == "failed"
        assert again.get(f"/jobs/{WAITING}").json()["status"] == "done"
    finally:
        again.stop()
