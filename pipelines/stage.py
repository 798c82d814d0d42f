"""CascadeStage: a ``pixal3d.staging.Stage`` of the Pixal3D cascade, built from its config section.

Each stage declares, on its class: ``name``; ``section``, the ``CascadeConfig`` field it is built from;
``needs``, the registry model names it may ask for; ``inputs`` and ``outputs``, the ``RunState`` fields
it reads and writes (``transient``: written, fingerprinted, then cleared); and ``working_set()``, its
estimated memory beyond its models' weights (``working_set.py``). A stage that samples a flow model
(``flow_stage.sample``) names it in ``flow_model``: under torchrun the other ranks load their shard of
it and join the sampling (``parallel.py``). It reads and writes ``RunState`` fields
only, gets models only from the ``models`` mapping it is handed, and never moves weights between
devices: loading, releasing and parking are the registry's job.

The plan fits each stage to the memory it may use (``fitted(budget)``): a flow stage resolves NAF's
``auto`` mode and, under an explicit ``--memory-budget``, its chunk sizes; the decode picks its tiles. A
fitted stage is a copy; the stage objects built from the config are not changed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

from pixal3d.config import CascadeConfig
from pixal3d.memory_budget import models_and_work
from pixal3d.staging import Stage


@dataclass(frozen=True)
class StageBudget:
    """What the plan gives one stage: ``total_bytes`` of process memory for everything (an explicit
    ``--memory-budget``, else the machine's usable memory), of which ``weight_bytes`` are its models.
    ``explicit``: bound the work to it (tiles, chunks) and refuse what cannot fit. ``array_bytes``: split
    any work whose single tensors would exceed it (the decode tiles), whatever the budget."""

    total_bytes: int
    weight_bytes: int
    explicit: bool = False
    array_bytes: int | None = None  # the largest single tensor the device takes (mps: MPSGraph's 2**32 bytes)
    device: str | None = None  # the device the stage runs on (``cpu``, ``cuda:0``), where what runs depends on it
    model_bytes: int = 0  # its models' whole bytes, streamed or not (0: as ``weight_bytes``): what they are sized by

    @property
    def work_bytes(self) -> int:
        """What the stage's work may use: the total less the interpreter and its models."""
        return models_and_work(self.total_bytes) - self.weight_bytes


class CascadeStage(Stage):
    """Base class of the cascade's stages: set the declarations, implement ``from_config``, ``run`` and
    ``working_set``."""

    section: str | None = None
    flow_model: str | None = None  # the registry name of the flow model it samples, if any
    view_count: int | None = None  # a flow stage conditioned on posed views: the views its working set counts

    @classmethod
    def from_config(cls, config: CascadeConfig) -> Self:
        """The stage as ``config`` describes it (its ``section``, and any sizes it shares with others)."""
        raise NotImplementedError(f"{cls.__name__} must implement from_config(config)")

    def fitted(self, budget: StageBudget) -> Self:
        """This stage as it should run within ``budget`` (a copy when anything changes); by default itself.
        Raises ``MemoryBudgetError`` when an explicit budget cannot be met."""
        return self

    def choices(self) -> dict[str, Any]:
        """What ``fitted`` decided, for the plan's reasons and run.json (empty by default)."""
        return {}

    def check_input(self, image: Any) -> None:
        """Raise ``ImageError`` if this stage cannot take ``image`` (a path, PIL image or array), before any
        weight is read. Most stages accept anything an earlier stage produces: the default does nothing."""
