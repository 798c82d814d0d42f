"""The database under the queue, written once for SQLite and PostgreSQL: a pool of connections, each operation one
transaction retried from its start on a new connection while the database is away (it restarted, the network
dropped) until the caller's patience runs out, and the schema created once and its version checked on every new
connection (a newer one is refused with one line). A subclass connects and names the words its SQL differs in
(``Dialect``); the operations themselves are ``jobs.Queue``'s.

Times are the database's clock (``{now}``), never a machine's own: leases compare across machines whose clocks differ.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from .rows import QueueError, QueueUnavailable
from .schema import SCHEMA_VERSION, schema_statements

logger = logging.getLogger(__name__)

T = TypeVar("T")
DEFAULT: Any = object()
"""``patience`` not given: the queue's own."""


@dataclass(frozen=True)
class Dialect:
    """What the SQL of one database says differently."""

    now: str
    """An expression: the database's clock in seconds since the epoch (float)."""
    skip_locked: str
    """Appended to a SELECT that claims rows: other claimers skip them (``FOR UPDATE SKIP LOCKED``), or nothing."""
    for_update: str
    """Appended to a SELECT whose rows this transaction will change: others wait (``FOR UPDATE``), or nothing."""
    serial_key: str
    """The DDL of ``seq``: an integer key the database assigns in insertion order."""
    marker: str = "?"
    """The parameter marker."""


class Transaction:
    """One transaction's statements (``?`` markers, ``{now}`` and the row locks in the dialect's words)."""

    def __init__(self, cursor: Any, dialect: Dialect):
        self.cursor, self.dialect = cursor, dialect

    def sql(self, text: str) -> str:
        text = text.format(now=self.dialect.now, skip_locked=self.dialect.skip_locked,
                           for_update=self.dialect.for_update)
        return text if self.dialect.marker == "?" else text.replace("?", self.dialect.marker)

    def run(self, text: str, params: Sequence[Any] = ()) -> int:
        """Execute a statement; returns the rows it changed."""
        self.cursor.execute(self.sql(text), tuple(params))
        return self.cursor.rowcount

    def rows(self, text: str, params: Sequence[Any] = ()) -> list[tuple]:
        self.cursor.execute(self.sql(text), tuple(params))
        return list(self.cursor.fetchall())

    def one(self, text: str, params: Sequence[Any] = ()) -> tuple | None:
        rows = self.rows(text, params)
        return rows[0] if rows else None


def marks(values: Sequence[Any]) -> str:
    """``?, ?, ?`` for an ``IN (...)`` of ``values``."""
    return ", ".join("?" for _ in values)


