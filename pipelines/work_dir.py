"""WorkDir: every finished stage's outputs on disk, so a killed run resumes where it stopped.

Layout, one folder per image (its batch name)::

    DIR/pixal3d-work.json             marks the folder as a work directory (a non-empty folder without it is refused)
    DIR/<image>/<stage>.safetensors   the stage's outputs (``state_codec``) and, if it draws from the run's
                                      generator, the generator's state after it
    DIR/<image>/<stage>.json          the record: its key, what the key was made of, the StageRecord, the field
                                      descriptions; written last, so it is the commit point of the stage

Each stage's *key* is a sha256 over what decides its outputs: the previous stage's key, the stage itself (its
class and settings, i.e. its part of the config), the run inputs it reads (the input bytes, the seed, the field of
view, the device, the latent normalizations), the files of the models it needs (path, size, modification time:
for the Hub that is the pinned revision's snapshot) and the torch and pixal3d versions. A stored record counts
only when its key is the one this run would make, and the safetensors file beside it carries the same key in its
metadata, is as long as its header says, and hashes to the sha256 its record stored when it was written
(``data_sha256``): a record damaged on disk (a flipped bit, a truncated copy) is named in one line, dropped, and
its stage recomputed from the last sound record. So a changed seed keeps ``preprocess``, ``camera`` and ``features``
(they do not read the generator) and recomputes from ``structure``; a changed export setting recomputes only ``export``.

Both files are written atomically (``pixal3d.files``), the safetensors first: a kill at any instant leaves
either the complete record or none (a leftover temporary file is removed on the next open).

The run that opened an image's records last owns them: ``scan`` writes a fresh token to ``DIR/<image>/.owner``
and ``save`` writes only while the file still holds this run's token (``RecordsTakenOver`` otherwise). So a run
paused for longer than its job's lease (SIGSTOP, a frozen container) and taken over meanwhile, here or on another
machine, writes nothing when it wakes: the job server's queue lease decides who runs a job, not a file lock the
paused process would hold forever.

``StateStore`` is the executor's store (``pixal3d.staging.executor.Store``) over these records: with a work
directory every stage is saved as it finishes and a run resumes from what is there; with or without one, a
state that does not fit the batch's state budget waits on disk between stages (without one, in a folder of
this process under ``spill_root()``) and is restored for its next stage.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from PIL import Image
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import pixal3d
from pixal3d.files import atomic_path, write_json_atomic
from pixal3d.hub import cache_root
from pixal3d.models.preprocess import ImageError
from pixal3d.staging import (
    SafetensorsHeaderError,
    Stage,
    StageRecord,
    read_safetensors_header,
)
from pixal3d.staging.executor import Item, Store

from . import state_codec

logger = logging.getLogger(__name__)

MARKER = "pixal3d-work.json"
LOCK = ".pixal3d-work.lock"
"""Held (``pixal3d.locks``) by the command while it uses the directory: one run at a time."""
RECORD_FORMAT = "pixal3d-stage-record/1"
GENERATOR_KEY = "__generator__"
"""The run's CPU generator state after a stage that draws from it (a uint8 tensor). Only such a stage stores
it: its key covers the seed, and a stage that does not read the generator leaves it as it found it."""


class WorkDirError(ValueError):
    """The work directory cannot be used (not ours, not writable)."""


class RecordsTakenOver(RuntimeError):
    """Another run opened this image's records after this one (``WorkDir.scan``): this one writes no more of them."""


OWNER = ".owner"
"""In an image's folder: the token of the run that opened its records last (``WorkDir.scan``)."""


@dataclass(frozen=True)
class StageKey:
    """One stage's key for one image and the parts it was hashed from (kept to say why a record is stale)."""

    stage: str
    digest: str
    parts: dict[str, Any]


@dataclass
class StoredStage:
    """A stage read back: its record and its outputs (``{field: value}``), plus the generator state after it
    (None for a stage that does not draw from the generator)."""

    record: StageRecord
    outputs: dict[str, Any]
    generator_state: torch.Tensor | None


