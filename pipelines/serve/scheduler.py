"""The queue in memory over the data folder, and one worker process per device fed from it.

The data folder (``store.JobStore``) is the truth; this is its view while the server runs: every job's place
(queued, running with stage and step, or how it ended), read from the folder at start, where every job without an
end is queued again in submission order. Each device gets a thread that starts its worker process, hands it the
next group (the oldest queued job and up to ``group_size - 1`` more queued with the same plan), relays the worker's
events into the jobs, and starts a new worker if one dies (its group goes back to the queue, resuming from the
records; a job whose worker died ``MAX_CRASHES`` times ends failed).
"""
from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from ..job import plan_key
from .store import ENDED, JobStore, StoredJob, new_id
from .worker import worker_main

logger = logging.getLogger(__name__)

MAX_CRASHES = 3


class QueueFull(RuntimeError):
    """The queue holds ``--queue-size`` jobs already."""


class UnknownJob(KeyError):
    """No job has this id."""


@dataclass
class Job:
    """One job as the server knows it now."""

    id: str
    sequence: int
    submitted: float
    settings: dict[str, Any]
    input: str
    status: str = "queued"
    end: dict[str, Any] = field(default_factory=dict)
    progress: dict[str, Any] = field(default_factory=dict)
    started: float | None = None
    worker: int | None = None
    crashes: int = 0
    cancelling: bool = False

    @classmethod
    def from_stored(cls, stored: StoredJob) -> Job:
        job = cls(stored.id, stored.sequence, stored.submitted, stored.settings, stored.input)
        if stored.status is not None:
            job.status, job.end = stored.status["status"], stored.status
        return job


@dataclass
class Slot:
    """One device and its worker process."""

    index: int
    device: str
    process: Any = None
    commands: Any = None
    pid: int | None = None
    ready: bool = False
    jobs: list[str] = field(default_factory=list)


