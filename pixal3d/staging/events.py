"""Events the staging registry emits: what was loaded, released or entered, and what it cost."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

EVENT_KINDS = ("load", "release", "reload", "stage", "outside_stage")

EventSink = Callable[["Event"], None]


@dataclass(frozen=True)
class Event:
    """One registry happening.

    ``kind`` is one of ``EVENT_KINDS``; ``bytes`` are the storage bytes loaded or freed and
    ``seconds`` how long that took; ``time`` is the wall clock (``time.time()``) at emission.
    ``note`` says something a kind alone cannot (e.g. a model parked in host memory, not freed).
    """

    kind: str
    model: str | None = None
    stage: str | None = None
    bytes: int = 0
    seconds: float = 0.0
    time: float = field(default_factory=time.time)
    note: str = ""

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {self.kind!r}; expected one of {list(EVENT_KINDS)}")

    def to_dict(self) -> dict:
        """The event as a JSON-ready dict (every field, in declaration order)."""
        return dataclasses.asdict(self)


class EventLog:
    """A sink that keeps every event in a list (for tests and short runs)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)

    def kinds(self) -> list[str]:
        """The kinds of the events so far, in order."""
        return [e.kind for e in self.events]

    def of_kind(self, kind: str) -> list[Event]:
        """The events of one kind, in order."""
        return [e for e in self.events if e.kind == kind]
