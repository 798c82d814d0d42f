"""Restore every global random generator around code that may draw from it (model construction)."""
from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def preserved_rng() -> Iterator[None]:
    """Save torch CPU, every CUDA device, MPS, Python ``random`` and NumPy's global state; restore on exit.

    A pipeline seeds once and draws each stage's noise from the global generators. Building a
    model mid-run runs its random initialisation and would shift every later draw; inside this
    block it cannot. Generators a library creates for itself (``torch.Generator``,
    ``numpy.random.Generator``) are private and left alone. NumPy is never imported here: if it is
    not yet imported, nothing can have seeded it.
    """
    cpu = torch.get_rng_state()
    # Reading the CUDA state initialises CUDA; skipping it would lose a seed that
    # torch.manual_seed queued for lazy application, and a CUDA load would then consume it.
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    mps = torch.mps.get_rng_state() if torch.backends.mps.is_available() else None
    python = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        if mps is not None:
            torch.mps.set_rng_state(mps)
        random.setstate(python)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)
