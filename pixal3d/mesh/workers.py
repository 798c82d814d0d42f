"""The export's parallel loops: an ordered map over threads or forked processes, never more in flight than workers.

``ordered_map(fn, items, workers)`` yields ``fn(item)`` in the items' order. At most ``workers`` calls run and at
most ``workers`` results wait to be consumed, and ``items`` is read lazily, so a loop over large chunks holds about
``workers`` chunks at a time, as the serial loop holds one. A consumer that writes each result where the serial loop
would, in the same order, gets the serial loop's output whatever ``workers`` is.

Threads suit work that releases the GIL (numpy on large arrays, the KD-tree, torch); ``processes=True`` forks (a
native library that holds the GIL, such as the quadric simplifier): arguments and results are pickled, and where
forking is not safe (``isolated.can_isolate``) the map runs serially here.
"""
from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

MAX_WORKERS = 4  # past 4 the export's loops are bound by memory bandwidth (and by the chunks held at once)


def default_workers() -> int:
    """One per core, at most ``MAX_WORKERS``."""
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


def resolve_workers(workers: int | None = None, *, processes: bool = False) -> int:
    """How many ``ordered_map`` runs at once: ``workers`` (default ``default_workers()``), 1 for processes where
    this process cannot fork. Callers that size their chunks by the workers running together ask here."""
    workers = default_workers() if workers is None else max(1, int(workers))
    if processes:
        from .isolated import can_isolate

        if not can_isolate():
            return 1
    return workers


def ordered_map(fn: Callable[[T], R], items: Iterable[T], workers: int | None = None, *,
                processes: bool = False) -> Iterator[R]:
    """``fn(item)`` for each item, in order, on up to ``workers`` threads (or forked processes)."""
    workers = resolve_workers(workers, processes=processes)
    if workers == 1:
        for item in items:
            yield fn(item)
        return
    if processes:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
    else:
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(workers)
    with pool:
        pending: deque = deque()
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) == workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:  # an error or an abandoned generator: nothing more starts
                future.cancel()
