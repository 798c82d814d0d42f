"""What the queue's database holds, as Python values, and the errors its operations raise (each one line)."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

ENDED = ("done", "failed", "cancelled")
JOB_COLUMNS = ("id", "seq", "submitted", "settings", "plan", "input", "status", "attempt", "lost", "owner", "slot",
               "device", "started", "heartbeat", "lease_expires", "cancel", "progress", "outcome", "finished")


class QueueError(RuntimeError):
    """The queue's database cannot be used; the message is one line saying what to do."""


class QueueUnavailable(QueueError):
    """The database could not be reached within the caller's patience (it is down, or the network is)."""


class QueueFull(QueueError):
    """``queue_size`` jobs wait already."""


class StorageFull(QueueError):
    """The database's disk is full."""


@dataclass
class JobRow:
    """One job's row."""

    id: str
    seq: int
    submitted: float
    settings: dict[str, Any]
    plan: str
    input: str
    status: str
    attempt: int = 0
    lost: int = 0
    owner: str | None = None
    slot: int | None = None
    device: str | None = None
    started: float | None = None
    heartbeat: float | None = None
    lease_expires: float | None = None
    cancel: bool = False
    progress: dict[str, Any] = field(default_factory=dict)
    outcome: dict[str, Any] = field(default_factory=dict)
    finished: float | None = None

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> JobRow:
        values = dict(zip(JOB_COLUMNS, row))
        for name in ("settings", "progress", "outcome"):
            values[name] = json.loads(values[name]) if values[name] else {}
        values["cancel"] = bool(values["cancel"])
        return cls(**values)


@dataclass(frozen=True)
class Claim:
    """A job a worker claimed: run ``attempt`` of it while its lease holds."""

    id: str
    attempt: int
    settings: dict[str, Any]
    input: str


@dataclass
class WorkerRow:
    """A live worker process (its heartbeat within its lease)."""

    name: str
    host: str
    pid: int
    role: str
    started: float
    heartbeat: float
    expires: float
    slots: list[dict[str, Any]]
