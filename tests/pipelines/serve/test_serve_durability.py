"""Durability of the job server: three jobs submitted, the server killed (SIGKILL) while the second runs, started
again on the same data folder: all three finish, the interrupted one resumed from exactly the stage records it had
(its status and run.json say which), none ran twice to completion, and the resumed job's fingerprints are those of
an uninterrupted run. A worker process killed alone is replaced and its job resumes likewise. Neither the kill nor the
stop leaves a "leaked semaphore" warning in the log."""
from __future__ import annotations

import os
import signal

import psutil
import pytest

from pipelines.build import CASCADE_STAGES
from pipelines.serve.db import open_queue
from tests.support.cascade_fixtures import (  # noqa: F401
    EXAMPLE,
    TINY_CONFIG,
    tiny,
    tiny_cache,
    tiny_reference,
)
from tests.support.serve_harness import Server

pytest.importorskip("fastapi")

SETTINGS = {"texture_size": 128, "face_budget": 2000, "memory_policy": "staged"}
ORDER = [stage.name for stage in CASCADE_STAGES]


def _attempts(server: Server, job_id: str) -> list[str]:
    """Each time a worker started or ended the job, from the queue (SQLite in the data folder)."""
    queue = open_queue(None, server.data)
    try:
        return [attempt["event"] for attempt in queue.attempts(job_id)]
    finally:
        queue.close()


def _status(server: Server, job_id: str) -> str:
    queue = open_queue(None, server.data)
    try:
        return queue.get(job_id).status
    finally:
        queue.close()


def test_a_server_killed_mid_job_resumes_it_from_its_records_and_runs_nothing_twice(tiny_cache, tiny_reference,
                                                                                     tmp_path):
    server = Server.start(tmp_path / "data", "--config", str(TINY_CONFIG), "--group-size", "1", hold=tmp_path / "hold")
    try:
        image = EXAMPLE.read_bytes()
        ids = [server.submit(image, {**SETTINGS, "seed": seed}).json()["id"] for seed in (1, 42, 3)]
        first, middle, last = ids
        # 1. the first finishes; kill the server once the second has recorded a few stages (held at the texture,
        #    so that the kill cannot come after it ended: a tiny job lasts two seconds)
        with server.held("texture", job=middle):
            assert server.wait(first)["status"] == "done"
            server.wait(middle, lambda v: v.get("stage") == "texture", timeout=120)
            glb = server.data / "jobs" / first / "result.glb"
            before = (glb.stat().st_mtime_ns, glb.stat().st_ino)
            server.kill()
        recorded = sorted((p.stem for p in (server.data / "work" / middle).glob("*.json")), key=ORDER.index)
        assert len(recorded) >= 4 and recorded == ORDER[:len(recorded)], recorded
        assert _status(server, middle) == "running" and _status(server, last) == "queued"  # as the kill left them
        # 2. started again: the queue goes on
        server.launch()
        views = {job_id: server.wait(job_id) for job_id in ids}
        assert [views[i]["status"] for i in ids] == ["done"] * 3, views
        # 3. the interrupted job resumed at its first unrecorded stage; its records and run.json say which
        assert views[middle]["resumed"] == recorded
        assert [s["stage"] for s in views[middle]["stages"] if s["resumed"]] == recorded
        run = server.get(f"/jobs/{middle}/run.json").json()
        assert run["serve"]["resumed"] == recorded
        # its fingerprints are an uninterrupted run's (seed 42: the session's reference, through the decode)
        prints = {s["stage"]: s["fingerprints"] for s in run["stages"] if s["fingerprints"]}
        prints.pop("export")
        assert prints == tiny_reference
        # 4. nothing ran twice to completion: the first was not touched, each job ended once
        assert (glb.stat().st_mtime_ns, glb.stat().st_ino) == before
        assert _attempts(server, first) == ["started", "ended"]
        assert _attempts(server, middle) == ["started", "started", "ended"]
        assert _attempts(server, last).count("ended") == 1 and views[last]["resumed"] == []
        # an ended job's stage records are gone; its results stay downloadable after the restart
        assert not (server.data / "work" / middle).exists()
        assert server.get(f"/jobs/{first}/result.glb").content == glb.read_bytes()
        # 5. a worker killed alone is replaced; its job goes back to the queue and resumes from its records
        [worker] = server.get("/health").json()["workers"]
        job = server.submit(image, {**SETTINGS, "seed": 4}).json()["id"]
        with server.held("texture", job=job):
            server.wait(job, lambda v: v.get("stage") == "texture", timeout=120)
            os.kill(worker["pid"], signal.SIGKILL)
        view = server.wait(job)
        assert view["status"] == "done" and len(view["resumed"]) >= 4, view
        assert _attempts(server, job) == ["started", "started", "ended"]
        assert server.get("/health").json()["workers"][0]["pid"] not in (None, worker["pid"])
        assert not psutil.pid_exists(worker["pid"])  # reaped by the server, not left a zombie
        assert "the worker on cpu" in server.tail()
        # 6. stopped (SIGTERM) after being killed (SIGKILL): neither left Python's resource tracker a semaphore to
        #    warn about (each did, before the workers' progress bars took a thread lock)
        server.stop()
        assert "leaked semaphore" not in server.log.read_text()
    finally:
        server.stop()
