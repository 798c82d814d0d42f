"""The job server's queue in a database (``jobs.Queue`` over ``engine.Engine``): SQLite (``sqlite.py``, one file in ``--data``, the
default) or PostgreSQL (``postgres.py``, ``--queue postgresql://...``, one queue for several machines).
``open_queue`` picks one from ``--queue``."""
from __future__ import annotations

from pathlib import Path

from .jobs import Queue
from .rows import (
    ENDED,
    Claim,
    JobRow,
    QueueError,
    QueueFull,
    QueueUnavailable,
    StorageFull,
    WorkerRow,
)
from .schema import SCHEMA_VERSION

SQLITE_FILE = "queue.sqlite3"
"""The default queue: this file in the data folder."""

__all__ = ["ENDED", "SCHEMA_VERSION", "SQLITE_FILE", "Claim", "JobRow", "Queue", "QueueError", "QueueFull",
           "QueueUnavailable", "StorageFull", "WorkerRow", "open_queue", "queue_url"]


def queue_url(url: str | None, data: Path) -> str:
    """``--queue`` as a URL: as given, or ``sqlite:///DATA/queue.sqlite3`` when it is not given."""
    return url if url else f"sqlite:///{Path(data).absolute() / SQLITE_FILE}"


def open_queue(url: str | None, data: Path, *, patience: float | None = 10.0) -> Queue:
    """The queue ``--queue`` names (None: SQLite in ``data``), its schema created or checked; ``QueueError`` (one
    line) when it cannot be used. ``patience``: seconds an operation retries while the database is away (None:
    until it is back)."""
    url = queue_url(url, data)
    if url.startswith(("postgresql://", "postgres://")):
        from .postgres import PostgresQueue

        return PostgresQueue(url, patience=patience)
    if url.startswith("sqlite:///"):
        from .sqlite import SqliteQueue

        return SqliteQueue(Path(url[len("sqlite:///"):]), patience=patience)
    raise QueueError(f"--queue {url.split('@')[-1]!r} is not a queue: give postgresql://user@host:5432/dbname, "
                     f"sqlite:///PATH, or nothing (SQLite in --data)")