class Scheduler:
    """Jobs in and out of the data folder, and the workers that run them."""

    def __init__(self, store: JobStore, *, devices: list[str], config: str, queue_size: int, group_size: int,
                 job_timeout: float | None, keep_seconds: float | None, threads: int | None):
        self.store, self.config, self.queue_size, self.group_size = store, config, queue_size, group_size
        self.job_timeout, self.keep_seconds, self.threads = job_timeout, keep_seconds, threads
        self.slots = [Slot(i, d) for i, d in enumerate(devices)]
        self.jobs: dict[str, Job] = {}
        self._changed = threading.Condition()
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self._sequence = 0
        self._creating = 0
        store.clean()
        for stored in store.load():
            self.jobs[stored.id] = Job.from_stored(stored)
            self._sequence = max(self._sequence, stored.sequence)

    # -- the API's side ----------------------------------------------------------------------
    def submit(self, image: bytes, suffix: str, settings: dict[str, Any]) -> Job:
        """Write the job to the data folder (durably), then queue it; ``QueueFull`` when the queue is full."""
        with self._changed:
            if self.queued() + self._creating >= self.queue_size:
                raise QueueFull(f"the queue is full ({self.queue_size} jobs wait, --queue-size); retry later")
            self._sequence += 1
            self._creating += 1  # a place held while its files are written outside the lock
            sequence = self._sequence
        try:
            job = Job.from_stored(self.store.create(new_id(), sequence, image, suffix, settings))
        finally:
            with self._changed:
                self._creating -= 1
        with self._changed:
            self.jobs[job.id] = job
            self._changed.notify_all()
        return job

    def job(self, job_id: str) -> Job:
        with self._changed:
            if job_id not in self.jobs:
                raise UnknownJob(job_id)
            return self.jobs[job_id]

    def view(self, job_id: str) -> dict[str, Any]:
        """What ``GET /jobs/{id}`` shows."""
        with self._changed:
            job = self.job(job_id)
            view: dict[str, Any] = {"id": job.id, "status": job.status, "submitted": job.submitted,
                                    "settings": job.settings}
            if job.status == "queued":
                view["position"] = 1 + sum(1 for other in self.jobs.values()
                                           if other.status == "queued" and other.sequence < job.sequence)
            elif job.status == "running":
                view |= {"started": job.started, "worker": job.worker, "device": self.slots[job.worker].device,
                         "cancelling": job.cancelling, **job.progress}
            else:
                view |= {k: v for k, v in job.end.items() if k != "format"}
            return view

    def cancel(self, job_id: str) -> str:
        """Cancel a queued job now, a running one at its next stage or sampler step; returns the status after."""
        with self._changed:
            job = self.job(job_id)
            if job.status == "queued":
                self._end(job, {"status": "cancelled", "error": "cancelled by DELETE /jobs/{id} before it started",
                                "finished": time.time()})
                self.store.end(job.id, job.end)
            elif job.status == "running" and not job.cancelling:
                job.cancelling = True
                slot = self.slots[job.worker]
                try:
                    slot.commands.send({"op": "cancel", "job": job.id})
                except OSError:  # the worker just died: its thread requeues the group; cancel it there
                    pass
            return job.status

    def queued(self) -> int:
        return sum(1 for job in self.jobs.values() if job.status == "queued")

    def health(self) -> dict[str, Any]:
        """What ``GET /health`` shows (besides the config)."""
        with self._changed:
            pids = [slot.pid for slot in self.slots if slot.pid is not None]
            rss = psutil.Process().memory_info().rss
            for pid in pids:
                try:
                    rss += psutil.Process(pid).memory_info().rss
                except psutil.Error:
                    pass
            return {"ready": all(slot.ready for slot in self.slots),
                    "devices": [slot.device for slot in self.slots],
                    "workers": [{"device": s.device, "pid": s.pid, "ready": s.ready, "jobs": list(s.jobs)}
                                for s in self.slots],
                    "queue": self.queued(), "running": sum(1 for j in self.jobs.values() if j.status == "running"),
                    "memory": {"process_bytes": rss, "available_bytes": psutil.virtual_memory().available}}

    # -- running -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start a thread (and its worker process) per device, and the retention sweep."""
        for slot in self.slots:
            thread = threading.Thread(target=self._serve, args=(slot,), name=f"pixal3d-serve-{slot.index}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)
        if self.keep_seconds is not None:
            threading.Thread(target=self._sweep_forever, name="pixal3d-serve-retention", daemon=True).start()

    def stop(self) -> None:
        """Stop every worker now (a running job resumes from its records at the next start)."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        for slot in self.slots:
            if slot.commands is not None:
                slot.commands.close()  # the worker exits when its command pipe closes
        for slot in self.slots:
            if slot.process is not None:
                slot.process.join(10)
                if slot.process.is_alive():
                    slot.process.kill()

    def _serve(self, slot: Slot) -> None:
        while not self._stopping:
            events = self._spawn(slot)
            try:
                self._feed(slot, events)
            except (EOFError, OSError):
                if self._stopping:
                    return
                self._crashed(slot)
                time.sleep(1.0)  # a worker that cannot start at all is not restarted in a tight loop
            finally:
                events.close()

    def _spawn(self, slot: Slot) -> Any:
        context = multiprocessing.get_context("spawn")
        command_out, command_in = context.Pipe(duplex=False)
        events_out, events_in = context.Pipe(duplex=False)
        process = context.Process(target=worker_main, name=f"pixal3d-serve-worker-{slot.index}", daemon=True,
                                  args=(command_out, events_in, slot.device, self.config, str(self.store.root),
                                        self.threads))
        process.start()
        command_out.close()
        events_in.close()
        slot.process, slot.commands, slot.pid, slot.ready = process, command_in, process.pid, False
        return events_out

    def _feed(self, slot: Slot, events: Any) -> None:
        """Hand the worker groups and relay its events until it dies or the server stops."""
        while True:
            message = events.recv()
            if message["event"] == "ready":
                with self._changed:
                    slot.ready = True
                break
        while True:
            group = self._take(slot)
            if group is None:
                return
            slot.commands.send({"op": "run", "timeout": self.job_timeout,
                                "jobs": [{"id": j.id, "input": j.input, "settings": j.settings} for j in group]})
            for job in group:
                if job.cancelling:
                    slot.commands.send({"op": "cancel", "job": job.id})
            while True:
                message = events.recv()
                if message["event"] == "idle":
                    break
                self._event(slot, message)
            with self._changed:
                slot.jobs = []

    def _take(self, slot: Slot) -> list[Job] | None:
        """The next group for ``slot`` (None when the server stops): the oldest queued job and more of its plan."""
        with self._changed:
            while not self._stopping:
                queued = sorted((j for j in self.jobs.values() if j.status == "queued"), key=lambda j: j.sequence)
                if queued:
                    key = plan_key(queued[0].settings)
                    group = [j for j in queued if plan_key(j.settings) == key][:self.group_size]
                    for job in group:
                        job.status, job.worker, job.started, job.progress = "running", slot.index, time.time(), {}
                    slot.jobs = [j.id for j in group]
                    return group
                self._changed.wait()
            return None

    def _event(self, slot: Slot, message: dict[str, Any]) -> None:
        with self._changed:
            kind = message["event"]
            if kind == "progress":
                job = self.jobs[message["job"]]
                if message["kind"] == "stage":
                    job.progress = {"stage": message["stage"], "stage_index": message["index"],
                                    "stages": message["stages"]}
                else:
                    job.progress |= {"step": message["step"], "steps": message["steps"]}
            elif kind == "ended":
                self._end(self.jobs[message["job"]], message["status"])
            elif kind == "released":
                for job_id in message["jobs"]:
                    self._requeue(self.jobs[job_id])
            self._changed.notify_all()

    def _crashed(self, slot: Slot) -> None:
        """The worker died: its unfinished jobs go back to the queue (or end, after ``MAX_CRASHES``)."""
        code = None
        if slot.process is not None:
            slot.process.join(10)  # reaps it (no zombie left) and reads its exit code
            code = slot.process.exitcode
        logger.warning("the worker on %s (pid %s) stopped (exit code %s); starting another", slot.device, slot.pid,
                       code)
        with self._changed:
            for job_id in slot.jobs:
                job = self.jobs[job_id]
                if job.status != "running":
                    continue
                job.crashes += 1
                if job.cancelling or job.crashes >= MAX_CRASHES:
                    why = ("cancelled by DELETE /jobs/{id}" if job.cancelling else
                           f"its worker process died {job.crashes} times while running it (exit code {code}); "
                           f"the server log says why")
                    self._end(job, {"status": "cancelled" if job.cancelling else "failed", "error": why,
                                    "finished": time.time()})
                    self.store.end(job.id, job.end)
                else:
                    self._requeue(job)
            slot.jobs, slot.ready, slot.pid = [], False, None
            self._changed.notify_all()

    def _requeue(self, job: Job) -> None:
        if job.status == "running":
            job.status, job.worker, job.progress, job.started = "queued", None, {}, None

    @staticmethod
    def _end(job: Job, status: dict[str, Any]) -> None:
        job.status, job.end, job.cancelling, job.progress = status["status"], status, False, {}

    # -- retention ---------------------------------------------------------------------------
    def sweep(self, now: float | None = None) -> list[str]:
        """Remove the jobs that ended more than ``keep_seconds`` ago (data folder and memory); returns their ids."""
        if self.keep_seconds is None:
            return []
        now = time.time() if now is None else now
        with self._changed:
            old = [j.id for j in self.jobs.values()
                   if j.status in ENDED and j.end.get("finished", j.submitted) < now - self.keep_seconds]
            for job_id in old:
                del self.jobs[job_id]
        for job_id in old:
            self.store.remove(job_id)
        return old

    def _sweep_forever(self) -> None:
        while not self._stopping:
            self.sweep()
            time.sleep(min(60.0, max(1.0, self.keep_seconds / 10)))
