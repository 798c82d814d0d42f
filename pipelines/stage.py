"""The Stage contract: a name, the model names it needs, the RunState fields it produces, and run().

Vocabulary: a *stage* is one step of a cascade; its *needs* are the registry model names it may
ask for while it runs; its *outputs* are the ``RunState`` fields it writes, which the cascade
fingerprints after it returns. A stage reads and writes ``RunState`` fields only, gets models
only from the ``models`` mapping it is handed, and never moves weights between devices: loading,
releasing and parking are the registry's job.
"""
from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from .state import RunState


class Stage:
    """Base class of the cascade's stages (subclass and set ``name``, ``needs``, ``outputs``)."""

    name: str = ""
    needs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        """Read earlier fields of ``state``, write this stage's ``outputs``."""
        raise NotImplementedError(f"{type(self).__name__} must implement run(state, models)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, needs={list(self.needs)})"