class Engine:
    """The database: a subclass connects (``_connect``) and names its ``dialect``.

    patience: seconds an operation keeps retrying while the database cannot be reached, then ``QueueUnavailable``
              (None: until it comes back; what workers use)
    """

    dialect: Dialect
    kind = "database"

    def __init__(self, *, patience: float | None = 10.0):
        self.patience = patience
        self._idle: list[Any] = []
        self._lock = threading.Lock()
        self._outage: float | None = None
        self._run(self._ensure_schema, write=True, patience=patience)

    # -- what a subclass provides ------------------------------------------------------------
    def _connect(self) -> Any:
        """A new connection (autocommit: ``_transaction`` opens each transaction itself)."""
        raise NotImplementedError

    @contextmanager
    def _transaction(self, connection: Any, write: bool) -> Iterator[Transaction]:
        raise NotImplementedError

    def _transient(self, err: BaseException) -> bool:
        """Whether ``err`` means the connection or the database went away (retry on a new connection)."""
        raise NotImplementedError

    def _failure(self, err: BaseException) -> QueueError | None:
        """``err`` as a one-line ``QueueError`` when the user can act on it (a full disk), else None."""
        return None

    def _has_schema(self, tx: Transaction) -> bool:
        raise NotImplementedError

    def _serialize(self, tx: Transaction) -> None:
        """Make this transaction the only one of its kind at a time (a database that locks rows, not files)."""

    def describe(self) -> str:
        """Where the queue is, for messages (no password)."""
        return self.kind

    # -- transactions, retried ---------------------------------------------------------------
    def _run(self, body: Callable[[Transaction], T], *, write: bool, patience: float | None = DEFAULT) -> T:
        """``body`` in one transaction, retried from the start on a new connection while the database is away."""
        patience = self.patience if patience is DEFAULT else patience
        deadline = None if patience is None else time.monotonic() + patience
        pause = 0.1
        while True:
            connection = None
            try:
                connection = self._checkout()
                with self._transaction(connection, write) as tx:
                    result = body(tx)
                self._checkin(connection)
                if self._outage is not None:
                    logger.warning("the queue database %s answers again (after %.1f s)", self.describe(),
                                   time.monotonic() - self._outage)
                    self._outage = None
                return result
            except Exception as err:
                if connection is not None:
                    self._discard(connection)
                failure = self._failure(err)
                if failure is not None:
                    raise failure from None
                if not self._transient(err):
                    raise
                if self._outage is None:
                    self._outage = time.monotonic()
                    logger.warning("the queue database %s cannot be reached (%s); retrying", self.describe(),
                                   " ".join(str(err).split()) or type(err).__name__)
                if deadline is not None and time.monotonic() + pause > deadline:
                    raise QueueUnavailable(f"the queue database {self.describe()} cannot be reached ("
                                           f"{' '.join(str(err).split()) or type(err).__name__}); retry later"
                                           ) from None
                time.sleep(pause)
                pause = min(2.0, pause * 2)

    def _checkout(self) -> Any:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        connection = self._connect()
        try:
            self._check_version(connection)
        except BaseException:
            self._discard(connection)
            raise
        return connection

    def _checkin(self, connection: Any) -> None:
        with self._lock:
            self._idle.append(connection)

    def _discard(self, connection: Any) -> None:
        try:
            connection.close()
        except Exception as err:  # noqa: BLE001 - a broken connection may fail to close; it is dropped either way
            logger.debug("closing a broken connection: %s", err)

    def close(self) -> None:
        """Close every idle connection (one in use is closed when it comes back broken, or by the process's end)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            self._discard(connection)

    # -- the schema --------------------------------------------------------------------------
    def _ensure_schema(self, tx: Transaction) -> None:
        """Create the tables unless they are there, and refuse a newer schema. Processes started at once on an empty
        database race here (a fleet's compose file, systemd): each statement is ``IF NOT EXISTS`` and the version row
        ``ON CONFLICT DO NOTHING``, so the ones that lose the race find the winner's tables, whatever their own
        catalog caches still say."""
        self._serialize(tx)
        if not self._has_schema(tx):
            for statement in schema_statements(self.dialect.serial_key):
                tx.run(statement)
            tx.run("INSERT INTO pixal3d_meta (key, value) VALUES ('schema', ?) ON CONFLICT (key) DO NOTHING",
                   (str(SCHEMA_VERSION),))
        self._refuse_newer(tx)

    def _check_version(self, connection: Any) -> None:
        """A new connection reads the schema's version first: a newer server may have upgraded it meanwhile."""
        with self._transaction(connection, False) as tx:
            if self._has_schema(tx):
                self._refuse_newer(tx)

    def _refuse_newer(self, tx: Transaction) -> None:
        row = tx.one("SELECT value FROM pixal3d_meta WHERE key = 'schema'")
        version = int(row[0]) if row else 0
        if version > SCHEMA_VERSION:
            raise QueueError(f"the queue database {self.describe()} has schema version {version}, newer than this "
                             f"pixal3d-serve's {SCHEMA_VERSION}: upgrade pixal3d on this machine (every machine on "
                             f"one queue runs the same version)")

    def schema_version(self) -> int:
        row = self._run(lambda tx: tx.one("SELECT value FROM pixal3d_meta WHERE key = 'schema'"), write=False)
        return int(row[0])
