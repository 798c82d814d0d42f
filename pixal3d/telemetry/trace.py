"""The JSONL memory trace: writing it line by line, reading it back, and cutting it into stage windows.

Records, one JSON object per line (``t`` is seconds since the ``start`` record's ``time``):

- ``start``: ``time`` (Unix seconds), ``utc``, ``interval``, ``pid`` and caller metadata.
- ``sample``: counters in bytes (``process``, ``available``, ``swap_used``, ``device``, ...).
- ``peak``: exact peaks (``process_peak``, ``device_peak``) over ``[since, t]``, read and reset at
  stage boundaries, releases and the end, so a spike between two samples is not lost.
- ``event``: a registry event (``kind``, ``model``, ``stage``, ``bytes``, ``seconds``).
- ``error``: a counter that could not be read (``error``); ``end``: the meter stopped cleanly.

Stage windows: the time before the first stage is ``setup``. A ``stage`` (or ``mark``) event opens
the window of that stage. The registry releases the previous stage's models *before* emitting the
``stage`` event, so a run of ``release`` events directly before a ``stage`` event is a transition
that belongs to no stage: the new window starts when that release has finished.
"""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SETUP = "setup"
WINDOW_KINDS = ("stage", "mark")
LOAD_KINDS = ("load", "reload")


class TraceWriter:
    """Appends records to a JSONL file, one flushed line each, so a killed run leaves a usable trace.

    The trace is a diagnostic beside the run, never a reason to stop it: if the file cannot be opened or
    written (a full disk, a removed folder), one warning names it and the rest of the records are only
    kept in memory."""

    def __init__(self, path: Path | None):
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._handle = None
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._handle = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - open until close()
            except OSError as error:
                self._give_up(error)

    def write(self, record: dict[str, Any]) -> None:
        """Write one record as a line and flush it."""
        if self._handle is None:
            return
        line = json.dumps(record, separators=(",", ":"))
        with self._lock:
            if self._handle is None:
                return
            try:
                self._handle.write(line + "\n")
                self._handle.flush()
            except OSError as error:
                self._give_up(error)

    def close(self) -> None:
        """Close the file (idempotent)."""
        with self._lock:
            if self._handle is not None:
                try:
                    self._handle.close()
                except OSError as error:
                    self._give_up(error)
                self._handle = None

    def _give_up(self, error: OSError) -> None:
        logger.warning("memory trace %s: %s; the trace stops here, the run goes on", self.path,
                       error.strerror or error)
        handle, self._handle = self._handle, None
        if handle is not None:
            try:
                handle.close()
            except OSError:
                pass  # its buffered lines could not be written either: already reported


def read_trace(path: Path) -> list[dict[str, Any]]:
    """All records of a trace. A half-written last line (a killed run) is skipped; a broken line anywhere
    else, a line that is not a record (a JSON object with a string ``type``, numbers where numbers belong)
    or a trace with no record at all raises ValueError naming the file and the line."""
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines) and records:
                break
            raise ValueError(f"{path}:{number} is not a JSON trace record ({error}); the trace is "
                             "damaged before its last line, so it cannot be summarised") from None
        _check_record(record, f"{path}:{number}")
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no records (it is empty); is it a memory trace (the JSONL a MemoryMeter writes)?")
    if records[0].get("type") != "start":
        raise ValueError(f"{path} does not begin with a 'start' record; is it a memory trace?")
    return records


_NUMBERS = ("t", "time", "since", "interval")  # in any record
_TIMED = ("sample", "peak", "event", "error", "end")  # records placed on the time axis: they need a "t"


def _check_record(record: Any, where: str) -> None:
    """ValueError unless ``record`` has the shape the summary relies on."""
    if not isinstance(record, dict):
        raise ValueError(f"{where} is not a JSON object ({type(record).__name__}); a trace record looks like "
                         f'{{"type": "sample", "t": 1.5, ...}}')
    kind = record.get("type")
    if not isinstance(kind, str):
        raise ValueError(f"{where}: 'type' must be a string, got {kind!r}")
    if kind in _TIMED and "t" not in record:
        raise ValueError(f"{where}: a '{kind}' record needs a time 't'")
    for key, value in record.items():
        number = (key in _NUMBERS or (kind in ("sample", "peak") and key != "type")
                  or (kind == "event" and key in ("bytes", "seconds")))
        if number and value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{where}: '{key}' must be a number, got {value!r}")
        if kind == "event" and key in ("kind", "model", "stage") and value is not None and not isinstance(value, str):
            raise ValueError(f"{where}: '{key}' must be a string, got {value!r}")


@dataclass
class StageRow:
    """One stage window: its duration, peaks (bytes) and the loads and releases inside it."""

    stage: str
    start: float
    seconds: float
    peak_process: int | None = None
    peak_device: int | None = None
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    loads: int = 0
    released_bytes: int = 0
    releases: int = 0
    exact_peak: bool = False
    samples: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


