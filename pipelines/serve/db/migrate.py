"""Bring the jobs of an older server's data folder into the queue's database.

Until the queue moved into a database (data format ``pixal3d-serve/1``) every job was files only:
``jobs/<id>/job.json`` (settings, submission time and sequence), ``status.json`` once it ended and
``attempts.jsonl``. ``adopt_folder`` inserts each such job in its old submission order, waiting or ended as it was,
with its attempts; its input, results and stage records stay where they are (the new layout keeps those paths). A
job already in the database is left alone, so a migration cut short runs again from the start.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .jobs import Queue

logger = logging.getLogger(__name__)

ID_PATTERN = re.compile(r"[0-9a-f]{32}")


def old_jobs(root: Path) -> list[dict[str, Any]]:
    """The jobs of the files-only layout under ``root/jobs``, in submission order (an unreadable one is logged and
    left out: it stays on disk)."""
    found = []
    jobs = root / "jobs"
    for folder in jobs.iterdir() if jobs.is_dir() else ():
        meta_path = folder / "job.json"
        if not ID_PATTERN.fullmatch(folder.name) or not meta_path.exists():
            continue
        try:
            meta = json.loads(meta_path.read_text())
            status_path = folder / "status.json"
            status = json.loads(status_path.read_text()) if status_path.exists() else None
            attempts_path = folder / "attempts.jsonl"
            attempts = [json.loads(line) for line in attempts_path.read_text().splitlines() if line.strip()] \
                if attempts_path.exists() else []
        except (OSError, ValueError) as err:
            logger.warning("job %s cannot be read (%s); left as it is", folder.name, err)
            continue
        if status is not None:
            status = {k: v for k, v in status.items() if k != "format"}
        found.append({"id": folder.name, "sequence": meta["sequence"], "submitted": meta["submitted"],
                      "settings": meta["settings"], "input": meta["input"], "status": status, "attempts": attempts})
    return sorted(found, key=lambda job: job["sequence"])


def adopt_folder(queue: Queue, root: Path, plan: Callable[[dict[str, Any]], str]) -> int:
    """Insert the files-only jobs of the data folder ``root`` into ``queue`` (``plan``: a job's group key from its
    settings); returns how many were new to it. The folders of jobs killed while they were being created (never
    acknowledged) are removed."""
    for leftover in (root / "jobs").glob(".new-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    added = 0
    for job in old_jobs(root):
        added += queue.adopt(job["id"], job["submitted"], job["settings"], plan(job["settings"]), job["input"],
                             job["status"], job["attempts"])
    return added
