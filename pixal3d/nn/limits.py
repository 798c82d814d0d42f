"""Chunk sizes of the query-chunked kernels (attention's score chunks, NAF's gathered values), per thread.

A stage fitted to a memory budget runs inside ``kernel_limits(...)``; the kernels read the limits through
``current_limits()``. The limits live in a ``contextvars.ContextVar``, not a module global, so two pipelines
in one process (two threads of a server, a notebook) each see only their own stage's limits.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelLimits:
    """``attention_scores``: score elements per attention query chunk (256 MiB in fp32); ``naf_elements``:
    gathered value elements per NAF attention chunk (32 MiB in fp32)."""

    attention_scores: int = 1 << 26
    naf_elements: int = 1 << 23


_LIMITS: ContextVar[KernelLimits] = ContextVar("pixal3d_kernel_limits", default=KernelLimits())


def current_limits() -> KernelLimits:
    """The limits the kernels use now, in this thread (the defaults outside ``kernel_limits``)."""
    return _LIMITS.get()


@contextlib.contextmanager
def kernel_limits(*, attention_scores: int | None = None, naf_elements: int | None = None) -> Iterator[None]:
    """Run a block with other chunk sizes (the ones not given stay); restored on exit, seen by this thread only."""
    changes = {k: v for k, v in (("attention_scores", attention_scores), ("naf_elements", naf_elements))
               if v is not None}
    token = _LIMITS.set(dataclasses.replace(_LIMITS.get(), **changes))
    try:
        yield
    finally:
        _LIMITS.reset(token)