# -- keys -----------------------------------------------------------------------------------------
def item_keys(stages: Sequence[Stage], kind: Any, digest: str | None, item: Any, *, device: Any, weights: Any,
              digests: Mapping[str, Any], fields: Sequence[str]) -> list[StageKey]:
    """The chained keys of a batch item's stages: what decides each stage's outputs, from the input's digest (its
    kind's provided fields; ``fields``: every kind's, ``inputs.INPUT_FIELDS``, the others None), the seed and field
    of view, the device, the weights (their normalisations, their files: ``digests``) and the versions."""
    provided = {**{field: None for field in fields}, **kind.provided(digest), "generator": item.seed,
                "fov_deg": item.fov, "device": str(device), "shape_normalization": repr(weights.shape_normalization),
                "tex_normalization": repr(weights.tex_normalization)}
    return stage_keys(stages, provided, digests, {"torch": torch.__version__, "pixal3d": pixal3d.__version__})


def stage_keys(stages: Sequence[Stage], provided: Mapping[str, Any], weights: Mapping[str, Any],
               versions: Mapping[str, str]) -> list[StageKey]:
    """The chained key of every stage: ``provided`` maps the run's provided fields to JSON-ready values that
    identify them (fields absent from it, such as a progress flag, decide nothing), ``weights`` each model
    name to what identifies its files."""
    keys, upstream = [], ""
    for stage in stages:
        parts = {
            "upstream": upstream,
            "stage": stage_identity(stage),
            "provided": {f: provided[f] for f in stage.inputs if f in provided},
            "weights": {m: weights.get(m) for m in stage.needs},
            "versions": dict(versions),
        }
        upstream = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
        keys.append(StageKey(stage.name, upstream, parts))
    return keys


