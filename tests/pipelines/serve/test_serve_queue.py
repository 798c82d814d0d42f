"""The job server's queue in a database (``pipelines/serve/db``), every test against SQLite and against a real
PostgreSQL server (``tests/support/postgres_harness.py``): claims take the oldest job and more of its plan; a lease that
expires gives the job to another worker and fences the old owner out, so a job ends once; a job lost too often
fails with one line; cancel flags reach the owner; the queue size holds; a newer schema is refused. On PostgreSQL:
a claim skips the rows another claim holds (and the control without row locks claims one job twice), and an
operation waits for a restarted server and goes on."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from pipelines.serve.db import QueueError, QueueFull, QueueUnavailable, open_queue
from pipelines.serve.db.engine import Dialect
from pipelines.serve.db.jobs import Queue
from tests.support.postgres_harness import postgres, postgres_url  # noqa: F401

ID = "{:032x}".format


@pytest.fixture(params=["sqlite", "postgresql"])
def queue(request, tmp_path):
    url = None if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    opened = open_queue(url, tmp_path)
    yield opened
    opened.close()


def _submit(queue: Queue, *plans: str, queue_size: int | None = None) -> list[str]:
    ids = []
    for plan in plans:
        job_id = ID(int(time.monotonic_ns()) + len(ids))
        queue.submit(job_id, {"seed": len(ids), "plan": plan}, plan, "input.png", queue_size=queue_size)
        ids.append(job_id)
    return ids


def _wait_expired(queue: Queue, job_id: str) -> None:
    """Reap until the job's lease has expired and it was taken back (the lease is a fraction of a second)."""
    deadline = time.monotonic() + 30
    while job_id not in queue.reap(max_lost=3):
        assert time.monotonic() < deadline, queue.get(job_id)
        time.sleep(0.05)


def test_claims_take_the_oldest_job_and_more_of_its_plan_in_submission_order(queue):
    a1, b2, a3, a4, a5 = _submit(queue, "A", "B", "A", "A", "A")
    assert queue.view(a4)[1] == 4 and queue.counts() == {"queued": 5, "running": 0}
    first = queue.claim("w1", 0, "cpu", group_size=3, lease=60)
    assert [c.id for c in first] == [a1, a3, a4] and all(c.attempt == 1 for c in first)
    assert first[0].settings == {"seed": 0, "plan": "A"} and first[0].input == "input.png"
    assert [c.id for c in queue.claim("w2", 0, "cpu", group_size=3, lease=60)] == [b2]  # the oldest now: B
    assert [c.id for c in queue.claim("w2", 0, "cpu", group_size=3, lease=60)] == [a5]
    assert queue.claim("w2", 0, "cpu", group_size=3, lease=60) == []
    job = queue.get(a3)
    assert (job.status, job.owner, job.attempt, job.device) == ("running", "w1", 1, "cpu")
    assert queue.counts() == {"queued": 0, "running": 5}
    assert [(e["event"], e["worker"], e["group"]) for e in queue.attempts(a3)] == [("started", "w1", 3)]


