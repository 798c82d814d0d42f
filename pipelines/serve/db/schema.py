"""The queue's tables (prefixed ``pixal3d_``, so the queue can share a database with other things), version
``SCHEMA_VERSION`` (kept in ``pixal3d_meta``):

- ``pixal3d_jobs``: one row a job. ``seq`` orders the queue; ``plan`` is what a group shares (every setting but the
  seed); ``status`` is ``queued``, ``running`` (``owner`` holds a lease until ``lease_expires``, renewed by its
  heartbeat; ``attempt`` counts the claims and fences a lost owner out), or how it ended (``outcome``, ``finished``);
  ``lost`` counts the leases lost while running it; ``cancel`` is the flag a ``DELETE`` raises for the owner.
- ``pixal3d_attempts``: one row each time a worker started or ended a job.
- ``pixal3d_workers``: each worker process's name, host, pid, devices and jobs, alive while ``expires`` is ahead.
"""
from __future__ import annotations

SCHEMA_VERSION = 1


def schema_statements(serial_key: str) -> list[str]:
    """The tables of schema version ``SCHEMA_VERSION``; ``serial_key``: the database's words for an integer key it
    assigns in insertion order. Every statement is ``IF NOT EXISTS``: processes started together on an empty
    database each run them (under the schema lock), and a table another one just committed is left as it is."""
    real = "DOUBLE PRECISION"
    jobs = (f"CREATE TABLE IF NOT EXISTS pixal3d_jobs (seq {serial_key}, id TEXT NOT NULL UNIQUE, "
            f"submitted {real} NOT NULL, settings TEXT NOT NULL, plan TEXT NOT NULL, input TEXT NOT NULL, "
            f"status TEXT NOT NULL, "
            f"attempt INTEGER NOT NULL DEFAULT 0, lost INTEGER NOT NULL DEFAULT 0, owner TEXT, slot INTEGER, "
            f"device TEXT, started {real}, heartbeat {real}, lease_expires {real}, cancel INTEGER NOT NULL DEFAULT 0, "
            f"progress TEXT, outcome TEXT, finished {real})")
    attempts = (f"CREATE TABLE IF NOT EXISTS pixal3d_attempts (n {serial_key}, job TEXT NOT NULL, "
                f"time {real} NOT NULL, event TEXT NOT NULL, worker TEXT, detail TEXT)")
    workers = (f"CREATE TABLE IF NOT EXISTS pixal3d_workers (name TEXT PRIMARY KEY, host TEXT NOT NULL, "
               f"pid INTEGER NOT NULL, role TEXT NOT NULL, started {real} NOT NULL, heartbeat {real} NOT NULL, "
               f"expires {real} NOT NULL, slots TEXT)")
    return [
        "CREATE TABLE IF NOT EXISTS pixal3d_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        jobs,
        "CREATE INDEX IF NOT EXISTS pixal3d_jobs_status ON pixal3d_jobs (status, seq)",
        "CREATE INDEX IF NOT EXISTS pixal3d_jobs_owner ON pixal3d_jobs (owner)",
        attempts,
        "CREATE INDEX IF NOT EXISTS pixal3d_attempts_job ON pixal3d_attempts (job)",
        workers,
    ]