def stage_identity(stage: Stage) -> str:
    """sha256 of the stage's class and its settings (its attributes as canonical JSON)."""
    cls = type(stage)
    data = {"class": f"{cls.__module__}.{cls.__qualname__}", "settings": _canonical(vars(stage))}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _canonical(value: Any) -> Any:
    """A JSON-ready form that depends only on the value (never on object addresses); callables are skipped."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"class": type(value).__qualname__,
                **{f.name: _canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in value.items() if not callable(v)}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_canonical(v) for v in value if not callable(v)]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    return type(value).__qualname__


def why_stale(stored: Mapping[str, Any], expected: StageKey) -> str:
    """What differs between a stored record's key parts and this run's, in words."""
    old = stored.get("parts", {})
    new = expected.parts
    reasons = []
    for field, value in new["provided"].items():
        before = old.get("provided", {}).get(field)
        if before != value:
            if field == "generator":
                reasons.append(f"seed {before} (now {value})")
            elif field == "input_image":
                reasons.append("a different input image")
            else:
                reasons.append(f"{field} {before} (now {value})")
    if old.get("stage") != new["stage"]:
        reasons.append(f"other {expected.stage} settings")
    changed = sorted(m for m, v in new["weights"].items() if old.get("weights", {}).get(m) != v)
    if changed:
        reasons.append(f"other weights for {', '.join(changed)}")
    if old.get("versions") != new["versions"]:
        reasons.append(f"other versions ({old.get('versions')})")
    return ", ".join(reasons) or "a different earlier stage"


# -- the directory --------------------------------------------------------------------------------
def somebody_elses(folder: Path, marker: str, ours: Sequence[str] = ()) -> bool:
    """Whether ``folder`` holds files and is not this kind of folder: no ``marker`` in it, and entries that neither
    its making leaves (``ours``: its subfolders) nor a temporary file of ours is (``.NAME.<random>.tmp``). A folder
    holding only those is one that another process, started at the same moment, is making right now (a fleet
    started at once). The entries are listed before the marker is looked for: a process making the folder writes
    its marker before anything else of its own, so whatever of its making the listing saw, the look after it sees
    the marker too (looked for first, the marker written in between made the folder look like somebody else's)."""
    if not folder.is_dir():
        return False
    entries = [entry.name for entry in folder.iterdir()
               if entry.name not in ours and not (entry.name.startswith(".") and entry.name.endswith(".tmp"))]
    return bool(entries) and not (folder / marker).exists()


class WorkDir:
    """A work directory at ``root`` (created if needed); refuses a non-empty folder that is not one."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._tokens: dict[str, str] = {}  # image -> the token this run wrote to its .owner when it opened it
        marker = self.root / MARKER
        try:
            if somebody_elses(self.root, MARKER):
                raise WorkDirError(f"work directory {self.root} already holds files and is not a pixal3d work "
                                   f"directory (no {MARKER}); choose an empty or new folder")
            self.root.mkdir(parents=True, exist_ok=True)
            if not marker.exists():
                write_json_atomic(marker, {"format": RECORD_FORMAT, "layout": "<image>/<stage>.safetensors + "
                                                                             "<image>/<stage>.json"})
            with tempfile.NamedTemporaryFile(dir=self.root, prefix=".pixal3d-write-test-", suffix=".tmp"):
                pass  # a read-only folder (or file system) is refused now, not at the first stage's record
        except OSError as err:
            raise WorkDirError(f"work directory {self.root} cannot be used ({err.strerror or err}); "
                               f"choose another work_dir") from None

    def folder(self, image: str) -> Path:
        """The image's folder (its name made file-system safe)."""
        return self.root / (re.sub(r"[^A-Za-z0-9._-]", "_", image).lstrip(".") or "_")

    def _paths(self, image: str, stage: str) -> tuple[Path, Path]:
        folder = self.folder(image)
        return folder / f"{stage}.safetensors", folder / f"{stage}.json"

    # -- writing ------------------------------------------------------------------------------
    def save(self, image: str, key: StageKey, record: StageRecord, outputs: Mapping[str, Any],
             generator: torch.Generator | None, kinds: Mapping[str, str] | None = None) -> None:
        """Write the stage's outputs (each of the kind ``kinds`` declares, when given; and ``generator``'s state:
        pass it for a stage that draws from the generator), then its record; each atomically, the record last."""
        tensors, fields = state_codec.encode(outputs, kinds)
        if generator is not None:
            tensors[GENERATOR_KEY] = generator.get_state()
        data, meta = self._paths(image, key.stage)
        self._check_owner(image, key.stage)
        data.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(data) as tmp:
            save_tensors(tensors, tmp, data, metadata={"key": key.digest, "format": RECORD_FORMAT})
            content = file_sha256(tmp)
        self._check_owner(image, key.stage)  # again just before the commit point: the outputs took a while
        write_json_atomic(meta, {"format": RECORD_FORMAT, "image": image, "stage": key.stage, "key": key.digest,
                                 "data_sha256": content, "parts": key.parts, "record": dataclasses.asdict(record),
                                 "fields": fields})

    def _check_owner(self, image: str, stage: str) -> None:
        """Raise ``RecordsTakenOver`` when another run has opened ``image``'s records since this one did."""
        token = self._tokens.get(image)
        if token is None:  # never opened by this run (a batch's spill folder): nobody else writes there
            return
        try:
            current = (self.folder(image) / OWNER).read_text()
        except FileNotFoundError:
            current = None  # the folder was removed: its job ended elsewhere
        if current != token:
            raise RecordsTakenOver(f"the records of {image} in {self.root} were taken over by another run while "
                                   f"this one was paused or slow; its {stage} is not written (the other run has "
                                   f"the job now)")

    def discard(self, image: str, stages: Sequence[str]) -> None:
        """Remove the records of ``stages`` (stale ones), record first."""
        for stage in stages:
            data, meta = self._paths(image, stage)
            meta.unlink(missing_ok=True)
            data.unlink(missing_ok=True)

    # -- reading ------------------------------------------------------------------------------
    def scan(self, image: str, keys: Sequence[StageKey]) -> tuple[int, str | None]:
        """How many leading stages have a valid record for these keys, and a line saying why the next stored
        one (if any) is not used. Stale and broken records from there on are removed, with leftover temporary
        files."""
        folder = self.folder(image)
        if folder.is_dir():
            for tmp in folder.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)
        token = f"{os.getpid()} {secrets.token_hex(8)}"
        folder.mkdir(parents=True, exist_ok=True)
        with atomic_path(folder / OWNER) as tmp:
            tmp.write_text(token)
        self._tokens[image] = token  # from now on a run that opened them earlier writes none of them
        note = None
        done = 0
        for key in keys:
            stored = self._read_record(image, key.stage)
            if stored is None:
                break
            if stored.get("unreadable"):
                note = f"{image}: the stored {key.stage} record is unreadable; recomputing from {key.stage}"
                break
            if stored.get("key") != key.digest:
                note = (f"{image}: the stored records from {key.stage} on were made with {why_stale(stored, key)}; "
                        f"recomputing from {key.stage}")
                break
            problem = self._check_data(image, key, stored)
            if problem:
                note = f"{image}: the stored {key.stage} record is unusable ({problem}); recomputing from {key.stage}"
                break
            done += 1
        self.discard(image, [k.stage for k in keys[done:]])
        return done, note

    def load(self, image: str, key: StageKey, device: torch.device) -> StoredStage:
        """Read one stage's record and outputs (``scan`` has checked them)."""
        data, _ = self._paths(image, key.stage)
        stored = self._read_record(image, key.stage)
        if stored is None or stored.get("key") != key.digest:
            raise WorkDirError(f"the {key.stage} record of {image} in {self.root} changed while the run used it")
        tensors = load_file(str(data))
        generator_state = tensors.pop(GENERATOR_KEY, None)
        outputs = state_codec.decode(tensors, stored["fields"], device)
        return StoredStage(StageRecord(**stored["record"]), outputs, generator_state)

    def _read_record(self, image: str, stage: str) -> dict[str, Any] | None:
        _, meta = self._paths(image, stage)
        try:
            stored = json.loads(meta.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"unreadable": True}
        return stored if isinstance(stored, dict) and stored.get("format") == RECORD_FORMAT else {"unreadable": True}

    def _check_data(self, image: str, key: StageKey, stored: Mapping[str, Any]) -> str | None:
        """Why the data file beside a record whose key matches cannot be used, or None: its header, its key, and
        its bytes against the sha256 the record stored when it was written (a flipped bit anywhere counts)."""
        data, _ = self._paths(image, key.stage)
        try:
            header = read_safetensors_header(data)
        except SafetensorsHeaderError as err:
            return str(err)
        if header.metadata.get("key") != key.digest:
            return f"{data.name} belongs to another run"
        expected = stored.get("data_sha256")
        if not isinstance(expected, str):
            return f"{key.stage}.json holds no sha256 of {data.name} (an older pixal3d wrote it)"
        try:
            actual = file_sha256(data)
        except OSError as err:
            return f"{data.name} cannot be read: {err.strerror or err}"
        if actual != expected:
            return f"{data.name} is damaged: its bytes no longer match the sha256 in {key.stage}.json; dropped"
        return None


