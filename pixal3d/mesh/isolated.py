"""Run an export step in a short-lived child process, so that memory a native library keeps goes back when it exits.

fast_simplification (Fast-Quadric-Mesh-Simplification) holds its working arrays in global C++ vectors whose
capacity is never given back: after simplifying a decoded surface of tens of millions of faces the exporting
process would keep about 1 GB of them, beside every later step (the bake's and the metrics' peaks), until it
exits. A forked child runs the step and exits; its inputs are shared with this process copy-on-write (nothing
is copied), its result (the simplified mesh, megabytes) comes back through a pipe. The step computes the same
thing either way: the same code on the same arrays. The slab remesh runs in one too (its distance index and slabs
would leave this process's heap fragmented for the later steps), and with one worker each of its slabs in another.

Only on Linux, and only where forking is safe: not on macOS (frameworks such as Metal do not survive a fork
without exec), not where a CUDA context is live. Elsewhere, or with ``isolate=False``, the step runs here.
"""
from __future__ import annotations

import gc
import os
import pickle
import signal
import sys
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class IsolatedStepError(RuntimeError):
    """The child process running an isolated step died without a result (killed for memory, say)."""


def can_isolate() -> bool:
    """Whether steps can run in a forked child here (Linux, no live CUDA context)."""
    if not sys.platform.startswith("linux"):
        return False
    if "torch" not in sys.modules:
        return True
    from pixal3d.devices import forks_safely

    return forks_safely()


def run_isolated(step: Callable[..., T], *args: Any, isolate: bool = True) -> T:
    """``step(*args)`` in a forked child when ``isolate`` and ``can_isolate()``, else here; its result either way.
    An exception the step raises is raised here; a child that dies is an ``IsolatedStepError`` naming how."""
    if not (isolate and can_isolate()):
        return step(*args)
    read, write = os.pipe()
    # the objects so far out of the collector's sight while forking: a collection in the child then writes to none
    # of their gc headers, so their pages stay shared with this process instead of being copied into the child
    gc.freeze()
    try:
        pid = os.fork()
    except BaseException:
        gc.unfreeze()
        raise
    if pid != 0:
        gc.unfreeze()
    if pid == 0:  # the child: run, send (ok, value) back, exit without running the parent's cleanup
        os.close(read)
        code = 0
        try:
            try:
                payload = pickle.dumps((True, step(*args)), protocol=pickle.HIGHEST_PROTOCOL)
            except BaseException as err:  # noqa: BLE001 -- every failure goes back to the parent, which raises it
                payload = pickle.dumps((False, err), protocol=pickle.HIGHEST_PROTOCOL)
            with os.fdopen(write, "wb") as pipe:
                pipe.write(payload)
        except BaseException:  # noqa: BLE001 -- a child never returns into the parent's code
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as pipe:
            payload = pipe.read()
    except BaseException:  # interrupted here (Ctrl-C, SIGTERM): the child stops too
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    _, status = os.waitpid(pid, 0)
    if not payload:
        how = (f"killed by {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status)
               else f"exit status {os.WEXITSTATUS(status)}")
        raise IsolatedStepError(f"the child process running {getattr(step, '__name__', 'a step')} ended without a "
                                f"result ({how}); if it was killed for memory, give the export more")
    ok, value = pickle.loads(payload)
    if not ok:
        raise value
    return value
