"""The job server's workers and queue: two workers on two CPU "devices" run two jobs at once; the queue is read back
from the data folder at start (jobs without an end queued again in order, half-created ones removed); retention
removes ended jobs, their results and records, and nothing else."""
from __future__ import annotations

import hashlib
import time

import pytest

from pipelines.serve.scheduler import Scheduler
from pipelines.serve.store import JobStore
from tests.cascade_fixtures import EXAMPLE, TINY_CONFIG, tiny_cache  # noqa: F401
from tests.serve_harness import Server

SETTINGS = {"seed": 42, "texture_size": 128, "face_budget": 2000, "memory_policy": "staged"}


def test_two_workers_on_two_cpu_devices_run_two_jobs_at_once(tiny_cache, tmp_path):
    pytest.importorskip("fastapi")
    server = Server.start(tmp_path / "data", "--config", str(TINY_CONFIG), "--devices", "cpu,cpu", "--threads", "1",
                          "--group-size", "1")
    try:
        health = server.get("/health").json()
        assert health["devices"] == ["cpu", "cpu"] and len({w["pid"] for w in health["workers"]}) == 2
        ids = [server.submit(EXAMPLE.read_bytes(), SETTINGS).json()["id"] for _ in range(2)]
        deadline = time.monotonic() + 120
        while True:  # both running at one moment, one on each worker
            views = [server.get(f"/jobs/{i}").json() for i in ids]
            if all(v["status"] == "running" for v in views):
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


def _scheduler(store: JobStore, keep: float | None = None) -> Scheduler:
    return Scheduler(store, devices=["cpu"], config=str(TINY_CONFIG), queue_size=8, group_size=8, job_timeout=None,
                     keep_seconds=keep, threads=None)


def test_the_queue_is_read_back_at_start_and_retention_removes_only_old_ended_jobs(tmp_path):
    store = JobStore(tmp_path / "data")
    scheduler = _scheduler(store, keep=3600)
    image = EXAMPLE.read_bytes()
    old, recent, waiting = (scheduler.submit(image, ".png", {**SETTINGS, "seed": s}).id for s in (1, 2, 3))
    now = time.time()
    for job_id, finished in ((old, now - 7200), (recent, now - 60)):
        store.end(job_id, {"status": "done", "finished": finished})
        (store.work_folder(job_id)).mkdir(parents=True)
    (store.jobs / ".new-0123").mkdir()  # a job killed while being created
    # read back: ended jobs keep their end, the rest wait in submission order; the half-made one is gone
    again = _scheduler(store, keep=3600)
    assert not (store.jobs / ".new-0123").exists()
    assert {i: j.status for i, j in again.jobs.items()} == {old: "done", recent: "done", waiting: "queued"}
    assert again.view(waiting)["position"] == 1
    assert again.sweep(now) == [old]
    assert not store.folder(old).exists() and not store.work_folder(old).exists()
    assert store.folder(recent).exists() and store.work_folder(recent).exists() and store.folder(waiting).exists()
    assert set(again.jobs) == {recent, waiting}
    # keep 0: nothing is ever removed
    assert _scheduler(store, keep=None).sweep(now + 10 ** 6) == []
    with pytest.raises(ValueError, match="not a job id"):
        store.folder("../etc")