# -- the executor's store ---------------------------------------------------------------------------
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


class StateStore(Store):
    """States between stages for items that carry their stage keys (``item.keys``): every stage recorded in
    ``work`` (when given) and resumed from it; a state kept in memory while the states held stay within
    ``budget`` bytes, else on disk until ``restore``. ``kinds``: each output field's codec kind."""

    def __init__(self, stages: Sequence[Stage], device: torch.device, *, work: WorkDir | None, budget: int,
                 kinds: Mapping[str, str]):
        self.stages, self.device, self.work, self.budget, self.kinds = list(stages), device, work, budget, kinds
        self._held: dict[int, int] = {}    # item index -> bytes its state holds in memory
        self._stored: dict[int, int] = {}  # item index -> leading stages whose outputs are on disk
        self._spill: WorkDir | None = None

    def resume(self, item: Item) -> int:
        if self.work is None:
            return 0
        done, note = self.work.scan(item.name, item.keys)
        if note:
            logger.warning("work dir %s: %s", self.work.root, note)
            item.notes.append(note)
        self._stored[item.index] = done
        return done

    def saved(self, item: Item, k: int) -> None:
        if self.work is not None:
            self._save(self.work, item, k)
            self._stored[item.index] = k + 1

    def between(self, item: Item, k: int) -> bool:
        size = state_codec.nbytes(item.state)
        held = sum(n for index, n in self._held.items() if index != item.index)
        if held + size <= self.budget:
            self._held[item.index] = size
            return True
        disk = self._disk()
        for i in range(self._stored.get(item.index, 0), item.done):
            self._save(disk, item, i)  # the generator as it is now: stages after i that do not draw left it so
        self._stored[item.index] = item.done
        self._held.pop(item.index, None)
        logger.debug("batch: %s waits on disk after %s (%d bytes, %d held)", item.name, self.stages[k].name, size,
                     held)
        return False

    def restore(self, item: Item, k: int, state: Any) -> None:
        resumed = len(item.records) < k  # taken from the work directory: the records come from there too
        for i in range(k):
            stored = self._disk().load(item.name, item.keys[i], self.device)
            for name, value in stored.outputs.items():
                setattr(state, name, value)
            if stored.generator_state is not None:
                getattr(state, self.stages[i].draws).set_state(stored.generator_state)
            if resumed:
                item.records.append(dataclasses.replace(stored.record, reused=True))

    def forget(self, item: Item) -> None:
        self._held.pop(item.index, None)

    def close(self) -> None:
        if self._spill is not None:
            shutil.rmtree(self._spill.root, ignore_errors=True)
            self._spill = None

    def _disk(self) -> WorkDir:
        """The work directory, else this process's spill folder (made when first needed)."""
        if self.work is not None:
            return self.work
        if self._spill is None:
            self._spill = WorkDir(new_spill_folder())
        return self._spill

    def _save(self, disk: WorkDir, item: Item, k: int) -> None:
        stage, state = self.stages[k], item.state
        disk.save(item.name, item.keys[k], item.records[k], {name: getattr(state, name) for name in stage.outputs},
                  getattr(state, stage.draws) if stage.draws is not None else None, self.kinds)


