"""Images through one ``Pixal3D``: what a run of several (or one) is made of around the executor
(``pixal3d.staging.executor``) — the items, the progress and memory hooks, and what each image becomes.

    with Pixal3D.from_config(config, policy="staged") as pipe:
        for item in pipe.run_batch(["a.png", "b.png", "c.png"], work_dir="work"):
            if item.ok:
                item.result.save(f"out/{item.name}.glb")
            else:
                print(item.name, item.message)

Orders (``order=``):

- ``stage``: every image through stage 1, then every image through stage 2, ... so each model is loaded once per
  batch, not once per image (the default under ``staged`` and ``offload``, where every load is a read from disk
  or a copy over the bus). The images' states wait in memory between stages while they fit in the batch's
  *state budget* (``RunPlan.state_budget()``: the memory the plan saw, less the policy's needs); a state that
  does not fit waits on disk as safetensors (in the work directory, or a folder under the cache) and is read
  back for its next stage (``work_dir.StateStore``). Peaks in the run records are then the batch's at that stage.
- ``image``: each image through every stage, then the next (the default under ``resident`` and ``eager``, where
  models stay loaded anyway); each image has its own memory trace. ``Pixal3D.run`` is this order, for one image.

Each image owns its ``RunState`` and its CPU generator, so every image's fingerprints are those of a one-by-one
``run`` with the same seed, in either order. With ``work_dir=`` every stage's outputs are written as it finishes
(``work_dir.py``); the same batch run again continues each image at its first stage without a valid record, and
an image whose every stage is recorded is rebuilt from the records, not recomputed. An image that cannot be used
(``pipelines.errors.classify`` says ``input`` or ``memory``: not an image, no alpha and no remover, an empty
structure, out of memory on its own) is reported as a failed item and the others go on; anything else (missing
weights, a full disk, an interrupt, a bug) stops the batch. Under ``--parallel`` an image fails alone only until
its first flow stage, which the other ranks join; batches there go image by image, without a work directory.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tqdm.auto import tqdm

from pixal3d.config import check_fov, check_seed
from pixal3d.staging import Event, Policy, StagedModels
from pixal3d.staging.executor import Hook, Item
from pixal3d.telemetry import MemoryMeter

from .errors import Failure, classify
from .work_dir import StageKey

BatchOrder = Literal["image", "stage"]
IMAGE_KINDS = ("input", "memory")
"""Failure kinds (``pipelines.errors``) that concern one image: it is reported and skipped, the batch goes on."""


def image_alone(err: BaseException, stopped: str | None) -> bool:
    """Whether ``err`` concerns its image alone (``IMAGE_KINDS``), so a batch reports it and goes on; never once a
    parallel job has ``stopped`` (its other ranks cannot go on)."""
    failure = classify(err, started=True)
    return failure is not None and failure.kind in IMAGE_KINDS and stopped is None


def default_order(policy: Policy) -> BatchOrder:
    """``stage`` where a model that leaves memory must be read again (staged, offload), else ``image``."""
    return "stage" if policy in (Policy.staged, Policy.offload) else "image"


@dataclass
class BatchItem(Item):
    """One image of a run (the executor's item): its ``result``, or the ``error`` that stopped it (at ``stage``,
    None before any) and its ``failure`` (``pipelines.errors.Failure``: kind and one line).

    input:   what run.json calls it (its ``label``: the path, or ``<image>``)
    seed:    its seed; ``fov``: its field of view (None: the config's, else estimated)
    keys:    its stages' work-directory keys (``work_dir.stage_keys``)
    resumed: the stages taken from the work directory instead of being run
    notes:   lines about the work directory (a stale record and why)
    """

    seed: int = 0
    fov: float | None = None
    keys: list[StageKey] = field(default_factory=list)

    @property
    def input(self) -> str:
        return self.label

    @property
    def stage(self) -> str | None:
        return self.failed_at

    @property
    def failure(self) -> Failure | None:
        return None if self.ok else classify(self.error, started=self.failed_at is not None)

    @property
    def message(self) -> str:
        """The error in one line (empty when the item succeeded)."""
        if self.failure is None:
            return ""
        return f"{self.failure.message} (at stage {self.stage})" if self.stage else self.failure.message


def _per_image(value: Any) -> bool:
    """Whether a seed or field of view was given one per image: a sequence, but not a str or bytes (sequences too)."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


def image_items(images: Sequence[Any], *, seed: int | Sequence[int] | None, default_seed: int,
                fov: float | Sequence[float | None] | None = None, names: Sequence[str] | None = None,
                labels: Sequence[str] | None = None) -> list[BatchItem]:
    """One item per image, its seed and field of view checked (one for all, or one per image); names (what
    outputs and records call it: the file's stem, else ``image<i>``) unique; labels (what run.json calls its
    input: the path, else ``<image>``)."""
    images = list(images)
    if _per_image(seed):
        if len(seed) != len(images):
            raise ValueError(f"{len(seed)} seeds for {len(images)} images; pass one seed, or one per image")
        seeds = [check_seed(s) for s in seed]
    else:
        seeds = [default_seed if seed is None else check_seed(seed)] * len(images)
    if _per_image(fov):
        if len(fov) != len(images):
            raise ValueError(f"{len(fov)} fields of view for {len(images)} images; pass one, or one per image")
        fovs = list(fov)
    else:
        fovs = [fov] * len(images)
    for value in fovs:
        check_fov(value)
    if names is None:
        names = [Path(im).stem if isinstance(im, (str, Path)) else f"image{i}" for i, im in enumerate(images)]
    elif len(names) != len(images):
        raise ValueError(f"{len(names)} names for {len(images)} images; pass one name per image")
    duplicates = sorted({n for n in names if list(names).count(n) > 1})
    if duplicates:
        raise ValueError(f"several images are named {duplicates}; names must be unique (pass names=)")
    labels = labels or [str(im) if isinstance(im, (str, Path)) else str(getattr(im, "folder", "<image>"))
                        for im in images]
    return [BatchItem(i, str(name), image, label, seed=s, fov=f)
            for i, (image, name, label, s, f) in enumerate(zip(images, names, labels, seeds, fovs))]


class Progress(Hook):
    """A tqdm bar over every stage of every image, and the ``callback`` reports: ``{"kind": "stage", "stage",
    "index", "stages", "image", "image_index", "images"}`` as a stage starts (``callback_for(item)`` gives the
    callback a state passes sampler steps to, with the same image keys)."""

    def __init__(self, stages: Sequence[str], *, progress: bool, callback: Callable[[dict[str, Any]], None] | None):
        self.stages, self.progress, self.callback = list(stages), progress, callback
        self.images: int | None = None  # in the session (None: items from an iterator)
        self._bar: Any = None

    @contextlib.contextmanager
    def session(self, items: Sequence[Item] | None) -> Iterator[None]:
        self.images = None if items is None else len(items)
        desc = items[0].name if items is not None and len(items) == 1 else f"{self.images or ''} images".strip()
        total = None if items is None else len(items) * len(self.stages)
        self._bar = tqdm(total=total, desc=desc, unit="stage", disable=not self.progress)
        try:
            yield
        finally:
            self._bar.close()

    def before(self, item: Item, k: int) -> None:
        stage = item.at
        self._bar.set_postfix_str(stage if self.images == 1 else f"{stage} · {item.name} ({item.index + 1}/"
                                                                  f"{self.images or '?'})")
        if self.callback is not None:
            self.callback({"kind": "stage", "stage": stage, "index": k, "stages": len(self.stages),
                           **self._image(item)})

    def advanced(self, item: Item, stages: int) -> None:
        self._bar.update(stages)
        if self._bar.total is not None and self._bar.n >= self._bar.total:
            # done: end the bar's line now, before the caller prints its tables (the batch is still suspended
            # inside ``session`` then), or the table's header starts on the bar's line where stderr and stdout
            # share one (``2>&1 | tee``)
            self._bar.close()

    def callback_for(self, item: Item) -> Callable[[dict[str, Any]], None] | None:
        callback, extra = self.callback, self._image(item)
        return None if callback is None else lambda info: callback({**info, **extra})

    def _image(self, item: Item) -> dict[str, Any]:
        return {"image": item.name, "image_index": item.index, "images": self.images}


class Relay(list):
    """The registry's one event sink, forwarding to whoever listens to the current span (its items)."""

    def __call__(self, event: Event) -> None:
        for target in self:
            target(event)


def trace_path(trace: Path | None, name: str, *, several: bool) -> Path | None:
    """Where an image's memory trace goes: ``trace`` itself, or ``<stem>.<name><suffix>`` beside it when each of
    several images has its own."""
    return trace.with_name(f"{trace.stem}.{name}{trace.suffix}") if trace is not None and several else trace


class Meter(Hook):
    """A memory meter per span (``trace`` written when given: one file for a stage-ordered batch,
    ``<stem>.<name><suffix>`` per image of several in image order), hearing the registry through ``relay``
    (and passing its events on to ``events``)."""

    def __init__(self, relay: Relay, registry: Callable[[], StagedModels], *, device: Any, meta: Mapping[str, Any],
                 trace: str | Path | None = None, several: bool = False,
                 events: Callable[[Event], None] | None = None):
        self.relay, self.registry, self.device, self.meta = relay, registry, device, dict(meta)
        self.trace = Path(trace) if trace is not None else None
        self.several = several
        self.events = events
        self.meter: MemoryMeter | None = None
        self._covers: list[Item] = []
        self._opened: set[int] = set()

    @contextlib.contextmanager
    def span(self, items: Sequence[Item]) -> Iterator[None]:
        one = items[0] if len(items) == 1 else None
        meta = ({"input": one.label, "seed": getattr(one, "seed", None)} if one is not None else
                {"images": [item.label for item in items], "order": "stage"})
        trace = trace_path(self.trace, one.name, several=self.several) if one is not None else self.trace
        self._covers, self._opened = list(items), set()
        with MemoryMeter(trace, device=self.device, meta={**meta, **self.meta}) as self.meter:
            self.relay[:] = [self.meter.on_event, *([self.events] if self.events is not None else [])]
            try:
                yield
            finally:
                self.relay.clear()

    def before(self, item: Item, k: int) -> None:
        """The first time a span reaches stage ``k``: a run that failed in it left the registry there, so entering
        it emits no stage event; open its window by hand."""
        if k not in self._opened:
            self._opened.add(k)
            if self.registry().stage == item.at:
                self.meter.mark(item.at)

    def meter_for(self, item: Item) -> MemoryMeter | None:
        """The meter of the span ``item`` ran in (None for an item taken whole from a work directory)."""
        return self.meter if any(other is item for other in self._covers) else None
