"""Batches: several images through one ``Pixal3D``, stage by stage or image by image, resumable, and a bad image
costs only itself.

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
  *state budget* (``Pixal3D.state_budget()``: the memory the plan saw, less the policy's needs); a state that does
  not fit waits on disk as safetensors (in the work directory, or a temporary folder) and is read back for its
  next stage. Peaks in the run records are then the batch's at that stage.
- ``image``: each image through every stage, then the next (the default under ``resident`` and ``eager``, where
  models stay loaded anyway); each image has its own memory trace.

Each image owns its ``RunState`` and its CPU generator, so every image's fingerprints are those of a one-by-one
``run`` with the same seed, in either order. With ``work_dir=`` every stage's outputs are written as it finishes
(``work_dir.py``); the same batch run again continues each image at its first stage without a valid record, and
an image whose every stage is recorded is rebuilt from the records, not recomputed. An image that cannot be used
(``pipelines.errors.classify`` says ``input`` or ``memory``: not an image, no alpha and no remover, an empty
structure, out of memory on its own) is reported as a failed item and the others go on; anything else (missing
weights, a full disk, an interrupt, a bug) stops the batch. Batches run in one process (not under ``--parallel``,
whose other ranks follow rank 0 image by image).
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import psutil
import torch
from PIL import Image
from tqdm.auto import tqdm

import pixal3d
from pixal3d.hub import cache_root
from pixal3d.models.preprocess import ImageError, as_image, probe_image
from pixal3d.staging import Event, Policy, StageRecord

from . import state_codec
from .errors import Failure, classify
from .result import Result
from .state import RunState
from .work_dir import StageKey, WorkDir, stage_keys

if TYPE_CHECKING:
    from pixal3d.telemetry import MemoryMeter

    from .pipeline import Pixal3D

logger = logging.getLogger(__name__)

BatchOrder = Literal["image", "stage"]
IMAGE_KINDS = ("input", "memory")
"""Failure kinds (``pipelines.errors``) that concern one image: it is reported and skipped, the batch goes on."""


def default_order(policy: Policy) -> BatchOrder:
    """``stage`` where a model that leaves memory must be read again (staged, offload), else ``image``."""
    return "stage" if policy in (Policy.staged, Policy.offload) else "image"


@dataclass
class BatchItem:
    """One image of a batch: its ``result``, or the ``error`` that stopped it (at ``stage``, None before any)
    and its ``failure`` (``pipelines.errors.Failure``: kind and one line).

    resumed: the stages taken from the work directory instead of being run
    notes:   lines about the work directory (a stale record and why)
    """

    index: int
    name: str
    input: str
    seed: int
    result: Result | None = None
    error: BaseException | None = None
    failure: Failure | None = None
    stage: str | None = None
    resumed: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def message(self) -> str:
        """The error in one line (empty when the item succeeded)."""
        if self.failure is None:
            return ""
        return f"{self.failure.message} (at stage {self.stage})" if self.stage else self.failure.message


def spill_root() -> Path:
    """Where batches without a work dir keep states between stages: ``<pixal3d cache>/batch-spill``, on disk
    beside the weights. Not the system temporary folder: that is memory (tmpfs) on many Linux systems, and
    spilling is what a batch does when memory is short."""
    return cache_root() / "batch-spill"


def new_spill_folder() -> Path:
    """A fresh folder under ``spill_root()`` named after this process; the folders of processes that no longer
    run (a batch killed before it could clean up) are removed first."""
    root = spill_root()
    root.mkdir(parents=True, exist_ok=True)
    for old in root.iterdir():
        pid = old.name.split("-", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root))


def run_batch(pipe: Pixal3D, images: Sequence[Any], *, seed: int | Sequence[int] | None = None,
              fov: float | None = None, names: Sequence[str] | None = None, order: BatchOrder | None = None,
              work_dir: str | Path | None = None, state_budget: int | None = None,
              events: Callable[[Event], None] | None = None, progress: bool = False,
              callback: Callable[[dict[str, Any]], None] | None = None, trace: str | Path | None = None,
              trace_meta: Mapping[str, Any] | None = None) -> Iterator[BatchItem]:
    """Yield a ``BatchItem`` per image as it finishes (failures as soon as they happen).

    images:       paths, PIL images or uint8 arrays
    seed:         one seed for every image, or one per image (default: the config's)
    names:        what outputs, records and reports call each image (default: the file's stem, else image<i>)
    order:        ``stage`` or ``image`` (default: ``default_order(pipe.policy)``)
    work_dir:     keep every stage's outputs there and resume from what is already there
    state_budget: bytes of image states kept in memory between stages (default: ``pipe.state_budget()``); 0
                  keeps every state on disk
    events, progress, trace, trace_meta: as for ``Pixal3D.run`` (``trace``: one file for a stage-ordered batch;
                  ``<stem>.<name><suffix>`` per image for an image-ordered one)
    callback:     as for ``Pixal3D.run``, each report extended by ``image``, ``image_index`` and ``images``

    An item's ``result.state`` holds every stage output; unlike ``run``'s it no longer holds the decoded input
    image (dropped after preprocess, so a batch does not keep every input in memory).
    """
    from .pipeline import check_fov, check_seed

    if pipe.parallel is not None:
        raise ValueError("batches run in one process: under torchrun (--parallel) run the images one by one with "
                         "run(), which the other ranks follow")
    check_fov(fov)
    order = order or default_order(pipe.policy)
    if order not in ("image", "stage"):
        raise ValueError(f"batch order {order!r} is neither 'image' nor 'stage'")
    jobs = _jobs(pipe, images, seed, names, check_seed)
    batch = _Batch(pipe, jobs, fov=fov, work_dir=work_dir, budget=state_budget, events=events, progress=progress,
                   callback=callback, trace=trace, trace_meta=trace_meta)
    return batch.by_stage() if order == "stage" else batch.by_image()


# -- one image's progress through the batch ---------------------------------------------------------
@dataclass
class _Job:
    index: int
    name: str
    source: Any
    label: str
    seed: int
    keys: list[StageKey] = field(default_factory=list)
    state: RunState | None = None     # in memory, or None (not started, or waiting on disk)
    records: list[StageRecord] = field(default_factory=list)
    done: int = 0                      # stages finished (recorded or run)
    stored: int = 0                    # leading stages whose outputs are on disk (work dir or spill)
    held: int = 0                      # bytes the in-memory state holds
    resumed: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)
    failed: bool = False

    def item(self, **kwargs: Any) -> BatchItem:
        return BatchItem(self.index, self.name, self.label, self.seed, resumed=self.resumed, notes=self.notes,
                         **kwargs)


def _jobs(pipe: Pixal3D, images: Sequence[Any], seed: int | Sequence[int] | None, names: Sequence[str] | None,
          check_seed: Callable[[Any], int]) -> list[_Job]:
    images = list(images)
    if isinstance(seed, Sequence):
        if len(seed) != len(images):
            raise ValueError(f"{len(seed)} seeds for {len(images)} images; pass one seed, or one per image")
        seeds = [check_seed(s) for s in seed]
    else:
        seeds = [pipe.config.seed if seed is None else check_seed(seed)] * len(images)
    if names is None:
        names = [Path(im).stem if isinstance(im, (str, Path)) else f"image{i}" for i, im in enumerate(images)]
    elif len(names) != len(images):
        raise ValueError(f"{len(names)} names for {len(images)} images; pass one name per image")
    duplicates = sorted({n for n in names if list(names).count(n) > 1})
    if duplicates:
        raise ValueError(f"several images are named {duplicates}; names must be unique (pass names=)")
    return [_Job(i, str(name), image, str(image) if isinstance(image, (str, Path)) else "<image>", s)
            for i, (image, name, s) in enumerate(zip(images, names, seeds))]


# -- the engine --------------------------------------------------------------------------------------
class _Batch:
    def __init__(self, pipe: Pixal3D, jobs: list[_Job], *, fov: float | None, work_dir: str | Path | None,
                 budget: int | None, events: Callable[[Event], None] | None, progress: bool,
                 callback: Callable[[dict[str, Any]], None] | None, trace: str | Path | None,
                 trace_meta: Mapping[str, Any] | None):
        self.pipe = pipe
        self.stages = pipe.stages
        self.jobs = jobs
        self.fov = fov
        self.store = WorkDir(work_dir) if work_dir is not None else None
        self.budget = pipe.state_budget() if budget is None else budget
        self.events = events
        self.progress = progress
        self.callback = callback
        self.trace = Path(trace) if trace is not None else None
        self.trace_meta = dict(trace_meta or {})
        self._spill_root: Path | None = None
        self._spill: WorkDir | None = None
        self._bar: Any = None

    # 1. the two orders -----------------------------------------------------------------------------
    def by_image(self) -> Iterator[BatchItem]:
        with self._session():
            for job in self.jobs:
                failure = self._open(job)
                if failure is not None or job.done == len(self.stages):
                    yield failure or self._finish(job, None)
                    continue
                meta = {"input": job.label, "policy": self.pipe.policy.value, "seed": job.seed, **self.trace_meta}
                with self.pipe.metered(self._image_trace(job), meta, self.events) as meter:
                    self.pipe.open_window(self.stages[job.done].name, meter)
                    for k in range(job.done, len(self.stages)):
                        failure = self._step(job, k)
                        if failure is not None:
                            break
                    item = failure or self._finish(job, meter)
                yield item

    def by_stage(self) -> Iterator[BatchItem]:
        with self._session():
            for job in self.jobs:
                failure = self._open(job)
                if failure is not None or job.done == len(self.stages):
                    yield failure or self._finish(job, None)
            meta = {"images": [job.label for job in self.jobs], "order": "stage", "policy": self.pipe.policy.value,
                    **self.trace_meta}
            with self.pipe.metered(self.trace, meta, self.events) as meter:
                last = len(self.stages) - 1
                for k in range(len(self.stages)):
                    opened = False
                    for job in self.jobs:
                        if job.failed or job.done != k:
                            continue
                        if not opened:
                            self.pipe.open_window(self.stages[k].name, meter)
                            opened = True
                        failure = self._step(job, k)
                        if failure is not None:
                            yield failure
                        elif k == last:
                            yield self._finish(job, meter)
                        else:
                            self._hold_or_spill(job)

    # 2. one image, one stage -----------------------------------------------------------------------
    def _open(self, job: _Job) -> BatchItem | None:
        """Key the image's stages and find where it resumes; an input that cannot be read fails here. The keys
        cover every provided field that decides an output (``progress`` and ``callback`` decide none)."""
        try:
            if isinstance(job.source, (str, Path)):
                probe_image(job.source)  # not an image, or too small: from its header
            self.pipe.run_plan.check_input(job.source)  # e.g. no alpha and no remover
            provided = {"input_image": _input_digest(job.source), "generator": job.seed, "fov_deg": self.fov,
                        "device": str(self.pipe.device),
                        "shape_normalization": repr(self.pipe.weights.shape_normalization),
                        "tex_normalization": repr(self.pipe.weights.tex_normalization)}
        except ImageError as err:
            return self._fail(job, err, None)
        except OSError as err:
            return self._fail(job, ImageError(f"{job.label} cannot be read ({err.strerror or err})"), None)
        job.keys = stage_keys(self.stages, provided, _weights_digests(self.pipe.weights),
                              {"torch": torch.__version__, "pixal3d": pixal3d.__version__})
        if self.store is not None:
            done, note = self.store.scan(job.name, job.keys)
            if note:
                logger.warning("work dir %s: %s", self.store.root, note)
                job.notes.append(note)
            job.done = job.stored = done
            job.resumed = tuple(k.stage for k in job.keys[:done])
            self._advance(done)
        return None

    def _step(self, job: _Job, k: int) -> BatchItem | None:
        """Run stage ``k`` on the job's state (read back from disk first if it waits there); record it."""
        stage = self.stages[k]
        self._report(job, k)
        try:
            state = job.state if job.state is not None else self._restore(job, k)
            job.state = state
            record = self.pipe.runner.run_stage(stage, state)
        except Exception as err:  # classify() decides; what is not this image's alone is re-raised
            failure = classify(err, started=True)
            if failure is None or failure.kind not in IMAGE_KINDS:
                raise
            return self._fail(job, err, stage.name, failure)
        job.records.append(record)
        job.done = k + 1
        if self.store is not None:
            self.store.save(job.name, job.keys[k], record, _outputs(stage, state), _generator(stage, state), _KINDS)
            job.stored = k + 1
        self._bar.update(1)
        return None

    def _finish(self, job: _Job, meter: MemoryMeter | None) -> BatchItem:
        state = job.state if job.state is not None else self._restore(job, len(self.stages))
        job.state = None  # the item owns it now
        result = self.pipe.result(job.label, job.seed, state, job.records, meter)
        return job.item(result=result)

    def _fail(self, job: _Job, err: BaseException, stage: str | None, failure: Failure | None = None) -> BatchItem:
        job.failed = True
        job.state = None
        self._advance(len(self.stages) - job.done)
        item = job.item(error=err, failure=failure or classify(err, started=stage is not None), stage=stage)
        logger.debug("batch: %s failed: %s", job.name, item.message)
        return item

    # 3. states between stages ------------------------------------------------------------------------
    def _hold_or_spill(self, job: _Job) -> None:
        """Keep the job's state in memory while the batch's held states stay within budget, else leave it on
        disk (the work directory, or a temporary folder) until its next stage."""
        state = job.state
        held = sum(j.held for j in self.jobs if j is not job and j.state is not None)
        size = state_codec.nbytes(state)
        if held + size <= self.budget:
            job.held = size
            return
        store = self._disk()
        for k in range(job.stored, job.done):
            # the generator as it is now: stages after k that do not read it have left it as k did
            store.save(job.name, job.keys[k], job.records[k], _outputs(self.stages[k], state),
                       _generator(self.stages[k], state), _KINDS)
        job.stored = job.done
        job.state, job.held = None, 0
        logger.debug("batch: %s waits on disk after %s (%d bytes, %d held)", job.name,
                     self.stages[job.done - 1].name, size, held)

    def _restore(self, job: _Job, k: int) -> RunState:
        """The state before stage ``k``: the provided fields, then every earlier stage's outputs from disk, and
        the generator as the last earlier stage that draws from it left it (freshly seeded if none has)."""
        needs_input = any("input_image" in s.inputs for s in self.stages[k:])
        image = as_image(job.source) if needs_input else None
        state = self.pipe.new_state(image, seed=job.seed, fov=self.fov, progress=self.progress,
                                    callback=self._job_callback(job))
        from_records = not job.records  # resumed from the work directory: the records come from there too
        for i in range(k):
            stored = self._disk().load(job.name, job.keys[i], self.pipe.device)
            for name, value in stored.outputs.items():
                setattr(state, name, value)
            if stored.generator_state is not None:
                state.generator.set_state(stored.generator_state)
            if from_records:
                job.records.append(stored.record)
        return state

    def _disk(self) -> WorkDir:
        """Where states wait between stages: the work directory, else a folder of this process under the
        pixal3d cache (``spill_root()``, removed at the end)."""
        if self.store is not None:
            return self.store
        if self._spill is None:
            self._spill_root = new_spill_folder()
            self._spill = WorkDir(self._spill_root)
        return self._spill

    @contextmanager
    def _session(self) -> Iterator[None]:
        desc = self.jobs[0].name if len(self.jobs) == 1 else f"{len(self.jobs)} images"
        self._bar = tqdm(total=len(self.jobs) * len(self.stages), desc=desc, unit="stage", disable=not self.progress)
        try:
            yield
        finally:
            self._bar.close()
            if self._spill_root is not None:
                shutil.rmtree(self._spill_root, ignore_errors=True)
                self._spill_root = self._spill = None
            for job in self.jobs:
                job.state = None

    # 4. progress -------------------------------------------------------------------------------------
    def _advance(self, stages: int) -> None:
        if self._bar is not None and stages:
            self._bar.update(stages)

    def _report(self, job: _Job, k: int) -> None:
        stage = self.stages[k]
        if len(self.jobs) > 1:
            self._bar.set_postfix_str(f"{stage.name} · {job.name} ({job.index + 1}/{len(self.jobs)})")
        else:
            self._bar.set_postfix_str(stage.name)
        if self.callback is not None:
            self.callback({"kind": "stage", "stage": stage.name, "index": k, "stages": len(self.stages),
                           "image": job.name, "image_index": job.index, "images": len(self.jobs)})
        if job.state is not None:
            job.state.callback = self._job_callback(job)

    def _job_callback(self, job: _Job) -> Callable[[dict[str, Any]], None] | None:
        callback = self.callback
        if callback is None:
            return None
        extra = {"image": job.name, "image_index": job.index, "images": len(self.jobs)}
        return lambda info: callback({**info, **extra})

    def _image_trace(self, job: _Job) -> Path | None:
        if self.trace is None or len(self.jobs) == 1:
            return self.trace
        return self.trace.with_name(f"{self.trace.stem}.{job.name}{self.trace.suffix}")


_KINDS = state_codec.declared_kinds(RunState)


def _outputs(stage: Any, state: RunState) -> dict[str, Any]:
    """The stage's declared (non-transient) outputs, as the state holds them now."""
    return {name: getattr(state, name) for name in stage.outputs}


def _generator(stage: Any, state: RunState) -> torch.Generator | None:
    """The generator to store with ``stage``'s outputs: the one it draws from, if any (``Stage.draws``)."""
    return getattr(state, stage.draws) if stage.draws is not None else None


def _input_digest(source: Any) -> str:
    """sha256 of the input: the file's bytes, or an in-memory image's mode, size and pixels."""
    digest = hashlib.sha256()
    if isinstance(source, (str, Path)):
        with open(source, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    elif isinstance(source, Image.Image):
        digest.update(f"{source.mode}|{source.size}|".encode())
        digest.update(source.tobytes())
    elif isinstance(source, np.ndarray):
        digest.update(f"{source.dtype}|{source.shape}|".encode())
        digest.update(np.ascontiguousarray(source).tobytes())
    else:
        raise ImageError(f"the input must be a path, a PIL image or a uint8 array, not {type(source).__name__}")
    return digest.hexdigest()


def _weights_digests(weights: Any) -> dict[str, str]:
    """Model name → its files' path, size and modification time (a Hub snapshot path names the revision)."""
    def stat(path: Path) -> str:
        info = path.stat()
        return f"{path}|{info.st_size}|{info.st_mtime_ns}"

    out = {}
    for name, path in weights.safetensors().items():
        parts = [stat(path)]
        config = path.with_suffix(".json")
        if name in weights.checkpoints and config.exists():
            parts.append(stat(config))
        out[name] = ";".join(parts)
    out["rembg"] = f"rembg:{weights.rembg}"
    if weights.moge is not None:
        out["moge"] = str(weights.moge)
    return out