_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def save_tensors(tensors: Mapping[str, torch.Tensor], tmp: Path, target: Path, *, metadata: dict[str, str]) -> None:
    """``safetensors.torch.save_file`` to ``tmp``; a failed write (a full disk, a read-only file system, a quota)
    is the ``OSError`` of the system's error number, naming ``target``, as every other write of the run reports
    it (``pipelines.errors.classify``), not safetensors' own ``SafetensorError`` with the number in its text."""
    try:
        save_file(dict(tensors), str(tmp), metadata=metadata)
    except SafetensorError as err:
        match = _OS_ERROR.search(str(err))
        if match is None:
            raise
        number = int(match[1])
        raise OSError(number, os.strerror(number), str(target)) from err


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def input_digest(source: Any) -> str:
    """sha256 of the input: the file's bytes, or an in-memory image's mode, size and pixels."""
    if isinstance(source, (str, Path)):
        return file_sha256(source)
    digest = hashlib.sha256()
    if isinstance(source, Image.Image):
        digest.update(f"{source.mode}|{source.size}|".encode())
        digest.update(source.tobytes())
    elif isinstance(source, np.ndarray):
        digest.update(f"{source.dtype}|{source.shape}|".encode())
        digest.update(np.ascontiguousarray(source).tobytes())
    else:
        raise ImageError(f"the input must be a path, a PIL image or a uint8 array, not {type(source).__name__}")
    return digest.hexdigest()


def weights_digests(weights: Any) -> dict[str, str]:
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
    for name, path in weights.sources.items():  # a source's files that are not safetensors: where they are
        out.setdefault(name, str(path))
    return out
