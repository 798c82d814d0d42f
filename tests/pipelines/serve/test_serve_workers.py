"""The job server's workers and queue: two workers on two CPU "devices" run two jobs at once; retention removes ended
jobs (rows, results and records) and the folders of submissions that never got a row, and nothing else; an older
server's files-only data folder is moved into the queue at the first start."""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from pipelines.serve.db import open_queue
from pipelines.serve.service import Jobs
from pipelines.serve.store import DataFolder
from tests.support.cascade_fixtures import EXAMPLE, TINY_CONFIG, tiny_cache  # noqa: F401
from tests.support.serve_harness import Server

SETTINGS = {"seed": 42, "texture_size": 128, "face_budget": 2000, "memory_policy": "staged"}


def test_two_workers_on_two_cpu_devices_run_two_jobs_at_once(tiny_cache, tmp_path):
    pytest.importorskip("fastapi")
    server = Server.start(tmp_path / "data", "--config", str(TINY_CONFIG), "--devices", "cpu,cpu", "--threads", "1",
                          "--group-size", "1", hold=tmp_path / "hold")
    try:
        health = server.get("/health").json()
        assert health["devices"] == ["cpu", "cpu"] and len({w["pid"] for w in health["workers"]}) == 2
        with server.held("structure"):  # each job waits there: both running at one moment, whatever the timing
            ids = [server.submit(EXAMPLE.read_bytes(), SETTINGS).json()["id"] for _ in range(2)]
            deadline = time.monotonic() + 120
            while True:  # one on each worker (one worker would hold the second job in its queue, never both here)
                views = [server.get(f"/jobs/{i}").json() for i in ids]
                if all(v["status"] == "running" and v.get("stage") == "structure" for v in views):
                    break
                assert time.monotonic() < deadline and not any(v["status"] == "done" for v in views), views
                time.sleep(0.1)
            assert sorted(v["worker"] for v in views) == [0, 1]
            assert sorted(len(w["jobs"]) for w in server.get("/health").json()["workers"]) == [1, 1]
        assert [server.wait(i)["status"] for i in ids] == ["done", "done"]
        glbs = [server.get(f"/jobs/{i}/result.glb").content for i in ids]
        assert hashlib.sha256(glbs[0]).digest() == hashlib.sha256(glbs[1]).digest()  # same settings, same bits
    finally:
        server.stop()


def _jobs(tmp_path, keep: float | None) -> Jobs:
    data = DataFolder(tmp_path / "data")
    return Jobs(open_queue(None, data.root), data, queue_size=8, keep_seconds=keep)


def _end(jobs: Jobs, job_id: str, ago: float) -> None:
    """End a queued job as a worker would (claim, finish) and date its end ``ago`` seconds back."""
    [claim] = jobs.queue.claim("w", 0, "cpu", group_size=1, lease=60)
    assert claim.id == job_id and jobs.queue.finish(job_id, "w", claim.attempt, {"status": "done"})
    jobs.queue._run(lambda tx: tx.run("UPDATE pixal3d_jobs SET finished = finished - ? WHERE id = ?", (ago, job_id)),
                    write=True)
    jobs.data.work_folder(job_id).mkdir(parents=True)


def test_retention_removes_old_ended_jobs_and_folders_no_job_names_and_nothing_else(tmp_path):
    jobs = _jobs(tmp_path, keep=3600)
    image = EXAMPLE.read_bytes()
    old, recent, waiting = (jobs.submit(image, ".png", {**SETTINGS, "seed": s}).id for s in (1, 2, 3))
    _end(jobs, old, 7200)
    _end(jobs, recent, 60)
    assert jobs.view(waiting)["position"] == 1 and jobs.view(old)["status"] == "done"
    # a submission killed between its image and its row: an old folder no row names, and a young one (maybe a
    # submission in progress on another API replica)
    stale, young = jobs.data.folder("a" * 32), jobs.data.folder("b" * 32)
    for folder in (stale, young):
        folder.mkdir()
        (folder / "input.png").write_bytes(image)
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    assert jobs.sweep() == [old]
    assert jobs.view(old) is None and not jobs.data.folder(old).exists() and not jobs.data.work_folder(old).exists()
    assert jobs.data.folder(recent).exists() and jobs.data.work_folder(recent).exists()
    assert jobs.data.folder(waiting).exists() and jobs.view(waiting)["status"] == "queued"
    assert not stale.exists() and young.exists()
    # keep 0: nothing is ever removed
    assert _jobs(tmp_path, keep=None).sweep() == [] and jobs.view(recent)["status"] == "done"
    with pytest.raises(ValueError, match="not a job id"):
        jobs.data.folder("../etc")


def _old_folder(root: Path, image: bytes) -> dict[str, str]:
    """A data folder as the server wrote it before its queue moved into a database: files only."""
    (root / "jobs").mkdir(parents=True)
    (root / "pixal3d-serve.json").write_text(json.dumps({"format": "pixal3d-serve/1"}))
    ids = {"done": "d" * 32, "waiting": "e" * 32}
    for sequence, (kind, job_id) in enumerate(ids.items(), 1):
        folder = root / "jobs" / job_id
        folder.mkdir()
        (folder / "input.png").write_bytes(image)
        (folder / "job.json").write_text(json.dumps({"format": "pixal3d-serve/1", "id": job_id, "sequence": sequence,
                                                     "submitted": 1000.0 + sequence, "input": "input.png",
                                                     "settings": {**SETTINGS, "seed": sequence}}))
    done = root / "jobs" / ids["done"]
    (done / "status.json").write_text(json.dumps({"format": "pixal3d-serve/1", "status": "done", "seconds": 3.5,
                                                  "finished": 1010.0}))
    (done / "result.glb").write_bytes(b"glTF-of-the-old-server")
    (root / "jobs" / ".new-0123").mkdir()  # a job killed while it was being created: never acknowledged
    (done / "attempts.jsonl").write_text('{"time": 1002.0, "event": "started"}\n{"time": 1010.0, "event": "ended"}\n')
    return ids


def test_an_older_servers_data_folder_is_moved_into_the_queue_at_the_first_start(tiny_cache, tmp_path):
    """An API replica started on a files-only data folder: its jobs answer as they were (the done one's result, the
    waiting one queued first), and a second start moves nothing again."""
    pytest.importorskip("fastapi")
    ids = _old_folder(tmp_path / "data", EXAMPLE.read_bytes())
    server = Server.start(tmp_path / "data", "--config", str(TINY_CONFIG), "--role", "api", ready=False)
    try:
        assert "moved 2 job(s)" in server.tail()
        done = server.get(f"/jobs/{ids['done']}").json()
        assert (done["status"], done["seconds"], done["settings"]["seed"]) == ("done", 3.5, 1)
        assert server.get(f"/jobs/{ids['done']}/result.glb").content == b"glTF-of-the-old-server"
        assert server.get(f"/jobs/{ids['waiting']}").json()["position"] == 1
        health = server.get("/health").json()
        assert health["queue"] == 1 and health["workers"] == [] and not health["ready"]  # an API alone runs nothing
    finally:
        server.stop()
    queue = open_queue(None, tmp_path / "data")
    assert [a["event"] for a in queue.attempts(ids["done"])] == ["started", "ended"]
    assert json.loads((tmp_path / "data" / "pixal3d-serve.json").read_text())["format"] == "pixal3d-serve/2"
    assert not (tmp_path / "data" / "jobs" / ".new-0123").exists()
    server.launch(ready=False)
    try:
        assert server.tail().count("moved") == 1  # the second start moved nothing
        assert len(queue.jobs()) == 2
    finally:
        server.stop()
