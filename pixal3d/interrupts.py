"""SIGTERM and SIGHUP as an exception, the way Python already turns SIGINT into ``KeyboardInterrupt``.

Their default action ends the process on the spot: no ``finally`` runs, so an atomic write leaves its
temporary file and a lock its lock file. ``kill``, ``timeout``, systemd, a closed terminal (SIGHUP) and
``pixal3d-guard`` all stop a run this way. Inside ``terminate_as_exception()`` the first such signal raises
``Terminated`` in the main thread instead, so every cleanup runs on the way out; the exit code a shell
expects is ``128 + signum`` (143 for SIGTERM, 129 for SIGHUP; 130 for SIGINT).
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

HANDLED = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class Terminated(BaseException):
    """The process was asked to stop by a signal (a ``BaseException``, like ``KeyboardInterrupt``, so
    ``except Exception`` blocks do not swallow it)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = int(signum)

    @property
    def exit_code(self) -> int:
        """``128 + signum``, what a shell reports for a process ended by that signal."""
        return 128 + self.signum


@contextmanager
def terminate_as_exception() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise ``Terminated`` (once; a repeat while the first unwinds
    is ignored, so the cleanup it triggers is not itself cut short). Previous handlers are restored on
    exit. Outside the main thread (where handlers cannot be installed) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal raised
        if not raised:
            raised = True
            raise Terminated(signum)

    previous = {signum: signal.signal(signum, handler) for signum in HANDLED}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old if old is not None else signal.SIG_DFL)
