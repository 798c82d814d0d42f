"""The job server across machines, on one queue, against a real PostgreSQL server and against SQLite: two API
processes (``--role api``) and two worker processes with different names (``--role worker --name a`` / ``b``), as
two machines would run them on one ``--queue`` and one shared ``--data``.

- jobs spread over both workers, and either API answers for every job (views, results, the live workers);
- a worker killed with SIGKILL mid-job: after its lease expires the other worker takes the job over and finishes it
  from the stages it had recorded; its fingerprints are those of an uninterrupted run, and it ended exactly once;
- a cancel sent to one API reaches the worker running the job, wherever it runs;
- PostgreSQL stopped and started mid-run: the APIs answer 503 (one line) meanwhile, then again; the workers
  reconnect, and every job in flight finishes, once.

Leases are 2 s here (heartbeats every 0.67 s), so a takeover waits seconds, not the default 30.
"""
from __future__ import annotations

import time

import psutil
import pytest

from pipelines.build import CASCADE_STAGES
from pipelines.serve.db import open_queue
from tests.support.cascade_fixtures import EXAMPLE, TINY_CONFIG, tiny_cache  # noqa: F401
from tests.support.postgres_harness import postgres  # noqa: F401
from tests.support.serve_harness import Server

pytest.importorskip("fastapi")

SETTINGS = {"texture_size": 128, "face_budget": 2000, "memory_policy": "resident"}
ORDER = [stage.name for stage in CASCADE_STAGES]
LEASE = "2"


class Fleet:
    """Two APIs and two named workers on one queue and one data folder."""

    def __init__(self, folder, queue: list[str]):
        self.folder, self.queue = folder, queue
        self.data = folder / "data"
        common = ["--config", str(TINY_CONFIG), *queue]
        self.apis = [Server.start(self.data, *common, "--role", "api", ready=False, log=f"api{i}") for i in (1, 2)]
        self.workers = {name: Server.start(self.data, *common, "--role", "worker", "--name", name, "--devices", "cpu",
                                           "--threads", "1", "--group-size", "1", "--lease", LEASE, log=name,
                                           hold=folder / "hold")
                        for name in ("a", "b")}
        self.wait_ready()

    def wait_ready(self, timeout: float = 180) -> None:
        """Until both APIs list both workers, ready."""
        deadline = time.monotonic() + timeout
        for api in self.apis:
            while True:
                health = api.get("/health").json()
                if health["ready"] and sorted(w["name"] for w in health["workers"]) == ["a", "b"]:
                    break
                assert time.monotonic() < deadline, (health, self.logs())
                time.sleep(0.2)

    def submit(self, seed: int) -> str:
        response = self.apis[0].submit(EXAMPLE.read_bytes(), {**SETTINGS, "seed": seed})
        assert response.status_code == 202, response.text
        return response.json()["id"]

    def attempts(self, job_id: str) -> list[tuple[str, str]]:
        queue = open_queue(self.queue[1] if self.queue else None, self.data)
        try:
            return [(a["event"], a["worker"]) for a in queue.attempts(job_id)]
        finally:
            queue.close()

    def logs(self) -> str:
        return "\n".join(f"--- {p.log.name}\n{p.tail()}" for p in [*self.apis, *self.workers.values()])

    def stop(self) -> None:
        for process in [*self.workers.values(), *self.apis]:
            process.stop()


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def fleet(request, tiny_cache, tmp_path_factory):
    queue = [] if request.param == "sqlite" else ["--queue", request.getfixturevalue("postgres").new_database()]
    fleet = Fleet(tmp_path_factory.mktemp(f"fleet-{request.param}"), queue)
    fleet.kind = request.param
    fleet.uninterrupted = {}
    yield fleet
    fleet.stop()


def _prints(api: Server, job_id: str) -> dict:
    run = api.get(f"/jobs/{job_id}/run.json").json()
    return {s["stage"]: s["fingerprints"] for s in run["stages"] if s["fingerprints"]}


