"""The queue in SQLite (Python's own ``sqlite3``): one file, by default ``DATA/queue.sqlite3``, in WAL mode so that
readers never wait for the writer, every commit flushed to disk (``synchronous=FULL``: a job acknowledged with 202
survives a power loss). Writers take the file's lock for the whole transaction (``BEGIN IMMEDIATE``), so a claim is
one at a time without row locks. Several processes of one machine share it (an API and workers started apart); a
queue for several machines is PostgreSQL's job, since SQLite's locks do not hold over a network file system.
"""
from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .engine import Dialect, Transaction
from .jobs import Queue
from .rows import QueueError, StorageFull

BUSY_MS = 30_000
"""How long a statement waits for another process's write lock before it counts as a transient failure."""


class SqliteQueue(Queue):
    """The queue in the SQLite file at ``path``."""

    kind = "sqlite"
    dialect = Dialect(now="((julianday('now') - 2440587.5) * 86400.0)", skip_locked="", for_update="",
                      serial_key="INTEGER PRIMARY KEY AUTOINCREMENT")

    def __init__(self, path: str | Path, *, patience: float | None = 10.0):
        self.path = Path(path)
        super().__init__(patience=patience)

    def describe(self) -> str:
        return str(self.path)

    def _connect(self) -> sqlite3.Connection:
        connection = sqlite3.connect(self.path, timeout=BUSY_MS / 1000, isolation_level=None, check_same_thread=False)
        connection.execute(f"PRAGMA busy_timeout = {BUSY_MS}")
        connection.execute("PRAGMA journal_mode = WAL")
        connection.execute("PRAGMA synchronous = FULL")
        return connection

    @contextmanager
    def _transaction(self, connection: sqlite3.Connection, write: bool) -> Iterator[Transaction]:
        connection.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            yield Transaction(connection.cursor(), self.dialect)
        except BaseException:
            try:
                connection.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            raise
        connection.execute("COMMIT")

    def _transient(self, err: BaseException) -> bool:
        return isinstance(err, sqlite3.OperationalError) and any(
            word in str(err) for word in ("locked", "busy"))

    def _failure(self, err: BaseException) -> QueueError | None:
        if not isinstance(err, sqlite3.Error) or self._transient(err):
            return None
        text = str(err)
        if "full" in text:
            return StorageFull(f"the disk of the queue database {self.path} is full ({text}); free some space")
        if isinstance(err, (sqlite3.OperationalError, sqlite3.DatabaseError)) and not isinstance(
                err, (sqlite3.IntegrityError, sqlite3.ProgrammingError)):
            return QueueError(f"the queue database {self.path} cannot be used ({text})")
        return None

    def _has_schema(self, tx: Transaction) -> bool:
        return tx.one("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'pixal3d_meta'") is not None