def test_a_lost_lease_gives_the_job_to_another_worker_and_fences_the_old_owner_out(queue):
    [job] = _submit(queue, "A")
    [claim] = queue.claim("w1", 0, "cpu", group_size=1, lease=60)
    assert queue.renew("w1", {job: claim.attempt}, 60) == {job: False}  # a heartbeat: the lease holds
    assert queue.reap(max_lost=3) == [] and queue.get(job).status == "running"
    queue.renew("w1", {job: claim.attempt}, 0.05)  # the last heartbeat before w1 "dies"
    _wait_expired(queue, job)
    assert (queue.get(job).status, queue.get(job).lost) == ("queued", 1)
    [again] = queue.claim("w2", 1, "cuda:1", group_size=1, lease=60)
    assert again.attempt == 2
    # w1 comes back: its heartbeat, progress, finish and release change nothing
    assert queue.renew("w1", {job: claim.attempt}, 60) == {}
    assert not queue.progress(job, "w1", claim.attempt, {"stage": "export"})
    assert not queue.holds(job, "w1", claim.attempt)
    assert not queue.finish(job, "w1", claim.attempt, {"status": "done"})
    queue.release([job], "w1", {job: claim.attempt})
    assert (queue.get(job).status, queue.get(job).owner) == ("running", "w2")
    # w2 finishes it, once
    assert queue.holds(job, "w2", 2) and queue.progress(job, "w2", 2, {"stage": "export"})
    assert queue.get(job).progress == {"stage": "export"}
    assert queue.finish(job, "w2", 2, {"status": "done", "seconds": 1.5})
    assert not queue.finish(job, "w2", 2, {"status": "done"})
    ended = queue.get(job)
    assert (ended.status, ended.outcome, ended.lost) == ("done", {"status": "done", "seconds": 1.5}, 1)
    assert ended.finished >= ended.submitted
    assert [(e["event"], e["worker"]) for e in queue.attempts(job)] == [("started", "w1"), ("started", "w2"),
                                                                        ("ended", "w2")]


def test_a_job_lost_max_lost_times_fails_with_one_line_and_release_is_not_a_loss(queue):
    [job] = _submit(queue, "A")
    [claim] = queue.claim("w1", 0, "cpu", group_size=1, lease=60)
    queue.release([job], "w1", {job: claim.attempt})  # given back for another job's sake: not counted
    assert (queue.get(job).status, queue.get(job).lost) == ("queued", 0)
    [claim] = queue.claim("w1", 0, "cpu", group_size=1, lease=60)
    queue.lose([job], "w1", {job: claim.attempt}, "its worker process died (exit code -9)", max_lost=3)
    [claim] = queue.claim("w1", 0, "cpu", group_size=1, lease=60)
    assert queue.reclaim("w1", "worker w1 started again", max_lost=3) == [job]  # a restart takes its jobs back
    [claim] = queue.claim("w2", 0, "cpu", group_size=1, lease=0.05)
    assert claim.attempt == 4
    _wait_expired(queue, job)
    ended = queue.get(job)
    assert (ended.status, ended.lost) == ("failed", 3)
    assert "lost 3 times" in ended.outcome["error"] and "w2" in ended.outcome["error"]
    assert "\n" not in ended.outcome["error"]
    assert queue.claim("w3", 0, "cpu", group_size=1, lease=60) == []


def test_cancel_ends_a_queued_job_at_once_and_raises_a_running_ones_flag_for_its_owner(queue):
    queued, running = _submit(queue, "B", "A")
    [claim] = queue.claim("w1", 0, "cpu", group_size=1, lease=60)  # the oldest is B
    assert claim.id == queued
    queue.release([queued], "w1", {queued: 1})
    assert queue.cancel(queued) == "queued"  # the status before: cancelled now
    assert queue.get(queued).status == "cancelled" and queue.get(queued).outcome["error"].startswith("cancelled by DELETE")
    [claim] = queue.claim("w1", 0, "cpu", group_size=1, lease=60)
    assert claim.id == running and queue.renew("w1", {running: 1}, 60) == {running: False}
    assert queue.cancel(running) == "running"
    assert queue.renew("w1", {running: 1}, 60) == {running: True}  # the heartbeat carries the flag to the owner
    assert queue.finish(running, "w1", 1, {"status": "cancelled", "error": "cancelled by DELETE /jobs/{id}"})
    assert queue.cancel(running) == "cancelled" and queue.get(running).status == "cancelled"  # left as it ended
    assert queue.cancel(ID(7)) is None
    # a flagged job whose worker died ends cancelled, not queued again
    [job] = _submit(queue, "C")
    queue.claim("w1", 0, "cpu", group_size=1, lease=60)
    queue.cancel(job)
    queue.lose([job], "w1", {job: 1}, "its worker process died", max_lost=3)
    assert queue.get(job).status == "cancelled"


