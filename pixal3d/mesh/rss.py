"""Peak resident memory over a window of code, for the export's per-step report.

Two ways: a background thread sampling RSS (psutil) every few ms (default: no side effects, may miss
spikes shorter than the interval), or ``exact=True`` on Linux, which resets the kernel's high-water
mark (write ``5`` to ``/proc/self/clear_refs``) and reads ``VmHWM`` at the end. The reset is
process-wide: afterwards ``VmHWM`` and ``getrusage().ru_maxrss`` only cover the last window, so use it
in benchmarks, not under a telemetry reader that relies on them.
"""
from __future__ import annotations

import threading

import psutil

from pixal3d.telemetry.linux import process_memory, reset_peak


def _read_hwm() -> int | None:
    return process_memory()[1]


def _reset_hwm() -> bool:
    return reset_peak() and _read_hwm() is not None


class PeakRss:
    """Context manager; ``.peak`` is the process's peak RSS (bytes) inside the ``with`` block."""

    def __init__(self, *, exact: bool = False, interval: float = 0.005) -> None:
        self.interval = interval
        self.want_exact = exact
        self.peak = 0
        self._exact = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRss:
        self._exact = self.want_exact and _reset_hwm()
        self.peak = psutil.Process().memory_info().rss
        if not self._exact:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        process = psutil.Process()
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, process.memory_info().rss)

    def __exit__(self, *exc) -> None:
        if self._exact:
            self.peak = max(self.peak, _read_hwm() or 0)
        else:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            self.peak = max(self.peak, psutil.Process().memory_info().rss)

