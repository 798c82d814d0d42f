"""The durable queue on disk (``--data DIR``): every job's input and settings, its status once it ends, its results.

Layout::

    DIR/pixal3d-serve.json         marks the folder as a job server's data (a non-empty folder without it is refused)
    DIR/jobs/<id>/job.json         settings, submission time and sequence number: written before ``202`` is returned
    DIR/jobs/<id>/input.<ext>      the uploaded image, byte for byte
    DIR/jobs/<id>/status.json      the job's end (done, failed, cancelled) with its stage rows: the commit point
    DIR/jobs/<id>/result.glb       the GLB, run.json and the memory trace of a done job
    DIR/jobs/<id>/attempts.jsonl   one line each time a worker starts or finishes the job
    DIR/work/<id>/<stage>.*        the job's stage records (``pipelines/work_dir.py``): a restarted job resumes there

A job is created in a hidden folder (``.new-<id>``) whose files are flushed to disk, then renamed to its id and the
folder flushed: a kill at any instant leaves the whole job or none (leftovers are removed at the next start). A job
without ``status.json`` is waiting: at start every such job is queued again in submission order, and a worker
resumes it at its first unrecorded stage. Job ids are 128 random bits in hex (``new_id``); a request's id is
checked against that form (``check_id``) before it comes near a path, so no path outside ``DIR`` is ever built.
"""
from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pixal3d.files import sync_folder, write_bytes_atomic, write_json_atomic

from ..work_dir import WorkDir

logger = logging.getLogger(__name__)

MARKER = "pixal3d-serve.json"
LOCK = ".pixal3d-serve.lock"
FORMAT = "pixal3d-serve/1"
ID_PATTERN = re.compile(r"[0-9a-f]{32}")
ENDED = ("done", "failed", "cancelled")


class DataDirError(ValueError):
    """The data folder cannot be used (not ours, not writable)."""


def new_id() -> str:
    """A job id: 128 random bits as 32 hex digits (never derived from anything a client sends)."""
    return secrets.token_hex(16)


def check_id(text: str) -> str | None:
    """``text`` when it has the form of a job id, else None (it is then never used to build a path)."""
    return text if ID_PATTERN.fullmatch(text) else None


@dataclass
class StoredJob:
    """What the data folder holds of one job."""

    id: str
    sequence: int
    submitted: float
    settings: dict[str, Any]
    input: str
    status: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class JobStore:
    """The data folder at ``root`` (created if needed)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        try:
            if self.root.is_dir() and not (self.root / MARKER).exists() and any(self.root.iterdir()):
                raise DataDirError(f"--data {self.root} already holds files and is not a pixal3d-serve data folder "
                                   f"(no {MARKER}); choose an empty or new folder")
            self.jobs.mkdir(parents=True, exist_ok=True)
            if not (self.root / MARKER).exists():
                write_json_atomic(self.root / MARKER, {"format": FORMAT})
            self.work = WorkDir(self.root / "work")
        except OSError as err:
            raise DataDirError(f"--data {self.root} cannot be used ({err.strerror or err}); choose another "
                               f"folder") from None

    def clean(self) -> None:
        """Remove jobs killed while being created (never acknowledged); the server calls it once, at start."""
        for leftover in self.jobs.glob(".new-*"):
            shutil.rmtree(leftover, ignore_errors=True)

    @property
    def jobs(self) -> Path:
        return self.root / "jobs"

    def folder(self, job_id: str) -> Path:
        """The job's folder (``job_id`` must have passed ``check_id``)."""
        if check_id(job_id) is None:
            raise ValueError(f"{job_id!r} is not a job id")
        return self.jobs / job_id

    def work_folder(self, job_id: str) -> Path:
        """The job's stage records (``WorkDir.folder``)."""
        return self.work.folder(self.folder(job_id).name)

    # -- writing ------------------------------------------------------------------------------
    def create(self, job_id: str, sequence: int, image: bytes, suffix: str, settings: Mapping[str, Any]) -> StoredJob:
        """Write the job's input and settings durably, then make it visible under its id (the commit point)."""
        final = self.folder(job_id)
        staging = self.jobs / f".new-{job_id}"
        staging.mkdir()
        try:
            name = f"input{suffix}"
            write_bytes_atomic(staging / name, image)
            job = StoredJob(job_id, sequence, time.time(), dict(settings), name)
            write_json_atomic(staging / "job.json", {"format": FORMAT, "id": job_id, "sequence": sequence,
                                                     "submitted": job.submitted, "settings": job.settings,
                                                     "input": name})
            os.rename(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        sync_folder(self.jobs)
        return job

    def end(self, job_id: str, status: Mapping[str, Any]) -> None:
        """Record how the job ended (``status["status"]`` one of ``ENDED``), atomically and durably."""
        write_json_atomic(self.folder(job_id) / "status.json", {"format": FORMAT, **status})

    def attempt(self, job_id: str, line: Mapping[str, Any]) -> None:
        """Append one line to the job's attempts log (a worker started or finished it)."""
        with open(self.folder(job_id) / "attempts.jsonl", "a", encoding="utf-8") as log:
            log.write(json.dumps({"time": time.time(), **line}) + "\n")

    def remove(self, job_id: str) -> None:
        """Remove the job and its stage records (retention)."""
        shutil.rmtree(self.work_folder(job_id), ignore_errors=True)
        shutil.rmtree(self.folder(job_id), ignore_errors=True)

    # -- reading ------------------------------------------------------------------------------
    def load(self) -> Iterator[StoredJob]:
        """Every job in the folder, in submission order (an unreadable one is logged and left alone)."""
        found = []
        for folder in self.jobs.iterdir():
            if check_id(folder.name) is None:
                continue
            try:
                meta = json.loads((folder / "job.json").read_text())
                status_path = folder / "status.json"
                status = json.loads(status_path.read_text()) if status_path.exists() else None
            except (OSError, ValueError) as err:
                logger.warning("job %s cannot be read (%s); left as it is", folder.name, err)
                continue
            found.append(StoredJob(meta["id"], meta["sequence"], meta["submitted"], meta["settings"], meta["input"],
                                   status))
        yield from sorted(found, key=lambda job: job.sequence)

    def file(self, job_id: str, name: str) -> Path | None:
        """One of the job's result files (``name`` from a fixed set), when it exists."""
        if name not in ("result.glb", "run.json", "trace.jsonl"):
            raise ValueError(f"{name!r} is not a job file")
        path = self.folder(job_id) / name
        return path if path.is_file() else None

    def attempts(self, job_id: str) -> list[dict[str, Any]]:
        """The job's attempts log."""
        path = self.folder(job_id) / "attempts.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

