"""MemoryMeter: samples memory in a background thread, records every registry event, and reads
exact peaks at each stage boundary so a spike shorter than the sampling period is not lost."""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, Self

from .trace import StageRow, Summary, TraceWriter, summarize

logger = logging.getLogger(__name__)

# Events after which the meter reads (and resets) the exact peaks: window boundaries.
_BOUNDARY_KINDS = ("stage", "mark", "release")


class Probe(Protocol):
    """What the meter reads; :class:`pixal3d.telemetry.readers.MemoryProbe` is the real one."""

    def sample(self) -> dict[str, float | int]: ...

    def peaks(self) -> dict[str, int]: ...


def event_dict(event: Any) -> dict[str, Any]:
    """A registry event as a dict: an object with ``to_dict()`` or a mapping with ``kind``."""
    data = event.to_dict() if hasattr(event, "to_dict") else dict(event)
    if "kind" not in data:
        raise ValueError(f"not a registry event (no 'kind'): {data!r}")
    return data


class MemoryMeter:
    """Context manager that writes a JSONL memory trace (or keeps it in memory when the path is None).

    Use ``meter.on_event`` as the registry's event sink; ``meter.mark(name)`` opens a named window
    without a registry; ``meter.report()`` gives the per-stage rows."""

    def __init__(self, trace_path: Path | None, *, interval: float = 0.25, device: Any = None,
                 meta: dict[str, Any] | None = None, probe: Probe | None = None):
        if not interval > 0:
            raise ValueError(f"interval must be more than zero seconds, got {interval!r}")
        self.trace_path = Path(trace_path) if trace_path is not None else None
        self.interval = interval
        self.device = device
        self.meta = dict(meta or {})
        self.records: list[dict[str, Any]] = []
        self._probe = probe
        self._writer: TraceWriter | None = None
        self._t0 = 0.0
        self._last_reset = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_error: str | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> Self:
        if self._probe is None:
            from .readers import MemoryProbe

            self._probe = MemoryProbe(self.device)
        self._writer = TraceWriter(self.trace_path)
        self._t0 = time.time()
        self._write({"type": "start", "time": self._t0,
                     "utc": datetime.fromtimestamp(self._t0, UTC).isoformat(timespec="seconds"),
                     "interval": self.interval, "pid": os.getpid(), "platform": sys.platform,
                     **({"device": str(self.device)} if self.device is not None else {}), **self.meta})
        self._read_peaks(write=False)
        self._sample()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="pixal3d-meter", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._read_peaks(write=True)
        self._sample()
        end: dict[str, Any] = {"type": "end", "t": self._now()}
        if exc_type is not None:  # the run being measured failed; the trace is still complete
            end["error"] = exc_type.__name__
        self._write(end)
        if self._writer is not None:
            self._writer.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    # -- recording -------------------------------------------------------------------------------
    def _now(self, at: float | None = None) -> float:
        return round((time.time() if at is None else at) - self._t0, 6)

    def _write(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.records.append(record)
        if self._writer is not None:
            self._writer.write(record)

    def _guarded(self, read: Any) -> dict[str, Any] | None:
        """Run a probe read; a failure becomes one ``error`` record per distinct failure streak."""
        try:
            values = read()
        except Exception as error:  # noqa: BLE001 - a failing counter must not stop the run
            message = f"{type(error).__name__}: {error}"
            if message != self._last_error:
                self._write({"type": "error", "t": self._now(), "error": message})
                logger.warning("memory meter: %s", message)
            self._last_error = message
            return None
        self._last_error = None
        return values

    def _sample(self) -> None:
        t = self._now()
        values = self._guarded(self._probe.sample)
        if values is not None:
            self._write({"type": "sample", "t": t, **values})

    def _read_peaks(self, *, write: bool) -> None:
        t = self._now()
        values = self._guarded(self._probe.peaks)
        if write and values:
            self._write({"type": "peak", "t": t, "since": self._last_reset, **values})
        self._last_reset = t

    def on_event(self, event: Any) -> None:
        """Registry event sink: record the event; at window boundaries read the exact peaks first."""
        data = event_dict(event)
        if self._thread is None:
            logger.warning("memory meter is not running; event %s dropped", data.get("kind"))
            return
        if data["kind"] in _BOUNDARY_KINDS:
            self._read_peaks(write=True)
        fields = {k: v for k, v in data.items() if k != "time" and v is not None and v != ""}
        self._write({"type": "event", "t": self._now(data.get("time")), **fields})

    def mark(self, name: str) -> None:
        """Open a window called ``name`` without a registry (e.g. the export step)."""
        self.on_event({"kind": "mark", "stage": name, "model": None, "time": time.time()})

    # -- results ---------------------------------------------------------------------------------
    def summary(self) -> Summary:
        """Whole-run summary of what has been recorded so far."""
        with self._lock:
            records = list(self.records)
        return summarize(records)

    def report(self) -> list[StageRow]:
        """Per-stage rows: peak process and device bytes, bytes loaded, load and stage seconds."""
        return self.summary().rows

    stage_rows = report
