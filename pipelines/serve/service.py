"""What the API does with the queue and the data folder, for any replica: every answer is read from the database
(``db.Queue``), so any API process on the queue answers for any job, wherever it runs.

A submission writes the job's image under ``--data`` first (flushed), then its row (the commit point: ``202`` follows
it); a submission killed between the two leaves a folder no row names, which retention removes. Retention removes a
job's row first (it is gone for every replica at once), then its files.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from pixal3d.models.preprocess import ImageError

from ..inputs import InputKind
from ..job import plan_key
from .db import JobRow, Queue, QueueUnavailable
from .store import DataFolder, new_id

logger = logging.getLogger(__name__)

ORPHAN_SECONDS = 3600.0
"""A job folder without a row, older than this, is a submission that died before its row: removed by retention."""
MAX_LOST = 3
"""A job whose lease was lost this many times (its worker died, or its machine) ends failed."""


class Jobs:
    """The API's side of the queue.

    wake: called after each submission (a worker in this process then claims at once instead of at its next poll)
    """

    def __init__(self, queue: Queue, data: DataFolder, *, queue_size: int, keep_seconds: float | None,
                 wake: Callable[[], None] = lambda: None):
        self.queue, self.data, self.queue_size, self.keep_seconds, self.wake = queue, data, queue_size, keep_seconds, wake
        self._stopping = threading.Event()

    def submit(self, image: bytes, suffix: str, settings: dict[str, Any]) -> JobRow:
        """Write the job's image, then queue it; ``QueueFull`` when ``--queue-size`` jobs wait (nothing is kept),
        ``store.DiskFull`` when the data disk is full."""
        job_id = new_id()
        return self._queue(job_id, self.data.write_input(job_id, image, suffix), settings)

    def submit_upload(self, write: Callable[[Path], Path], settings: dict[str, Any], *,
                      kind: InputKind | None = None) -> JobRow:
        """Write the job's input in its new folder (``write(folder)`` returns its path: the kind's ``receive``,
        which checks it as a run will, ``ViewsError`` and the like leaving nothing), then queue it as ``submit``
        does. ``kind``: the kind of input the job runs as when it is not the config's own (an image with a mesh),
        recorded beside the upload for the worker (``DataFolder.record_kind``); its jobs batch only with jobs of that
        kind that share what its ``batch_key`` says (the same mesh)."""
        job_id = new_id()
        batch: dict[str, str] = {}

        def write_all(folder: Path) -> Path:
            written = write(folder)
            if kind is not None:
                batch.update(input_kind=kind.name, **kind.batch_key(folder))
                self.data.record_kind(folder, kind.name)
            return written

        try:
            name = self.data.write_upload(job_id, write_all)
        except ImageError as err:  # in the client's words: the files it sent, not the server's folders
            err.args = (self.data.for_client(str(err)),)
            raise
        return self._queue(job_id, name, settings, batch)

    def _queue(self, job_id: str, name: str, settings: dict[str, Any], batch: dict[str, str] | None = None) -> JobRow:
        try:
            job = self.queue.submit(job_id, settings, plan_key(settings, batch), name, queue_size=self.queue_size)
        except QueueUnavailable:
            raise  # its row may have been committed before the answer was lost: retention removes the folder if not
        except BaseException:
            self.data.remove(job_id)
            raise
        self.wake()
        return job

    def view(self, job_id: str) -> dict[str, Any] | None:
        """What ``GET /jobs/{id}`` shows (None: no such job)."""
        found = self.queue.view(job_id)
        if found is None:
            return None
        job, position = found
        view: dict[str, Any] = {"id": job.id, "status": job.status, "submitted": job.submitted,
                                "settings": job.settings}
        if job.status == "queued":
            view["position"] = position
        elif job.status == "running":
            view |= {"started": job.started, "worker": job.slot, "node": job.owner, "device": job.device,
                     "attempt": job.attempt, "cancelling": job.cancel, **job.progress}
        else:
            view |= job.outcome
            view.setdefault("finished", job.finished)
            if isinstance(view.get("error"), str):
                view["error"] = self.data.for_client(view["error"])
        if job.lost:
            view["lost"] = job.lost
        return view

    def cancel(self, job_id: str) -> str | None:
        """Cancel a queued job now, a running one at its next stage or step wherever it runs (its worker reads the
        flag with its next heartbeat); the status after, None when there is no such job."""
        return self.queue.cancel(job_id)

    def health(self, local: dict[str, Any] | None = None) -> dict[str, Any]:
        """What ``GET /health`` shows (besides the config): every live worker's devices, processes and jobs, the
        queue's depth, and this machine's memory. ``local``: this process's own workers (``Node.health``), shown as
        they are now rather than as of their last heartbeat."""
        slots = []
        for worker in self.queue.workers():
            for slot in worker.slots:
                slots.append({**slot, "name": worker.name, "host": worker.host, "role": worker.role})
        if local is not None:
            slots = [s for s in slots if s["name"] != local["name"]] + local["slots"]
        counts = self.queue.counts()
        process = psutil.Process()
        rss = process.memory_info().rss
        for child in process.children(recursive=True):
            try:
                rss += child.memory_info().rss
            except psutil.Error:
                pass
        return {"ready": bool(slots) and all(s["ready"] for s in slots), "devices": [s["device"] for s in slots],
                "workers": slots, "queue": counts["queued"], "running": counts["running"],
                "queue_database": self.queue.describe(),
                "memory": {"process_bytes": rss, "available_bytes": psutil.virtual_memory().available}}

    # -- retention ---------------------------------------------------------------------------
    def sweep(self) -> list[str]:
        """Remove the jobs that ended more than ``keep_seconds`` ago (rows, then files), the folders of submissions
        that never got a row, and give back the leases that expired; returns the removed jobs' ids."""
        self.queue.reap(max_lost=MAX_LOST)
        old = [] if self.keep_seconds is None else self.queue.ended_before(self.keep_seconds)
        self.queue.remove(old)
        for job_id in old:
            self.data.remove(job_id)
        candidates = self.data.folders(ORPHAN_SECONDS)
        for job_id in sorted(set(candidates) - self.queue.known(candidates)):
            logger.info("removing %s: a job folder no queued job names", job_id)
            self.data.remove(job_id)
        return old

    def sweep_forever(self) -> None:
        """Retention every minute or so (a tenth of ``keep_seconds`` when that is shorter), until ``stop``."""
        period = 60.0 if self.keep_seconds is None else min(60.0, max(1.0, self.keep_seconds / 10))
        while not self._stopping.wait(period):
            try:
                self.sweep()
            except Exception as err:  # noqa: BLE001 - retention tries again at its next turn; the API goes on
                logger.warning("retention: %s", " ".join(str(err).split()))

    def start(self) -> None:
        threading.Thread(target=self.sweep_forever, name="pixal3d-serve-retention", daemon=True).start()

    def stop(self) -> None:
        self._stopping.set()

