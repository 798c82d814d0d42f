"""The data folder (``--data DIR``, the same path on every machine of one queue): what the jobs read and write.
The queue itself (which jobs exist, their state, leases and ends) is the database's (``db/``); files here belong to
a job only while it has a row there.

Layout::

    DIR/pixal3d-serve.json        marks the folder as a job server's data (a non-empty folder without it is refused);
                                  its format says whether the jobs are in the queue's database (``pixal3d-serve/2``)
                                  or still files only (``pixal3d-serve/1``: moved in at the first start, ``db/migrate``)
    DIR/queue.sqlite3             the queue, when it is SQLite (the default)
    DIR/jobs/<id>/input.<ext>     the uploaded image, byte for byte: written and flushed before the job's row is
    DIR/jobs/<id>/views/          a multi-view config's upload instead: the view images and their transforms.json
                                  (each kind of input writes its own: ``InputKind.receive``)
    DIR/jobs/<id>/upload.json     the kind of input the job runs as, when it is not the config's own (an image with a
                                  mesh on a single-view config: ``{"input_kind": "mesh"}``, the mesh in ``mesh/``)
    DIR/jobs/<id>/result.glb      a done job's GLB, run.json and memory trace
    DIR/work/<id>/<stage>.*       the job's stage records (``pipelines/work_dir.py``): whichever worker runs the job
                                  next resumes there
    DIR/workers/<name>.lock       held by the worker of that name while it runs (one process per name)

Every file is written to a temporary name and renamed (``pixal3d.files``). Job ids are 128 random bits in hex
(``new_id``); a request's id is checked against that form (``check_id``) before it comes near a path, so no path
outside ``DIR`` is ever built.
"""
from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from pixal3d.files import sync_folder, write_bytes_atomic, write_json_atomic

from ..work_dir import WorkDir, somebody_elses

MARKER = "pixal3d-serve.json"
FORMAT = "pixal3d-serve/2"
FILES_ONLY = "pixal3d-serve/1"
"""The format of a data folder whose jobs are files only (before the queue moved into a database)."""
ID_PATTERN = re.compile(r"[0-9a-f]{32}")
RESULTS = ("result.glb", "run.json", "trace.jsonl")
UPLOAD_RECORD = "upload.json"
"""Beside a job's upload: the kind of input it runs as, when it is not the config's own (``DataFolder.input_kind``)."""
FULL = (errno.ENOSPC, errno.EDQUOT)


class DataDirError(ValueError):
    """The data folder cannot be used (not ours, not writable)."""


class DiskFull(OSError):
    """The data folder's disk (or quota) is full: a job could not be written; nothing of it is left."""


def new_id() -> str:
    """A job id: 128 random bits as 32 hex digits (never derived from anything a client sends)."""
    return secrets.token_hex(16)


def check_id(text: str) -> str | None:
    """``text`` when it has the form of a job id, else None (it is then never used to build a path)."""
    return text if ID_PATTERN.fullmatch(text) else None


SUBFOLDERS = ("jobs", "work", "workers")
"""What a data folder holds besides its marker (a folder holding only these is one being made)."""