def test_the_queue_size_counts_waiting_jobs_and_a_retried_submit_is_one_job(queue):
    first, second = _submit(queue, "A", "A", queue_size=2)
    with pytest.raises(QueueFull, match="--queue-size"):
        _submit(queue, "A", queue_size=2)
    queue.submit(first, {"seed": 9}, "A", "input.png", queue_size=2)  # the same id again: its answer was lost
    assert [j.id for j in queue.jobs()] == [first, second] and queue.get(first).settings["seed"] == 0
    queue.claim("w1", 0, "cpu", group_size=1, lease=60)  # a running job does not wait
    _submit(queue, "A", queue_size=2)


def test_live_workers_are_listed_until_their_lease_runs_out_and_retention_finds_old_jobs(queue):
    queue.beat("b", host="h2", pid=2, role="worker", lease=60, slots=[{"device": "cuda:0", "jobs": []}])
    queue.beat("a", host="h1", pid=1, role="all", lease=0.05, slots=[{"device": "cpu", "jobs": ["x"]}])
    queue.beat("a", host="h1", pid=1, role="all", lease=60, slots=[{"device": "cpu", "jobs": []}])
    workers = queue.workers()
    assert [(w.name, w.host, w.role, w.slots) for w in workers] == [
        ("a", "h1", "all", [{"device": "cpu", "jobs": []}]), ("b", "h2", "worker", [{"device": "cuda:0", "jobs": []}])]
    queue.beat("a", host="h1", pid=1, role="all", lease=0.01, slots=[])
    deadline = time.monotonic() + 30
    while [w.name for w in queue.workers()] != ["b"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    queue.leave("b")
    assert queue.workers() == []
    old, fresh = _submit(queue, "A", "A")
    for job in (old, fresh):
        [claim] = queue.claim("w", 0, "cpu", group_size=1, lease=60)
        queue.finish(claim.id, "w", 1, {"status": "done"})
    assert queue.ended_before(3600) == [] and set(queue.ended_before(-60)) == {old, fresh}
    queue.remove([old])
    assert queue.get(old) is None and queue.attempts(old) == [] and queue.known([old, fresh]) == {fresh}


def test_a_database_of_a_newer_schema_is_refused_with_one_line(queue, tmp_path):
    queue._run(lambda tx: tx.run("UPDATE pixal3d_meta SET value = '99' WHERE key = 'schema'"), write=True)
    url = None if queue.kind == "sqlite" else queue.url
    with pytest.raises(QueueError, match="schema version 99, newer than this pixal3d-serve's 1") as caught:
        open_queue(url, tmp_path)
    assert "\n" not in str(caught.value)
    queue.close()  # a connection made now checks the version too (another server upgraded it meanwhile)
    with pytest.raises(QueueError, match="schema version 99"):
        queue.counts()


def test_many_claimers_at_once_never_take_one_job_twice(queue):
    ids = set(_submit(queue, *["A"] * 24))
    taken: list[str] = []

    def claimer(name: str) -> None:
        while claims := queue.claim(name, 0, "cpu", group_size=2, lease=60):
            taken.extend(c.id for c in claims)

    threads = [threading.Thread(target=claimer, args=(f"w{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(taken) == sorted(ids)


# -- PostgreSQL only ----------------------------------------------------------------------------------------------
def _waiting_on_a_lock(queue: Queue) -> bool:
    return queue._run(lambda tx: tx.one("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND "
                                        "datname = current_database()")[0], write=False) > 0


@pytest.mark.parametrize("locks", ["skip locked", "control: no row locks"])
def test_a_claim_skips_the_rows_another_claim_holds_on_postgresql(postgres_url, tmp_path, locks):
    """A claim's transaction left open (its worker between SELECT and COMMIT): another claim takes the next job at
    once. Control: the same SQL without the row locks (SQLite's words, on PostgreSQL) waits on the first claim's row
    and then takes the same job: claimed twice."""
    queue = open_queue(postgres_url, tmp_path)
    if locks != "skip locked":
        queue.dialect = Dialect(**{**vars(queue.dialect), "skip_locked": "", "for_update": ""})
    first, second = _submit(queue, "A", "A")
    connection = queue._checkout()
    held = queue._transaction(connection, True)
    tx = held.__enter__()
    [mine] = queue._claim(tx, "w1", 0, "cpu", group_size=1, lease=60)  # claimed, not committed
    assert mine.id == first
    got: list = []
    thread = threading.Thread(target=lambda: got.extend(queue.claim("w2", 0, "cpu", group_size=1, lease=60)))
    thread.start()
    if locks == "skip locked":
        thread.join(60)
        assert not thread.is_alive() and [c.id for c in got] == [second]
    else:
        deadline = time.monotonic() + 60
        while not _waiting_on_a_lock(queue):  # the second claim's UPDATE waits for the first's row
            assert thread.is_alive() and time.monotonic() < deadline, got
            time.sleep(0.05)
    held.__exit__(None, None, None)
    queue._checkin(connection)
    thread.join(60)
    claimed_by_second = [c.id for c in got]
    assert (claimed_by_second == [second]) == (locks == "skip locked")
    if locks != "skip locked":
        assert claimed_by_second == [first]  # the job both workers now run


@pytest.mark.parametrize("patience", [None, 0])
def test_an_operation_waits_for_a_restarted_postgresql_and_goes_on(postgres, postgres_url, tmp_path, patience):
    """The server stopped under an open queue (its connections closed), an operation started, the server started
    again: the operation retries on a new connection and succeeds; nothing committed before is lost. Control:
    with no patience the same operation fails at once with one line."""
    queue = open_queue(postgres_url, tmp_path, patience=patience)
    [job] = _submit(queue, "A")
    queue.claim("w1", 0, "cpu", group_size=1, lease=60)
    postgres.stop()
    try:
        result: list = []
        thread = threading.Thread(target=lambda: result.append(_attempt(queue.counts)))
        thread.start()
        if patience is None:
            time.sleep(0.5)  # the operation is retrying meanwhile (its result is checked, not its timing)
            assert thread.is_alive()
    finally:
        postgres.start()
    thread.join(60)
    if patience is None:
        assert result == [{"queued": 0, "running": 1}]
        assert queue.get(job).owner == "w1"
    else:
        [err] = result
        assert isinstance(err, QueueUnavailable) and "cannot be reached" in str(err) and "\n" not in str(err)


def _attempt(operation):
    try:
        return operation()
    except QueueError as err:
        return err


@pytest.mark.parametrize("url, words", [
    ("postgresql://u@127.0.0.1:1/db?sslmode=bogus", "invalid sslmode value"),
    ("postgresql://u@no-such-host.invalid/db", "failed to resolve host"),
])
def test_a_queue_url_that_can_never_connect_fails_at_once_in_one_line(url, words, tmp_path):
    """Issue 44 item 11: a misspelt option or a host no resolver knows waited the whole patience (20 s from the
    server) before its error; no retry can fix either. Control: a refused connection (nothing listens on port 1,
    as while a database restarts) is still retried until the patience is spent."""
    pytest.importorskip("psycopg")
    if "no-such-host" in url:
        try:
            socket.getaddrinfo("no-such-host.invalid", 5432)
        except socket.gaierror as err:
            if err.errno != socket.EAI_NONAME:
                pytest.skip(f"this machine's resolver is away ({err}): a failure a retry may fix")
    started = time.monotonic()
    with pytest.raises(QueueError) as caught:
        open_queue(url, tmp_path, patience=8)
    assert time.monotonic() - started < 4, "it waited for the patience"
    assert not isinstance(caught.value, QueueUnavailable)
    line = str(caught.value)
    assert "\n" not in line and words in line and "can never connect" in line and "fix the URL" in line
    started = time.monotonic()
    with pytest.raises(QueueUnavailable):
        open_queue("postgresql://u@127.0.0.1:1/db", tmp_path, patience=2)
    assert time.monotonic() - started >= 1.5
