"""The generic stage runner: stages declare what they need, read and write; the runner enters, runs, records.

Vocabulary (used across ``pixal3d.staging``):

- a *stage* is one named step of a pipeline (``Stage``);
- its *needs* are the registry model names it may ask for while it runs;
- its *inputs* are the state fields it reads, its *outputs* the fields it writes; outputs are
  fingerprinted after the stage returns (``fingerprint.py``). *Transient* outputs are fingerprinted,
  then cleared: large per-stage data (image conditioning, say) that must not outlive its stage.
  *Unfingerprinted* outputs are stored like the others but not fingerprinted: intermediate data whose
  every use a later stage fingerprints (image features the conditioning of each later stage is made of);
- its *caches* are fields it may fill and reuse that can always be made again with the same bits (a
  decoded input, backbone features): neither fingerprinted nor stored, and cleared after the stage
  unless the next stage reads or caches them too;
- it *draws* from a generator field (its noise): the generator's state is part of what the stage leaves
  (a batch stores it with the stage's outputs); a stage that changes a generator it reads without
  declaring it is stopped with ``StageGraphError``;
- its *working set* is the estimated memory it needs beyond its models' weights, in bytes;
- the *state* is any object holding those fields (typically a dataclass); the fields set before the
  first stage are what the run *provides*.

The runner checks the declarations when it is built, before any model loads: unique names, a working
set per stage, every input provided or written by an earlier stage, every field a field of the state
type, a loader for every need, a drawn generator among the inputs, a cache not dropped before a later
stage reads it, and (given ``storable``) every output a field the state can store. Each ``run_stage`` is ``registry.enter(name)`` (which releases, parks or
keeps idle models according to the policy), ``stage.run(state, models)`` under ``torch.no_grad``, then
the fingerprints of its outputs; the executor (``executor.py``) drives the stages over items. Pipeline-specific
code (the Pixal3D cascade) lives outside this package.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import torch
from torch import nn

from .events import EventSink
from .fingerprint import fingerprints
from .policy import Policy, placement
from .registry import StagedModels

logger = logging.getLogger(__name__)


class Stage:
    """One step of a pipeline. Subclass and set ``name``, ``needs``, ``inputs``, ``outputs`` (and
    ``transient``, ``unfingerprinted``, ``caches``, ``draws``: see the module docstring), implement ``run`` and
    ``working_set``."""

    name: str = ""
    needs: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    transient: tuple[str, ...] = ()
    unfingerprinted: tuple[str, ...] = ()
    caches: tuple[str, ...] = ()
    draws: str | None = None

    def working_set(self) -> int | None:
        """Estimated bytes beyond the weights of ``needs`` (activations, buffers); ``None``: not declared,
        which the runner refuses — declare 0 for a stage that needs nothing worth counting."""
        return None

    def run(self, state: Any, models: Mapping[str, nn.Module]) -> None:
        """Read ``inputs`` of ``state``, write its ``outputs``, using only the models in ``needs``."""
        raise NotImplementedError(f"{type(self).__name__} must implement run(state, models)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, needs={list(self.needs)})"


class StageGraphError(ValueError):
    """The stages' declarations do not fit together (found when the runner is built, not mid-run)."""


@dataclass
class StageRecord:
    """What one stage did: wall seconds, the models it asked for, fingerprints of what it wrote, and
    (when a memory meter watched the run) its peak process and device memory in bytes. ``reused``: the record
    was restored from an earlier run's store (a resumed work directory), so its seconds and peaks are that
    run's, not this one's."""

    stage: str
    seconds: float
    used: list[str]
    fingerprints: dict[str, str] = field(default_factory=dict)
    peak_process_bytes: int | None = None
    peak_device_bytes: int | None = None
    reused: bool = False


def check_stages(stages: Sequence[Stage], *, provides: Iterable[str] = (), state_type: type | None = None,
                 loaders: Mapping[str, Any] | None = None, storable: Collection[str] | None = None) -> None:
    """Raise ``StageGraphError`` naming the first declaration that cannot work (see the module docstring)."""
    names = [s.name for s in stages]
    if "" in names or len(set(names)) != len(names):
        raise StageGraphError(f"stage names must be non-empty and unique, got {names}")
    known = None
    if state_type is not None and dataclasses.is_dataclass(state_type):
        known = {f.name for f in dataclasses.fields(state_type)}
    available = set(provides)
    if known is not None and available - known:
        raise StageGraphError(f"the run provides {sorted(available - known)}, which are not fields of "
                              f"{state_type.__name__}")
    for k, stage in enumerate(stages):
        if stage.working_set() is None:
            raise StageGraphError(f"stage {stage.name!r} ({type(stage).__name__}) declares no working-set "
                                  f"estimate; implement working_set() (return 0 if it needs nothing to speak of)")
        if known is not None:
            unknown = [f for f in (*stage.inputs, *stage.outputs, *stage.transient, *stage.caches) if f not in known]
            if unknown:
                raise StageGraphError(f"stage {stage.name!r} names {unknown}, which are not fields of "
                                      f"{state_type.__name__}")
        missing = [f for f in stage.inputs if f not in available]
        if missing:
            raise StageGraphError(f"stage {stage.name!r} reads {missing}, which no earlier stage writes and the "
                                  f"run does not provide; available then: {sorted(available)}")
        if stray := [f for f in stage.unfingerprinted if f not in stage.outputs]:
            raise StageGraphError(f"stage {stage.name!r} declares {stray} unfingerprinted but does not write them; "
                                  f"list them in its outputs")
        if stage.draws is not None and stage.draws not in stage.inputs:
            raise StageGraphError(f"stage {stage.name!r} draws from {stage.draws!r} but does not read it; add it "
                                  f"to its inputs")
        if storable is not None and (unstorable := [f for f in stage.outputs if f not in storable]):
            raise StageGraphError(f"stage {stage.name!r} writes {unstorable}, which have no codec: the state "
                                  f"cannot store them between stages; declare how (or make them transient)")
        for later, reader in enumerate(stages[k + 2:], k + 2):  # a cache is dropped after its stage ...
            dropped = [f for f in stage.caches if f in reader.inputs and not all(
                f in s.inputs or f in s.caches for s in stages[k + 1:later])]  # ... unless each stage keeps it
            if dropped:
                raise StageGraphError(f"stage {reader.name!r} reads {dropped}, which stage {stage.name!r} "
                                      f"caches and a stage in between drops; cache or read it there too")
        available.update(stage.outputs, stage.caches)
        if loaders is not None:
            absent = [m for m in stage.needs if m not in loaders]
            if absent:
                raise StageGraphError(f"stage {stage.name!r} needs models without a loader: {absent}; "
                                      f"loaders: {sorted(loaders)}")