@dataclass
class Summary:
    """Per-stage rows plus whole-run totals of one trace."""

    meta: dict[str, Any]
    rows: list[StageRow]
    duration: float
    peak_process: int | None
    peak_device: int | None
    swap: dict[str, int | None]
    loads: dict[str, float]
    releases: dict[str, float]
    outside_stage: list[str]
    complete: bool
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        data = asdict(self)
        data["rows"] = [row.to_dict() for row in self.rows]
        return data


@dataclass
class _Segment:
    name: str | None  # None: a transition (release of the previous stage's models)
    start: float
    opener: int | None = None  # index of the event that opened it
    end: float = float("inf")


def _segments(events: list[dict[str, Any]], end: float) -> list[_Segment]:
    """Windows and transitions, in time order, from the event records."""
    segments = [_Segment(SETUP, 0.0)]
    release: tuple[int, float] | None = None  # first release of a run: (event index, start)
    for index, event in enumerate(events):
        kind = event.get("kind")
        if kind == "release":
            if release is None:
                began = event["t"] - float(event.get("seconds") or 0.0)
                release = (index, max(began, segments[-1].start))
        elif kind in WINDOW_KINDS:
            name = event.get("stage") or "?"
            if name != segments[-1].name:
                if release is not None:
                    segments.append(_Segment(None, release[1], opener=release[0]))
                segments.append(_Segment(name, event["t"], opener=index))
            release = None
        else:
            release = None
    for current, following in pairwise(segments):
        current.end = following.start
    segments[-1].end = max(end, segments[-1].start)
    return segments


def _locate(segments: list[_Segment], t: float) -> int:
    """Index of the segment holding time t (start inclusive; the last one also holds its end)."""
    for index, segment in enumerate(segments):
        if segment.start <= t < segment.end:
            return index
    return len(segments) - 1 if t >= segments[-1].start else 0


def peak_of(*values: int | None) -> int | None:
    """The largest known value, or None when none is known."""
    known = [value for value in values if value is not None]
    return max(known) if known else None


def summarize(records: Iterable[dict[str, Any]]) -> Summary:
    """Cut a trace into stage windows and total its loads, releases, peaks and swap."""
    records = list(records)
    start = next((r for r in records if r.get("type") == "start"), {})
    meta = {k: v for k, v in start.items() if k != "type"}
    events = [r for r in records if r.get("type") == "event"]
    samples = [r for r in records if r.get("type") == "sample"]
    end = max((r["t"] for r in records if "t" in r), default=0.0)
    segments = _segments(events, end)
    rows = [StageRow(s.name, s.start, s.end - s.start) for s in segments]

    for sample in samples:
        row = rows[_locate(segments, sample["t"])]
        row.samples += 1
        row.peak_process = peak_of(row.peak_process, sample.get("process"))
        row.peak_device = peak_of(row.peak_device, sample.get("device"))
    # A peak record is written just before the event that ended its interval, so it belongs to
    # the segment open at that point of the record stream (a transition's peaks go nowhere).
    openers = {segment.opener: index for index, segment in enumerate(segments)}
    current, event_index = 0, -1
    for record in records:
        if record.get("type") == "event":
            event_index += 1
            current = openers.get(event_index, current)
            continue
        if record.get("type") != "peak":
            continue
        peak, row = record, rows[current]
        row.peak_process = peak_of(row.peak_process, peak.get("process_peak"))
        row.peak_device = peak_of(row.peak_device, peak.get("device_peak"))
        row.exact_peak = row.exact_peak or "process_peak" in peak or "device_peak" in peak
    for event in events:  # charged where the load or release began
        row = rows[_locate(segments, event["t"] - float(event.get("seconds") or 0.0))]
        if event.get("kind") in LOAD_KINDS:
            row.loads += 1
            row.loaded_bytes += int(event.get("bytes") or 0)
            row.load_seconds += float(event.get("seconds") or 0.0)
        elif event.get("kind") == "release":
            row.releases += 1
            row.released_bytes += int(event.get("bytes") or 0)

    kept = [row for seg, row in zip(segments, rows) if seg.name is not None
            and not (seg.name == SETUP and row.seconds == 0 and not row.samples and not row.loads)]
    swaps = [s["swap_used"] for s in samples if "swap_used" in s]
    loads = [e for e in events if e.get("kind") in LOAD_KINDS]
    releases = [e for e in events if e.get("kind") == "release"]
    return Summary(
        meta=meta,
        rows=kept,
        duration=end,
        peak_process=peak_of(*(row.peak_process for row in rows)),
        peak_device=peak_of(*(row.peak_device for row in rows)),
        swap={"start": swaps[0] if swaps else None, "peak": max(swaps) if swaps else None,
              "end": swaps[-1] if swaps else None},
        loads={"count": len(loads), "bytes": sum(int(e.get("bytes") or 0) for e in loads),
               "seconds": round(sum(float(e.get("seconds") or 0.0) for e in loads), 3)},
        releases={"count": len(releases), "bytes": sum(int(e.get("bytes") or 0) for e in releases)},
        outside_stage=sorted({e.get("model") or "?" for e in events
                              if e.get("kind") == "outside_stage"}),
        complete=any(r.get("type") == "end" for r in records),
        errors=[r.get("error", "") for r in records if r.get("type") == "error"],
    )
