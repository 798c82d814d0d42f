"""StagedModels: load each model when its stage first asks for it, release it when no stage needs it.

Vocabulary: a *stage* is a named step of a pipeline; its *needs* are the model names it uses.
``enter(stage)`` releases every loaded model the new stage does not need (unless pinned), then
emits the ``stage`` event, so a memory meter can open the stage's window after the memory is back.
"""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from .events import Event, EventSink
from .offload import park, unpark
from .release import empty_device_cache, module_nbytes, release
from .rng import preserved_rng

logger = logging.getLogger(__name__)

IdlePlacement = Literal["release", "park", "keep"]
"""Where a model lives while the stage being entered does not need it: released to ``meta``, parked in
host memory, or kept where it is."""


class OutsideStageError(RuntimeError):
    """A model was asked for in a stage that does not list it, and the registry is strict."""


@dataclass
class _Slot:
    loader: Callable[[], nn.Module]
    module: nn.Module | None = None
    loads: int = 0


def _names(kind: str, names: Iterable[str]) -> str:
    return f"valid {kind} names: {sorted(names)}"


class StagedModels(Mapping[str, nn.Module]):
    """A mapping of model name → module that loads lazily and releases per stage.

    ``loaders`` build each model (on its target device, by convention); ``stages`` list, in run
    order, the model names each stage needs. ``models[name]`` loads on first access inside
    ``preserved_rng()``; ``in``, ``len()`` and iteration never load (``get``, ``values`` and
    ``items`` do, as for any Mapping). ``pinned`` names are never released by ``enter``.
    ``idle`` says where idle models go: ``"release"`` (to ``meta``), ``"park"`` (host memory, for discrete
    GPUs) or ``"keep"`` (nothing moves; ``enter`` only changes the stage).
    Events go to ``events`` (any callable taking an ``Event``). Names whose loaders return one
    instance share it: released once, when no stage being entered needs any of them.
    """

    def __init__(
        self,
        loaders: Mapping[str, Callable[[], nn.Module]],
        stages: Mapping[str, Sequence[str]],
        *,
        pinned: Iterable[str] = (),
        events: EventSink | None = None,
        strict: bool = False,
        idle: IdlePlacement = "release",
        preserve_rng: bool = True,
    ) -> None:
        self._slots = {name: _Slot(loader) for name, loader in loaders.items()}
        self._stages = {stage: frozenset(needs) for stage, needs in stages.items()}
        unknown = sorted({n for needs in self._stages.values() for n in needs} - self._slots.keys())
        if unknown:
            raise KeyError(
                f"stages list models that have no loader: {unknown}; {_names('model', self._slots)}"
            )
        self._pinned: set[str] = set()
        for name in pinned:
            self.pin(name)
        if idle not in ("release", "park", "keep"):
            raise ValueError(f"idle={idle!r} is not a placement; use 'release', 'park' or 'keep'")
        self._idle = idle
        self._sink = events
        self._strict = strict
        self._preserve_rng = preserve_rng
        self._stage: str | None = None
        self._parked: dict[int, torch.device] = {}
        self._outside_seen: set[tuple[str, str]] = set()

    # -- Mapping ---------------------------------------------------------------------------

    def __getitem__(self, name: str) -> nn.Module:
        slot = self._slot(name)
        self._check_stage(name)
        if slot.module is not None:
            if id(slot.module) in self._parked:
                self._unpark(name, slot.module)
            return slot.module
        return self._load(name, slot)

    def __iter__(self) -> Iterator[str]:
        return iter(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    def __repr__(self) -> str:
        return f"StagedModels(stage={self._stage!r}, loaded={self.loaded()}, names={list(self._slots)})"

    # -- queries ---------------------------------------------------------------------------

    @property
    def stage(self) -> str | None:
        """The stage last entered (None before the first ``enter`` and after ``close``)."""
        return self._stage

    @property
    def stages(self) -> list[str]:
        """Stage names in run order."""
        return list(self._stages)

    def needs(self, stage: str) -> frozenset[str]:
        """The model names ``stage`` lists."""
        self._check_stage_name(stage)
        return self._stages[stage]

    def loaded(self) -> list[str]:
        """Names whose module is in memory now (on its device or parked in host memory)."""
        return [name for name, slot in self._slots.items() if slot.module is not None]

    def pin(self, name: str) -> None:
        """Never release ``name`` on ``enter`` (``close`` still releases it)."""
        self._slot(name)
        self._pinned.add(name)

    # -- stage changes ---------------------------------------------------------------------

    def enter(self, stage: str) -> None:
        """Release (or park) every loaded, unpinned model ``stage`` does not need, then emit ``stage``."""
        self._check_stage_name(stage)
        needs = self._stages[stage]
        idle = [
            name
            for name, slot in self._slots.items()
            if self._idle != "keep"
            and slot.module is not None
            and name not in needs
            and name not in self._pinned
            and id(slot.module) not in self._parked
        ]
        staying = [n for n in self.loaded() if n not in idle]
        released = False
        for names, module in self._by_instance(idle):
            users = [n for n in staying if self._slots[n].module is module]
            if users:  # one instance under several names, one of them still needed: it stays whole
                logger.debug("%s not needed at %r but kept: shared with %s", names, stage, users)
            elif self._idle == "park":
                self._park(names, module, stage)
            else:
                self._release(names, module, stage, collect=False)
                released = True
        if released:
            gc.collect()  # once for all the releases above, before the new stage's window opens
            empty_device_cache()
        if stage != self._stage:
            self._stage = stage
            self._emit(Event("stage", stage=stage))

    def load_all(self) -> None:
        """Load every model now, in loader order (the ``eager`` policy)."""
        for name in self._slots:
            self[name]

    def close(self) -> None:
        """Release every loaded model, pinned and parked ones included, and leave the current stage."""
        for names, module in self._by_instance(self.loaded()):
            self._release(names, module, None)
        self._parked.clear()
        self._stage = None

    def __enter__(self) -> StagedModels:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------

    def _slot(self, name: str) -> _Slot:
        try:
            return self._slots[name]
        except KeyError:
            raise KeyError(f"unknown model {name!r}; {_names('model', self._slots)}") from None

    def _check_stage_name(self, stage: str) -> None:
        if stage not in self._stages:
            raise KeyError(f"unknown stage {stage!r}; {_names('stage', self._stages)}")

    def _check_stage(self, name: str) -> None:
        stage = self._stage
        if stage is None or name in self._stages[stage]:
            return
        if self._strict:
            raise OutsideStageError(
                f"model {name!r} was asked for in stage {stage!r}, which needs only "
                f"{sorted(self._stages[stage])}; add {name!r} to that stage's needs, or build the "
                f"registry with strict=False to allow it (an outside_stage event is then emitted)"
            )
        if (stage, name) not in self._outside_seen:
            self._outside_seen.add((stage, name))
            logger.warning("model %r used in stage %r, which does not list it", name, stage)
            self._emit(Event("outside_stage", model=name, stage=stage))

    def _load(self, name: str, slot: _Slot) -> nn.Module:
        start = time.perf_counter()
        with preserved_rng() if self._preserve_rng else nullcontext():
            module = slot.loader()
        seconds = time.perf_counter() - start
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"the loader of {name!r} returned {type(module).__name__}, not an nn.Module; "
                f"wrap the object in an nn.Module so the registry can release it"
            )
        sharers = [n for n, s in self._slots.items() if s.module is module]
        kind = "reload" if slot.loads else "load"
        slot.module = module
        slot.loads += 1
        # A shared instance costs nothing more: its bytes were counted when it first loaded.
        nbytes, note = (0, f"shared with {sharers}") if sharers else (module_nbytes(module), "")
        self._emit(Event(kind, model=name, stage=self._stage, bytes=nbytes, seconds=seconds, note=note))
        return module

    def _by_instance(self, names: Iterable[str]) -> list[tuple[list[str], nn.Module]]:
        """Group names by the module object they hold (shared instances are released once)."""
        groups: dict[int, tuple[list[str], nn.Module]] = {}
        for name in names:
            module = self._slots[name].module
            groups.setdefault(id(module), ([], module))[0].append(name)
        return list(groups.values())

    def _release(self, names: list[str], module: nn.Module, stage: str | None, *, collect: bool = True) -> None:
        others = [s.module for s in self._slots.values() if s.module is not None and s.module is not module]
        start = time.perf_counter()
        nbytes = release(module, name=names[0], stage=stage, keep=others, collect=collect, empty_cache=collect)
        seconds = time.perf_counter() - start
        for name in names:
            self._slots[name].module = None
        self._parked.pop(id(module), None)
        note = f"shared by {names}" if len(names) > 1 else ""
        self._emit(Event("release", model=names[0], stage=stage, bytes=nbytes, seconds=seconds, note=note))

    def _park(self, names: list[str], module: nn.Module, stage: str) -> None:
        start = time.perf_counter()
        origin, nbytes = park(module)
        empty_device_cache()
        self._parked[id(module)] = origin
        seconds = time.perf_counter() - start
        note = "parked in host memory"
        self._emit(Event("release", model=names[0], stage=stage, bytes=nbytes, seconds=seconds, note=note))

    def _unpark(self, name: str, module: nn.Module) -> None:
        start = time.perf_counter()
        nbytes = unpark(module, self._parked.pop(id(module)))
        seconds = time.perf_counter() - start
        note = "from host memory"
        self._emit(Event("reload", model=name, stage=self._stage, bytes=nbytes, seconds=seconds, note=note))

    def _emit(self, event: Event) -> None:
        if self._sink is not None:
            self._sink(event)