class DataFolder:
    """The data folder at ``root`` (created if needed)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        marker = self.root / MARKER
        try:
            if somebody_elses(self.root, MARKER, SUBFOLDERS):
                raise DataDirError(f"--data {self.root} already holds files and is not a pixal3d-serve data folder "
                                   f"(no {MARKER}); choose an empty or new folder")
            self.jobs.mkdir(parents=True, exist_ok=True)
            if not marker.exists():
                write_json_atomic(marker, {"format": FORMAT})
            self.work = WorkDir(self.root / "work")
            (self.root / "workers").mkdir(exist_ok=True)
        except OSError as err:
            raise DataDirError(f"--data {self.root} cannot be used ({err.strerror or err}); choose another "
                               f"folder") from None

    @property
    def jobs(self) -> Path:
        return self.root / "jobs"

    def files_only(self) -> bool:
        """Whether the jobs here are still files only (an older server's folder): ``db.migrate`` moves them in."""
        try:
            return json.loads((self.root / MARKER).read_text()).get("format") == FILES_ONLY
        except (OSError, ValueError):
            return False

    def mark_migrated(self, queue: str) -> None:
        """The jobs are in the queue's database now (``queue``: where, for a reader of the folder)."""
        write_json_atomic(self.root / MARKER, {"format": FORMAT, "migrated_to": queue})

    def worker_lock(self, name: str) -> Path:
        """The lock file of worker ``name``."""
        return self.root / "workers" / f"{re.sub(r'[^A-Za-z0-9._-]', '_', name)}.lock"

    def folder(self, job_id: str) -> Path:
        """The job's folder (``job_id`` must have passed ``check_id``)."""
        if check_id(job_id) is None:
            raise ValueError(f"{job_id!r} is not a job id")
        return self.jobs / job_id

    def work_folder(self, job_id: str) -> Path:
        """The job's stage records (``WorkDir.folder``)."""
        return self.work.folder(self.folder(job_id).name)

    def write_input(self, job_id: str, image: bytes, suffix: str) -> str:
        """Write the job's image durably (file and folder flushed); returns its name in the job's folder.
        ``DiskFull`` when the disk is full, with nothing left behind."""
        def write(folder: Path) -> Path:
            write_bytes_atomic(folder / f"input{suffix}", image)
            return folder / f"input{suffix}"

        return self.write_upload(job_id, write)

    def write_upload(self, job_id: str, write: Callable[[Path], Path]) -> str:
        """The job's folder made, ``write(folder)`` into it (returning the input's path in it: a file, or a folder
        such as ``views/``), the folder flushed; returns the input's name in the job's folder. On any error nothing
        is left behind; a full disk is ``DiskFull``, one line naming --data."""
        folder = self.folder(job_id)
        try:
            folder.mkdir()
            name = Path(write(folder)).relative_to(folder).as_posix()
            sync_folder(self.jobs)
        except OSError as err:
            shutil.rmtree(folder, ignore_errors=True)
            if err.errno in FULL:
                raise DiskFull(err.errno, f"the data folder's disk is full ({err.strerror}); free some space "
                                          f"under --data {self.root}") from None
            raise
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return name

    def record_kind(self, folder: Path, kind: str) -> None:
        """Record in a job's ``folder`` (while ``write_upload`` writes it) that the job runs as the kind of input
        named ``kind``."""
        write_json_atomic(folder / UPLOAD_RECORD, {"input_kind": kind})

    def input_kind(self, job_id: str) -> str | None:
        """The kind of input the job runs as, as its submission recorded it; None: the config's own."""
        path = self.folder(job_id) / UPLOAD_RECORD
        return json.loads(path.read_text())["input_kind"] if path.is_file() else None

    def file(self, job_id: str, name: str) -> Path | None:
        """One of the job's result files (``name`` from ``RESULTS``), when it exists."""
        if name not in RESULTS:
            raise ValueError(f"{name!r} is not a job file")
        path = self.folder(job_id) / name
        return path if path.is_file() else None

    def for_client(self, text: str) -> str:
        """``text``, an error a client will read, in the client's words: a file inside a job's upload by its name in
        the upload (``transforms.json``, ``view00.png``), the upload itself as "the uploaded <its name>" (``the
        uploaded views``, ``the uploaded input``), a stage record by its file name, and any other path under the
        data folder without the server's layout."""
        jobs, work = re.escape(str(self.jobs)), re.escape(str(self.work.root))
        text = re.sub(rf"{jobs}/[^/\s]+/[^/\s]+/", "", text)
        text = re.sub(rf"{jobs}/[^/\s]+/([A-Za-z0-9_-]+)(?:\.[A-Za-z0-9]+)?\b", r"the uploaded \1", text)
        text = re.sub(rf"(?:{jobs}|{work})/[^/\s]+/", "", text)
        text = re.sub(rf"{jobs}/[^/\s;,)]+", "the job's upload", text)
        return text.replace(str(self.root), "the server's data folder")

    def remove(self, job_id: str) -> None:
        """Remove the job's files and stage records (retention)."""
        shutil.rmtree(self.work_folder(job_id), ignore_errors=True)
        shutil.rmtree(self.folder(job_id), ignore_errors=True)

    def folders(self, older_than: float) -> list[str]:
        """The ids of the job folders (and stage-record folders) last changed more than ``older_than`` seconds
        ago: the candidates for removal when no row names them (a submission killed before its row was written)."""
        found = set()
        cutoff = time.time() - older_than
        for parent in (self.jobs, self.work.root):
            for entry in os.scandir(parent):
                if check_id(entry.name) is not None and entry.is_dir() and entry.stat().st_mtime < cutoff:
                    found.add(entry.name)
        return sorted(found)