class _UsageView(Mapping[str, nn.Module]):
    """The registry as one stage sees it: every model the stage asks for is recorded in ``used``."""

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


class StageRunner:
    """Stages + loaders + a resolved policy; runs stages in order over a state.

    loaders:      model name → zero-argument callable returning the loaded module
    provides:     state fields set before the first stage (checked against the stages' inputs)
    state_type:   the state's dataclass, so misspelt field names are found at build time
    policy:       a resolved ``Policy`` (``auto`` must be resolved first); its ``Placement`` decides the registry
    events:       sink for registry events (``MemoryMeter.on_event``, an ``EventLog``, ...)
    strict:       a model asked for outside its stage's needs raises instead of emitting ``outside_stage``
    preserve_rng: restore the global generators around every load (off only in control tests)
    """

    def __init__(self, stages: Sequence[Stage], loaders: Mapping[str, Callable[[], nn.Module]], *,
                 provides: Iterable[str] = (), state_type: type | None = None, policy: Policy | str = Policy.staged,
                 events: EventSink | None = None, strict: bool = False, preserve_rng: bool = True,
                 pinned: Iterable[str] = ()):
        self.policy = Policy(policy)
        self._placement = placement(self.policy)
        self._stages = list(stages)
        self._loaders = dict(loaders)
        self._events = events
        self._strict = strict
        self._preserve_rng = preserve_rng
        self._pinned = tuple(pinned)
        self._registry: StagedModels | None = None
        check_stages(self._stages, provides=provides, state_type=state_type, loaders=self._loaders)

    # -- the declarations ------------------------------------------------------------------
    @property
    def stages(self) -> tuple[Stage, ...]:
        """The stages in run order."""
        return tuple(self._stages)

    def stage(self, name: str) -> Stage:
        """The stage called ``name``."""
        for stage in self._stages:
            if stage.name == name:
                return stage
        raise KeyError(f"no stage {name!r}; stages: {[s.name for s in self._stages]}")

    # -- running ---------------------------------------------------------------------------
    @property
    def registry(self) -> StagedModels:
        """The model registry, built on first use (an ``eager`` policy loads every model then)."""
        if self._registry is None:
            needs = {s.name: tuple(s.needs) for s in self._stages}
            wanted = list(dict.fromkeys(m for ms in needs.values() for m in ms))
            self._registry = StagedModels(
                {n: self._loaders[n] for n in wanted}, needs, pinned=self._pinned, events=self._events,
                strict=self._strict, idle=self._placement.idle, preserve_rng=self._preserve_rng)
            if self._placement.preload:
                self._registry.load_all()
        return self._registry

    def run_stage(self, stage: Stage | str, state: Any) -> StageRecord:
        """Enter ``stage``, run it over ``state``, fingerprint its outputs (transient ones then cleared), then
        clear the caches the next stage does not use."""
        stage = self.stage(stage) if isinstance(stage, str) else stage
        registry = self.registry
        registry.enter(stage.name)
        used: set[str] = set()
        undrawn = {f: g.get_state() for f in stage.inputs
                   if f != stage.draws and isinstance(g := getattr(state, f), torch.Generator)}
        start = time.perf_counter()
        with torch.no_grad():
            stage.run(state, _UsageView(registry, used))
        seconds = time.perf_counter() - start
        drawn = [f for f, before in undrawn.items() if not torch.equal(getattr(state, f).get_state(), before)]
        if drawn:
            raise StageGraphError(f"stage {stage.name!r} drew from {drawn[0]!r} without declaring it (draws = "
                                  f"{drawn[0]!r}): a batch resumed after it would repeat its noise")
        prints: dict[str, str] = {}
        for name in (*stage.outputs, *stage.transient):
            if name not in stage.unfingerprinted:
                prints.update(fingerprints(getattr(state, name), name))
        for name in stage.transient:
            setattr(state, name, None)
        following = self._following(stage.name)
        for name in stage.caches:
            if following is None or (name not in following.inputs and name not in following.caches):
                setattr(state, name, None)
        logger.debug("stage %s: %.2f s, used %s", stage.name, seconds, sorted(used))
        return StageRecord(stage.name, seconds, sorted(used), prints)

    def _following(self, name: str) -> Stage | None:
        """The stage run after the one called ``name`` (None after the last)."""
        names = [s.name for s in self._stages]
        return self._stages[names.index(name) + 1] if name in names[:-1] else None

    def close(self) -> None:
        """Release every model (the registry is rebuilt on the next run)."""
        if self._registry is not None:
            self._registry.close()
            self._registry = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