def test_jobs_spread_over_two_workers_and_either_api_answers_for_every_job(fleet):
    ids = [fleet.submit(seed) for seed in (1, 2)]
    first, second = fleet.apis
    running = {}
    deadline = time.monotonic() + 120
    while len(running) < 2:  # both running at one moment, one on each worker
        for job_id in ids:
            view = second.get(f"/jobs/{job_id}").json()
            assert view["status"] != "done" or job_id in running, (view, fleet.logs())
            if view["status"] == "running":
                running[job_id] = view["node"]
        assert time.monotonic() < deadline, fleet.logs()
        time.sleep(0.1)
    assert sorted(running.values()) == ["a", "b"]
    views = [second.wait(i) for i in ids]
    assert [v["status"] for v in views] == ["done", "done"], fleet.logs()
    for job_id in ids:  # the other API gives the same view and the same bytes
        assert first.get(f"/jobs/{job_id}").json() == second.get(f"/jobs/{job_id}").json()
        assert first.get(f"/jobs/{job_id}/result.glb").content == second.get(f"/jobs/{job_id}/result.glb").content
        assert [e for e, _ in fleet.attempts(job_id)] == ["started", "ended"]
    health = first.get("/health").json()
    assert sorted((w["name"], w["role"], w["device"]) for w in health["workers"]) == [("a", "worker", "cpu"),
                                                                                    ("b", "worker", "cpu")]
    fleet.uninterrupted[1] = _prints(first, ids[0])
    # control for the takeover's comparison: another seed gives other fingerprints from the structure on
    other = _prints(first, ids[1])
    assert other["structure"] != fleet.uninterrupted[1]["structure"]
    assert other["preprocess"] == fleet.uninterrupted[1]["preprocess"]


def test_a_worker_killed_mid_job_is_taken_over_by_the_other_after_its_lease_from_its_records(fleet):
    if 1 not in fleet.uninterrupted:
        pytest.skip("needs the uninterrupted run of the test before")
    api = fleet.apis[1]
    job = fleet.submit(1)
    with fleet.workers["a"].held("texture", job=job):  # killed while it is surely running (a tiny job lasts 2 s)
        view = api.wait(job, lambda v: v.get("stage") == "texture", timeout=120)
        assert view["status"] == "running", view
        dead, other = view["node"], {"a": "b", "b": "a"}[view["node"]]
        fleet.workers[dead].kill()
    recorded = sorted((p.stem for p in (fleet.data / "work" / job).glob("*.json")), key=ORDER.index)
    assert len(recorded) >= 4 and recorded == ORDER[:len(recorded)], recorded
    ended = api.wait(job, timeout=120)
    assert ended["status"] == "done" and ended["lost"] == 1, (ended, fleet.logs())
    # the other worker resumed it at its first unrecorded stage, and ended it once
    assert fleet.attempts(job) == [("started", dead), ("started", other), ("ended", other)]
    assert ended["resumed"] == recorded
    assert [s["stage"] for s in ended["stages"] if s["resumed"]] == recorded
    assert _prints(api, job) == fleet.uninterrupted[1]
    assert "expired" in fleet.workers[other].tail() or "expired" in fleet.apis[0].tail() + fleet.apis[1].tail()
    fleet.workers[dead].launch(ready=False)  # back under its name, for the tests after
    fleet.wait_ready()


def test_a_paused_worker_is_taken_over_after_its_lease_and_writes_nothing_when_it_wakes(fleet):
    """SIGSTOP to a worker and its device process mid-job (a frozen container): the other worker takes the job
    once the lease has expired (it used to wait for the paused one's file lock without end); SIGCONT: the paused
    one runs on from where it stopped, and its record, result and end are refused."""
    if 1 not in fleet.uninterrupted:
        pytest.skip("needs the uninterrupted run of the first test")
    api = fleet.apis[0]
    job = fleet.submit(1)
    with fleet.workers["a"].held("texture", job=job):  # the hold folder is both workers'
        view = api.wait(job, lambda v: v.get("stage") == "texture", timeout=120)
        name = view["node"]
        paused, other = fleet.workers[name], {"a": "b", "b": "a"}[name]
        tree = [psutil.Process(paused.process.pid), *paused.descendants()]
        for process in tree:
            process.suspend()
    try:  # the gate is gone: whoever runs the job now runs it through
        ended = api.wait(job, timeout=120)
        assert ended["status"] == "done" and ended["lost"] == 1, (ended, fleet.logs())
        assert fleet.attempts(job) == [("started", name), ("started", other), ("ended", other)]
        glb = api.get(f"/jobs/{job}/result.glb").content
    finally:
        for process in tree:
            process.resume()
    deadline = time.monotonic() + 60
    while not any(line in paused.tail() for line in ("taken over by another run", " was lost")):
        assert time.monotonic() < deadline, fleet.logs()
        time.sleep(0.2)
    time.sleep(3 * float(LEASE))  # the woken worker's heartbeats and whatever else it would write
    assert fleet.attempts(job) == [("started", name), ("started", other), ("ended", other)]
    assert api.get(f"/jobs/{job}/result.glb").content == glb
    assert _prints(api, job) == fleet.uninterrupted[1]
    assert not (fleet.data / "work" / job).exists()  # the woken run brought no record back
    fleet.wait_ready()


