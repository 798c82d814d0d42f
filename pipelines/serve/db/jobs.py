"""The queue's operations (``Queue``), each one transaction: what the API does (submit, view, cancel, list the live
workers, retention) and what a worker does (claim a group by plan, renew its leases and read the cancel flags, report
progress, finish once, give back, lose), and the reaping of expired leases, which any process may do.

A claim takes the oldest queued job and more of its plan, raises ``attempt`` and gives the claimer a lease; every
later change by that worker names the attempt, so a worker whose lease expired and whose job another worker took
changes nothing (``finish`` answers False): a job ends once.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from .engine import Engine, Transaction, marks
from .rows import JOB_COLUMNS, Claim, JobRow, QueueFull, WorkerRow

logger = logging.getLogger(__name__)


class Queue(Engine):
    """The job queue over one database (``sqlite.SqliteQueue``, ``postgres.PostgresQueue``)."""

    # -- the API's side ----------------------------------------------------------------------
    def submit(self, job_id: str, settings: dict[str, Any], plan: str, input_name: str, *,
               queue_size: int | None) -> JobRow:
        """Queue a job (its input is on disk already): the commit point of ``POST /jobs``; ``QueueFull`` when
        ``queue_size`` jobs wait. Idempotent under retry (a commit whose answer was lost is not made twice)."""
        def body(tx: Transaction) -> None:
            self._serialize(tx)  # the count and the insert as one step, across API replicas
            if tx.one("SELECT 1 FROM pixal3d_jobs WHERE id = ?", (job_id,)) is not None:
                return
            if queue_size is not None:
                (waiting,) = tx.one("SELECT count(*) FROM pixal3d_jobs WHERE status = 'queued'")
                if waiting >= queue_size:
                    raise QueueFull(f"the queue is full ({queue_size} jobs wait, --queue-size); retry later")
            tx.run("INSERT INTO pixal3d_jobs (id, submitted, settings, plan, input, status) "
                   "VALUES (?, {now}, ?, ?, ?, 'queued')", (job_id, json.dumps(settings), plan, input_name))

        self._run(body, write=True)
        job = self.get(job_id)
        assert job is not None
        return job

    def get(self, job_id: str) -> JobRow | None:
        row = self._run(lambda tx: tx.one(f"SELECT {', '.join(JOB_COLUMNS)} FROM pixal3d_jobs WHERE id = ?",
                                          (job_id,)), write=False)
        return None if row is None else JobRow.from_row(row)

    def view(self, job_id: str) -> tuple[JobRow, int | None] | None:
        """The job and, while it is queued, its place in the queue (1: next), read in one transaction."""
        def body(tx: Transaction) -> tuple[JobRow, int | None] | None:
            row = tx.one(f"SELECT {', '.join(JOB_COLUMNS)} FROM pixal3d_jobs WHERE id = ?", (job_id,))
            if row is None:
                return None
            job = JobRow.from_row(row)
            if job.status != "queued":
                return job, None
            (ahead,) = tx.one("SELECT count(*) FROM pixal3d_jobs WHERE status = 'queued' AND seq < ?", (job.seq,))
            return job, ahead + 1

        return self._run(body, write=False)

    def jobs(self) -> list[JobRow]:
        """Every job, in submission order."""
        rows = self._run(lambda tx: tx.rows(f"SELECT {', '.join(JOB_COLUMNS)} FROM pixal3d_jobs ORDER BY seq"),
                         write=False)
        return [JobRow.from_row(r) for r in rows]

    def cancel(self, job_id: str) -> str | None:
        """Cancel a queued job now; raise a running one's flag (its owner stops it at its next stage or step); an
        ended job is left as it is. Returns the job's status before (None: no such job)."""
        def body(tx: Transaction) -> str | None:
            row = tx.one("SELECT status FROM pixal3d_jobs WHERE id = ?{for_update}", (job_id,))
            if row is None:
                return None
            if row[0] == "queued":
                outcome = {"status": "cancelled", "error": "cancelled by DELETE /jobs/{id} before it started"}
                tx.run("UPDATE pixal3d_jobs SET status = 'cancelled', outcome = ?, finished = {now} WHERE id = ?",
                       (json.dumps(outcome), job_id))
            elif row[0] == "running":
                tx.run("UPDATE pixal3d_jobs SET cancel = 1 WHERE id = ?", (job_id,))
            return row[0]

        return self._run(body, write=True)

    def counts(self) -> dict[str, int]:
        """Jobs queued and running."""
        rows = self._run(lambda tx: tx.rows("SELECT status, count(*) FROM pixal3d_jobs WHERE status IN "
                                            "('queued', 'running') GROUP BY status"), write=False)
        return {"queued": 0, "running": 0, **dict(rows)}

    def attempts(self, job_id: str) -> list[dict[str, Any]]:
        """Each time a worker started or ended the job, in order."""
        rows = self._run(lambda tx: tx.rows("SELECT time, event, worker, detail FROM pixal3d_attempts WHERE job = ? "
                                            "ORDER BY n", (job_id,)), write=False)
        return [{"time": t, "event": e, "worker": w, **(json.loads(d) if d else {})} for t, e, w, d in rows]

    def workers(self) -> list[WorkerRow]:
        """The live workers (heartbeat within their lease), by name."""
        rows = self._run(lambda tx: tx.rows("SELECT name, host, pid, role, started, heartbeat, expires, slots FROM "
                                            "pixal3d_workers WHERE expires > {now} ORDER BY name"), write=False)
        return [WorkerRow(*r[:7], json.loads(r[7]) if r[7] else []) for r in rows]

    # -- retention ---------------------------------------------------------------------------
    def ended_before(self, seconds: float) -> list[str]:
        """The jobs that ended more than ``seconds`` ago."""
        rows = self._run(lambda tx: tx.rows("SELECT id FROM pixal3d_jobs WHERE status IN ('done', 'failed', "
                                            "'cancelled') AND finished < {now} - ? ORDER BY seq", (seconds,)),
                         write=False)
        return [r[0] for r in rows]

    def remove(self, job_ids: Sequence[str]) -> None:
        """Delete these jobs' rows (their files are the caller's)."""
        if not job_ids:
            return

        def body(tx: Transaction) -> None:
            tx.run(f"DELETE FROM pixal3d_attempts WHERE job IN ({marks(job_ids)})", job_ids)
            tx.run(f"DELETE FROM pixal3d_jobs WHERE id IN ({marks(job_ids)})", job_ids)

        self._run(body, write=True)

    def known(self, job_ids: Sequence[str]) -> set[str]:
        """Which of ``job_ids`` have a row."""
        if not job_ids:
            return set()
        rows = self._run(lambda tx: tx.rows(f"SELECT id FROM pixal3d_jobs WHERE id IN ({marks(job_ids)})", job_ids),
                         write=False)
        return {r[0] for r in rows}

    # -- the workers' side -------------------------------------------------------------------
    def claim(self, owner: str, slot: int, device: str, *, group_size: int, lease: float) -> list[Claim]:
        """The oldest queued job and up to ``group_size - 1`` more queued with its plan, now running under
        ``owner``'s lease (``lease`` seconds from now); [] when nothing waits."""
        return self._run(lambda tx: self._claim(tx, owner, slot, device, group_size=group_size, lease=lease),
                         write=True)

    def _claim(self, tx: Transaction, owner: str, slot: int, device: str, *, group_size: int,
               lease: float) -> list[Claim]:
        first = tx.one("SELECT plan FROM pixal3d_jobs WHERE status = 'queued' ORDER BY seq LIMIT 1{skip_locked}")
        if first is None:
            return []
        rows = tx.rows("SELECT id, attempt, settings, input FROM pixal3d_jobs WHERE status = 'queued' AND plan = ? "
                       "ORDER BY seq LIMIT ?{skip_locked}", (first[0], group_size))
        ids = [r[0] for r in rows]
        tx.run(f"UPDATE pixal3d_jobs SET status = 'running', owner = ?, slot = ?, device = ?, attempt = attempt + 1, "
               f"started = {{now}}, heartbeat = {{now}}, lease_expires = {{now}} + ?, progress = NULL, cancel = 0 "
               f"WHERE id IN ({marks(ids)})", (owner, slot, device, lease, *ids))
        for job_id, attempt, _, _ in rows:
            self._log(tx, job_id, "started", owner, {"attempt": attempt + 1, "group": len(ids), "device": device})
        return [Claim(r[0], r[1] + 1, json.loads(r[2]), r[3]) for r in rows]

    def renew(self, owner: str, held: dict[str, int], lease: float) -> dict[str, bool]:
        """Extend the leases ``owner`` still holds among ``held`` (job → attempt); returns each held job's cancel
        flag. A job missing from the answer was lost (its lease expired and another worker took it, or it ended)."""
        if not held:
            return {}
        ids = list(held)

        def body(tx: Transaction) -> dict[str, bool]:
            rows = tx.rows(f"SELECT id, attempt, cancel FROM pixal3d_jobs WHERE owner = ? AND status = 'running' "
                           f"AND id IN ({marks(ids)}){{for_update}}", (owner, *ids))
            kept = {r[0]: bool(r[2]) for r in rows if held[r[0]] == r[1]}
            if kept:
                tx.run(f"UPDATE pixal3d_jobs SET heartbeat = {{now}}, lease_expires = {{now}} + ? "
                       f"WHERE id IN ({marks(kept)})", (lease, *kept))
            return kept

        return self._run(body, write=True)

    def progress(self, job_id: str, owner: str, attempt: int, progress: dict[str, Any]) -> bool:
        """Where a running job is (stage, step); False when ``owner`` no longer holds it."""
        changed = self._run(lambda tx: tx.run("UPDATE pixal3d_jobs SET progress = ? WHERE id = ? AND owner = ? AND "
                                              "attempt = ? AND status = 'running'",
                                              (json.dumps(progress), job_id, owner, attempt)), write=True)
        return changed == 1

    def holds(self, job_id: str, owner: str, attempt: int) -> bool:
        """Whether ``owner`` still holds this attempt of the job (checked before results are written)."""
        row = self._run(lambda tx: tx.one("SELECT 1 FROM pixal3d_jobs WHERE id = ? AND owner = ? AND attempt = ? "
                                          "AND status = 'running'", (job_id, owner, attempt)), write=False)
        return row is not None

    def stop_reason(self, job_id: str, owner: str, attempt: int) -> str | None:
        """Why ``owner`` should stop this attempt of the job now: ``cancel`` (its flag is up), ``lost`` (it no longer
        holds it), or None. A worker asks at each stage; its heartbeat carries the same news between stages."""
        row = self._run(lambda tx: tx.one("SELECT owner, attempt, status, cancel FROM pixal3d_jobs WHERE id = ?",
                                          (job_id,)), write=False)
        if row is None or (row[0], row[1], row[2]) != (owner, attempt, "running"):
            return "lost"
        return "cancel" if row[3] else None

    def finish(self, job_id: str, owner: str, attempt: int, outcome: dict[str, Any]) -> bool:
        """End the job (``outcome["status"]`` one of ``ENDED``) if ``owner`` still holds this attempt: a job ends
        once, whoever ran it. False: the lease was lost, another worker has the job (or it ended)."""
        def body(tx: Transaction) -> bool:
            changed = tx.run("UPDATE pixal3d_jobs SET status = ?, outcome = ?, finished = {now}, lease_expires = NULL, "
                             "progress = NULL WHERE id = ? AND owner = ? AND attempt = ? AND status = 'running'",
                             (outcome["status"], json.dumps(outcome), job_id, owner, attempt))
            if changed:
                self._log(tx, job_id, "ended", owner, {"attempt": attempt, "status": outcome["status"]})
            return changed == 1

        return self._run(body, write=True)

    def release(self, job_ids: Sequence[str], owner: str, attempts: dict[str, int]) -> None:
        """Give jobs back to the queue unfinished (a group stopped for another job's sake): not a lost lease."""
        def body(tx: Transaction) -> None:
            for job_id in job_ids:
                tx.run("UPDATE pixal3d_jobs SET status = 'queued', owner = NULL, lease_expires = NULL, progress = NULL "
                       "WHERE id = ? AND owner = ? AND attempt = ? AND status = 'running'",
                       (job_id, owner, attempts[job_id]))

        self._run(body, write=True)

    def lose(self, job_ids: Sequence[str], owner: str, attempts: dict[str, int], why: str, *, max_lost: int) -> None:
        """Jobs whose run was lost (the process running them died): each back to the queue, or ended after
        ``max_lost`` losses (cancelled when its flag is up)."""
        def body(tx: Transaction) -> None:
            for job_id in job_ids:
                row = tx.one("SELECT id, lost, cancel FROM pixal3d_jobs WHERE id = ? AND owner = ? AND attempt = ? AND "
                             "status = 'running'{for_update}", (job_id, owner, attempts[job_id]))
                if row is not None:
                    self._lost(tx, row, why, max_lost)

        self._run(body, write=True)

    def reclaim(self, owner: str, why: str, *, max_lost: int) -> list[str]:
        """Every job still running under ``owner``'s name (that worker was restarted: its old process is gone),
        back to the queue at once, each counted as a lost lease; returns their ids."""
        def body(tx: Transaction) -> list[str]:
            rows = tx.rows("SELECT id, lost, cancel FROM pixal3d_jobs WHERE owner = ? AND status = 'running'"
                           "{for_update}", (owner,))
            for row in rows:
                self._lost(tx, row, why, max_lost)
            return [r[0] for r in rows]

        return self._run(body, write=True)

    def reap(self, *, max_lost: int) -> list[str]:
        """Every running job whose lease expired (its worker or machine died, or cannot reach the database): back to
        the queue for another worker, or ended after ``max_lost`` losses; returns their ids."""
        def body(tx: Transaction) -> list[str]:
            rows = tx.rows("SELECT id, lost, cancel, owner FROM pixal3d_jobs WHERE status = 'running' AND "
                           "lease_expires < {now}{skip_locked}")
            for row in rows:
                self._lost(tx, row[:3], f"the lease of worker {row[3]} expired", max_lost)
            return [r[0] for r in rows]

        return self._run(body, write=True)

    def _lost(self, tx: Transaction, row: Sequence[Any], why: str, max_lost: int) -> None:
        job_id, lost, cancel = row[0], row[1] + 1, bool(row[2])
        if cancel or lost >= max_lost:
            outcome = ({"status": "cancelled", "error": "cancelled by DELETE /jobs/{id}"} if cancel else
                       {"status": "failed", "error": f"its worker was lost {lost} times while running it (last: "
                                                     f"{why}); the workers' logs say why"})
            tx.run("UPDATE pixal3d_jobs SET status = ?, outcome = ?, finished = {now}, lost = ?, lease_expires = NULL, "
                   "progress = NULL WHERE id = ?", (outcome["status"], json.dumps(outcome), lost, job_id))
        else:
            tx.run("UPDATE pixal3d_jobs SET status = 'queued', owner = NULL, lost = ?, lease_expires = NULL, "
                   "progress = NULL WHERE id = ?", (lost, job_id))
        logger.warning("job %s: %s (lost %d time%s)", job_id, why, lost, "" if lost == 1 else "s")

    def beat(self, name: str, *, host: str, pid: int, role: str, lease: float, slots: list[dict[str, Any]]) -> None:
        """Say that worker ``name`` is alive for ``lease`` more seconds, with its devices and jobs."""
        self._run(lambda tx: tx.run(
            "INSERT INTO pixal3d_workers (name, host, pid, role, started, heartbeat, expires, slots) "
            "VALUES (?, ?, ?, ?, {now}, {now}, {now} + ?, ?) ON CONFLICT (name) DO UPDATE SET host = excluded.host, "
            "pid = excluded.pid, role = excluded.role, heartbeat = excluded.heartbeat, expires = excluded.expires, "
            "slots = excluded.slots, started = CASE WHEN pixal3d_workers.pid = excluded.pid THEN "
            "pixal3d_workers.started ELSE excluded.started END",
            (name, host, pid, role, lease, json.dumps(slots))), write=True)

    def leave(self, name: str) -> None:
        """Worker ``name`` stopped."""
        self._run(lambda tx: tx.run("DELETE FROM pixal3d_workers WHERE name = ?", (name,)), write=True)

    def _log(self, tx: Transaction, job_id: str, event: str, worker: str | None, detail: dict[str, Any]) -> None:
        tx.run("INSERT INTO pixal3d_attempts (job, time, event, worker, detail) VALUES (?, {now}, ?, ?, ?)",
               (job_id, event, worker, json.dumps(detail)))

    # -- bringing older data in --------------------------------------------------------------
    def adopt(self, job_id: str, submitted: float, settings: dict[str, Any], plan: str, input_name: str,
              outcome: dict[str, Any] | None, attempts: Sequence[dict[str, Any]]) -> bool:
        """Insert a job of an older server's data folder as it was (waiting, or ended with ``outcome``), with its
        attempts; False when it is here already (so a migration that was interrupted can run again)."""
        def body(tx: Transaction) -> bool:
            if tx.one("SELECT 1 FROM pixal3d_jobs WHERE id = ?", (job_id,)) is not None:
                return False
            status = "queued" if outcome is None else outcome["status"]
            tx.run("INSERT INTO pixal3d_jobs (id, submitted, settings, plan, input, status, outcome, finished) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                   (job_id, submitted, json.dumps(settings), plan, input_name, status,
                    json.dumps(outcome) if outcome else None, outcome.get("finished", submitted) if outcome else None))
            for line in attempts:
                detail = {k: v for k, v in line.items() if k not in ("time", "event")}
                tx.run("INSERT INTO pixal3d_attempts (job, time, event, worker, detail) VALUES (?, ?, ?, ?, ?)",
                       (job_id, line.get("time", submitted), line.get("event", "?"), None, json.dumps(detail)))
            return True

        return self._run(body, write=True)
