"""Cascade: an ordered list of stage objects run over one RunState, with a staged model registry.

For each stage: ``registry.enter(stage.name)`` (which releases or parks what the stage does not
need), ``stage.run(state, models)``, then the sha256 fingerprints of the fields it wrote. The
memory policy decides how the registry treats idle models:

=========  ===================================================================================
policy     registry behaviour
=========  ===================================================================================
eager      every model loaded before the first stage and kept (the reference behaviour)
resident   each model loaded when first needed and kept
staged     loaded when first needed, released to ``meta`` when a stage does not need it
offload    loaded when first needed, parked in host memory when a stage does not need it
=========  ===================================================================================

All four produce identical fingerprints: nothing but the registry differs, and every load runs
inside ``preserved_rng()``. ``stages`` is a plain list: a benchmark may replace a stage by a
subclass before the first run (the registry is built from the stages' ``needs`` at that point).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pixal3d.staging.events import Event
from pixal3d.staging.registry import StagedModels

from .fingerprint import fingerprints
from .stage import Stage
from .state import RunState

logger = logging.getLogger(__name__)

POLICIES = ("eager", "resident", "staged", "offload")


@dataclass
class StageRecord:
    """What one stage did: wall seconds, the models it asked for, fingerprints of what it wrote."""

    stage: str
    seconds: float
    used: list[str]
    fingerprints: dict[str, str] = field(default_factory=dict)


class _UsageView(Mapping[str, nn.Module]):
    """The registry as one stage sees it: every model it asks for is recorded in ``used``."""

    def __init__(self, registry: StagedModels, used: set[str]):
        self._registry = registry
        self.used = used

    def __getitem__(self, name: str) -> nn.Module:
        self.used.add(name)
        return self._registry[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._registry)

    def __len__(self) -> int:
        return len(self._registry)

    def __contains__(self, name: object) -> bool:
        return name in self._registry


class Cascade:
    """Stages + loaders + a policy. ``run(state)`` runs every stage in order over ``state``.

    loaders:      registry name → zero-argument callable returning the loaded module
    policy:       one of ``POLICIES`` (already resolved; ``auto`` is resolved by the caller)
    events:       sink for registry events (``MemoryMeter.on_event``, an ``EventLog``, ...)
    strict:       a model asked for outside its stage's needs raises instead of emitting outside_stage
    preserve_rng: restore the global generators around every load (off only for the control test)
    """

    def __init__(self, stages: Sequence[Stage], loaders: Mapping[str, Callable[[], nn.Module]], *,
                 policy: Any = "staged", events: Callable[[Event], None] | None = None,
                 strict: bool = False, preserve_rng: bool = True):
        policy = str(getattr(policy, "value", policy))
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {POLICIES} (resolve 'auto' before building the cascade)")
        self.stages: list[Stage] = list(stages)
        self.loaders = dict(loaders)
        self.policy = policy
        self.events = events
        self.strict = strict
        self.preserve_rng = preserve_rng
        self._registry: StagedModels | None = None

    def plan(self) -> dict[str, tuple[str, ...]]:
        """Stage name → the model names it needs, in run order."""
        return {stage.name: tuple(stage.needs) for stage in self.stages}

    def model_names(self) -> list[str]:
        """Every model some stage needs, in first-use order."""
        names: list[str] = []
        for stage in self.stages:
            names += [n for n in stage.needs if n not in names]
        return names

    @property
    def registry(self) -> StagedModels:
        """The model registry (built from the stages on first use)."""
        if self._registry is None:
            self._registry = self._build_registry()
        return self._registry

    def _build_registry(self) -> StagedModels:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        needed = self.model_names()
        missing = [n for n in needed if n not in self.loaders]
        if missing:
            raise KeyError(f"stages need models without a loader: {missing}; loaders: {sorted(self.loaders)}")
        registry = StagedModels(
            {n: self.loaders[n] for n in needed}, self.plan(),
            pinned=needed if self.policy in ("eager", "resident") else (),
            events=self.events, strict=self.strict,
            idle="park" if self.policy == "offload" else "release",
            preserve_rng=self.preserve_rng)
        if self.policy == "eager":
            registry.load_all()
        return registry

    def run(self, state: RunState, *, on_stage: Callable[[Stage], None] | None = None) -> list[StageRecord]:
        """Run every stage over ``state``; return one record per stage."""
        registry = self.registry
        records = []
        for stage in self.stages:
            if on_stage is not None:
                on_stage(stage)
            registry.enter(stage.name)
            used: set[str] = set()
            start = time.perf_counter()
            with torch.no_grad():
                stage.run(state, _UsageView(registry, used))
            seconds = time.perf_counter() - start
            prints: dict[str, str] = {}
            for name in stage.outputs:
                prints.update(fingerprints(getattr(state, name), name))
            prints.update(fingerprints(state.conditions, "cond"))
            state.conditions.clear()
            records.append(StageRecord(stage.name, seconds, sorted(used), prints))
            logger.debug("stage %s: %.2f s, used %s", stage.name, seconds, sorted(used))
        return records

    def close(self) -> None:
        """Release every model (end of the command)."""
        if self._registry is not None:
            self._registry.close()