def test_a_cancel_sent_to_one_api_reaches_the_worker_running_the_job(fleet):
    first, second = fleet.apis
    with fleet.workers["a"].held("structure"):  # both workers' hold: the job waits there until the DELETE is in
        response = first.submit(EXAMPLE.read_bytes(), {**SETTINGS, "memory_policy": "staged", "seed": 5})
        job = response.json()["id"]
        view = second.wait(job, lambda v: v.get("stage") == "structure", timeout=120)
        with first.client() as client:
            response = client.delete(f"/jobs/{job}")
        assert response.status_code == 200 and response.json()["status"] in ("running", "cancelled")
    ended = second.wait(job, timeout=60)
    assert ended["status"] == "cancelled" and "DELETE" in ended["error"], ended
    assert fleet.attempts(job) == [("started", view["node"]), ("ended", view["node"])]
    gone = first.get(f"/jobs/{job}/result.glb")
    assert gone.status_code == 410 and "cancelled" in gone.json()["error"]
    health = second.get("/health").json()
    assert health["ready"] and health["running"] == 0


def test_the_database_stopped_and_started_mid_run_loses_nothing(fleet, request):
    if fleet.kind != "postgresql":
        pytest.skip("SQLite is a file in --data: there is no database server to stop")
    server = request.getfixturevalue("postgres")
    api = fleet.apis[0]
    ids = [fleet.submit(seed) for seed in (6, 7)]
    for job_id in ids:
        api.wait(job_id, lambda v: v.get("stage_index", 0) >= 2, timeout=120)
    server.stop()
    try:
        down = api.get(f"/jobs/{ids[0]}")
        assert down.status_code == 503 and "cannot be reached" in down.json()["error"]
        assert "\n" not in down.json()["error"]
        time.sleep(3)  # longer than a lease: the workers' heartbeats fail meanwhile
    finally:
        server.start()
    views = [api.wait(job_id, timeout=180) for job_id in ids]
    assert [v["status"] for v in views] == ["done", "done"], (views, fleet.logs())
    for job_id in ids:
        events = [e for e, _ in fleet.attempts(job_id)]
        assert events.count("ended") == 1 and events[-1] == "ended", events
    assert "answers again" in fleet.workers["a"].tail() + fleet.workers["b"].tail()
    fleet.wait_ready()


def test_the_database_away_longer_than_the_queue_patience_costs_a_retry_not_a_job(fleet, request):
    """PostgreSQL away for longer than an operation's patience (10 s) while one worker runs a job and the other
    waits for one: no device thread ends (the idle one's claim used to raise out of it, for good, while /health
    still said ready); the running job finishes, ended once, and afterwards both workers run a job each at once,
    with no traceback in the logs."""
    if fleet.kind != "postgresql":
        pytest.skip("SQLite is a file in --data: there is no database server to stop")
    server = request.getfixturevalue("postgres")
    api = fleet.apis[0]
    job = fleet.submit(8)
    api.wait(job, lambda v: v.get("stage_index", 0) >= 2, timeout=120)
    server.stop()
    try:
        time.sleep(14)  # past the 10 s patience of each of the workers' queue operations
    finally:
        server.start()
    ended = api.wait(job, timeout=180)
    assert ended["status"] == "done", (ended, fleet.logs())
    assert [e for e, _ in fleet.attempts(job)].count("ended") == 1
    fleet.wait_ready()
    with fleet.workers["a"].held("structure"):  # both workers' hold: two jobs wait there, one on each worker
        ids = [fleet.submit(seed) for seed in (9, 10)]
        views = [api.wait(i, lambda v: v.get("stage") == "structure", timeout=120) for i in ids]
        assert sorted(v["node"] for v in views) == ["a", "b"], (views, fleet.logs())
    assert [api.wait(i, timeout=120)["status"] for i in ids] == ["done", "done"]
    assert "Traceback" not in fleet.logs(), fleet.logs()
