"""A worker on the queue (``pixal3d-serve`` and ``pixal3d-serve --role worker``): one worker process per device, fed
from the queue's database, under a name (``--name``, default the host's) that owns its leases.

Each device has a thread that starts its worker process (``worker.py``), claims the next group from the queue (the
oldest queued job and up to ``group_size - 1`` more of its plan), hands it over, relays the process's progress into
the job's row, and starts a new process if one dies (its jobs go back to the queue, each counted as a lost lease). A
heartbeat thread renews the leases of the jobs running here every ``lease / 3`` seconds, reads their cancel flags
and tells the worker process at once (the job stops at its next stage or step), tells it to drop a job whose lease
was lost (another worker has it now), says in the workers table that this worker is alive, and gives back every
lease on the queue that expired (a dead worker's jobs, for whichever worker claims next).

Only one process runs under a name at a time (the lock ``DATA/workers/<name>.lock``, held by ``main``); so a worker
started again under its name takes its old jobs back at once (they count as lost), instead of waiting for their
leases to expire. A stopped worker (Ctrl-C, SIGTERM) gives its jobs back to the queue, not counted.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .db import Claim, Queue, QueueError
from .service import MAX_LOST
from .store import DataFolder
from .worker import worker_main

logger = logging.getLogger(__name__)

POLL = 0.25
"""Seconds between claims while the queue is empty (a submission in this process wakes the worker at once)."""
STEP_PERIOD = 0.5
"""A running job's sampler step is written to its row at most this often (each stage change at once)."""
PATIENCE_PAUSE = 10.0
"""The longest wait between two tries of a queue operation that failed (the waits double from 1 s)."""
T = TypeVar("T")


@dataclass
class Slot:
    """One device and its worker process."""

    index: int
    device: str
    process: Any = None
    commands: Any = None
    pid: int | None = None
    ready: bool = False
    held: dict[str, int] = field(default_factory=dict)
    """The jobs it runs now and the attempt of each (their leases are this worker's)."""
    told: set[str] = field(default_factory=set)
    """Jobs the process was told to stop (cancelled, or lost)."""
    send_lock: threading.Lock = field(default_factory=threading.Lock)


class Node:
    """The workers of one process on the queue."""

    def __init__(self, queue: Queue, queue_url: str, data: DataFolder, *, name: str, role: str, devices: list[str],
                 config: str, group_size: int, job_timeout: float | None, threads: int | None, lease: float,
                 max_lost: int = MAX_LOST):
        self.queue, self.queue_url, self.data, self.name, self.role = queue, queue_url, data, name, role
        self.config, self.group_size, self.job_timeout, self.threads = config, group_size, job_timeout, threads
        self.lease, self.max_lost = lease, max_lost
        self.host = socket.gethostname()
        self.slots = [Slot(i, d) for i, d in enumerate(devices)]
        self._changed = threading.Condition()
        self._beat_now = threading.Event()
        self._stopping = False
        self._progress: dict[str, dict[str, Any]] = {}  # job -> its stage, and when its step was last written

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Take back this name's jobs from a previous process, say that this worker is alive, start the devices."""
        taken = self.queue.reclaim(self.name, f"worker {self.name} was started again", max_lost=self.max_lost)
        if taken:
            logger.warning("worker %s: %d job(s) of its previous process back in the queue", self.name, len(taken))
        self._beat()
        threading.Thread(target=self._heartbeats, name="pixal3d-serve-heartbeat", daemon=True).start()
        for slot in self.slots:
            threading.Thread(target=self._serve, args=(slot,), name=f"pixal3d-serve-{slot.index}", daemon=True).start()

    def wake(self) -> None:
        """A job was queued by this process: claim now rather than at the next poll."""
        with self._changed:
            self._changed.notify_all()

    def stop(self) -> None:
        """Stop every worker process now and give their jobs back to the queue (they resume from their records)."""
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
                    slot.process.join(10)
        self.queue.patience = 5.0  # a database that is away now does not hold the stop up for long
        try:
            for slot in self.slots:
                self.queue.release(list(slot.held), self.name, dict(slot.held))
            self.queue.leave(self.name)
        except QueueError as err:
            logger.warning("worker %s stopped without giving its jobs back (%s); their leases expire instead",
                           self.name, err)

    def health(self) -> dict[str, Any]:
        """This process's workers as ``GET /health`` lists them."""
        with self._changed:
            return {"name": self.name, "slots": [
                {"name": self.name, "host": self.host, "role": self.role, "slot": s.index, "device": s.device,
                 "pid": s.pid, "ready": s.ready, "jobs": list(s.held)} for s in self.slots]}

    # -- heartbeats --------------------------------------------------------------------------
    def _beat(self) -> None:
        self.queue.beat(self.name, host=self.host, pid=os.getpid(), role=self.role, lease=self.lease,
                        slots=self.health()["slots"])

    def _heartbeats(self) -> None:
        while not self._stopping:
            self._beat_now.wait(self.lease / 3)
            self._beat_now.clear()
            if self._stopping:
                return
            try:
                for slot in self.slots:
                    self._renew(slot)
                self._beat()
                self.queue.reap(max_lost=self.max_lost)
            except Exception as err:  # noqa: BLE001 - a heartbeat that failed is tried again at the next turn
                logger.warning("worker %s: heartbeat: %s", self.name, " ".join(str(err).split()))

    def _renew(self, slot: Slot) -> None:
        with self._changed:
            held = dict(slot.held)
        if not held:
            return
        kept = self.queue.renew(self.name, held, self.lease)
        for job_id, attempt in held.items():
            if job_id in slot.told:
                continue
            if job_id not in kept:
                with self._changed:
                    if slot.held.get(job_id) != attempt:
                        continue  # it ended meanwhile (its row no longer running), not lost
                logger.warning("worker %s: the lease of job %s was lost; another worker runs it now", self.name,
                               job_id)
                self._tell(slot, {"op": "lost", "job": job_id})
            elif kept[job_id]:
                self._tell(slot, {"op": "cancel", "job": job_id})

    def _tell(self, slot: Slot, message: dict[str, Any]) -> None:
        slot.told.add(message["job"])
        try:
            with slot.send_lock:
                slot.commands.send(message)
        except (OSError, AttributeError):  # the worker just died: its thread gives the jobs back
            pass

    # -- the queue, patiently ----------------------------------------------------------------
    def _patiently(self, what: str, operation: Callable[[], T]) -> T | None:
        """``operation()`` until it works: a queue error (the database away longer than an operation's patience, its
        disk full) costs a wait and a retry here, never the device thread (which would leave its jobs running and
        the queued ones waiting while ``/health`` says ready). None when this worker stops meanwhile."""
        pause, failing = 1.0, False
        while not self._stopping:
            try:
                result = operation()
            except QueueError as err:
                if not failing:
                    logger.warning("worker %s: %s: %s; retrying", self.name, what, " ".join(str(err).split()))
                    failing = True
                with self._changed:
                    self._changed.wait(pause)
                pause = min(PATIENCE_PAUSE, pause * 2)
                continue
            if failing:
                logger.warning("worker %s: %s works again", self.name, what)
            return result
        return None

    # -- the devices -------------------------------------------------------------------------
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
                                  args=(command_out, events_in, slot.device, self.config, str(self.data.root),
                                        self.threads, self.queue_url, self.name))
        process.start()
        command_out.close()
        events_in.close()
        with self._changed:
            slot.process, slot.commands, slot.pid, slot.ready = process, command_in, process.pid, False
        return events_out

    def _feed(self, slot: Slot, events: Any) -> None:
        """Claim groups for the worker process and relay its events until it dies or this worker stops."""
        while events.recv()["event"] != "ready":
            pass
        with self._changed:
            slot.ready = True
        self._beat_now.set()
        while True:
            group = self._take(slot)
            if group is None:
                return
            with slot.send_lock:
                slot.commands.send({"op": "run", "timeout": self.job_timeout,
                                    "jobs": [{"id": c.id, "input": c.input, "settings": c.settings,
                                              "attempt": c.attempt} for c in group]})
            while True:
                message = events.recv()
                if message["event"] == "idle":
                    break
                self._event(slot, message)
            with self._changed:
                slot.held, slot.told = {}, set()
            self._beat_now.set()

    def _take(self, slot: Slot) -> list[Claim] | None:
        """The next group for ``slot`` (None when this worker stops)."""
        while not self._stopping:
            group = self._patiently("claiming jobs", lambda: self.queue.claim(
                self.name, slot.index, slot.device, group_size=self.group_size, lease=self.lease))
            if group:
                with self._changed:
                    slot.held, slot.told = {c.id: c.attempt for c in group}, set()
                self._beat_now.set()
                return group
            with self._changed:
                if not self._stopping:
                    self._changed.wait(POLL)
        return None

    def _event(self, slot: Slot, message: dict[str, Any]) -> None:
        kind = message["event"]
        if kind == "progress":
            job_id = message["job"]
            attempt = slot.held.get(job_id)
            if attempt is None:
                return
            if message["kind"] == "stage":
                progress = {"stage": message["stage"], "stage_index": message["index"], "stages": message["stages"]}
                self._progress[job_id] = {"row": progress, "written": time.monotonic()}
            else:
                known = self._progress.setdefault(job_id, {"row": {}, "written": 0.0})
                if time.monotonic() - known["written"] < STEP_PERIOD:
                    return
                progress = {**known["row"], "step": message["step"], "steps": message["steps"]}
                known["written"] = time.monotonic()
            try:
                self.queue.progress(job_id, self.name, attempt, progress)
            except QueueError as err:  # the next report writes the row again; the run goes on meanwhile
                logger.debug("job %s: progress not written: %s", job_id, err)
        elif kind == "ended":
            with self._changed:
                slot.held.pop(message["job"], None)
            self._progress.pop(message["job"], None)
        elif kind == "released":
            with self._changed:
                released = {j: slot.held.pop(j) for j in message["jobs"] if j in slot.held}
            self._patiently("giving jobs back", lambda: self.queue.release(list(released), self.name, released))

    def _crashed(self, slot: Slot) -> None:
        """The worker process died: its jobs go back to the queue, each counted as a lost lease."""
        code = None
        if slot.process is not None:
            slot.process.join(10)  # reaps it (no zombie left) and reads its exit code
            code = slot.process.exitcode
        logger.warning("the worker on %s (pid %s) stopped (exit code %s); starting another", slot.device, slot.pid,
                       code)
        with self._changed:
            held, slot.held, slot.told, slot.ready, slot.pid = dict(slot.held), {}, set(), False, None
        why = f"its worker process on {slot.device} of {self.name} died (exit code {code})"
        self._patiently("giving a dead worker process's jobs back",
                        lambda: self.queue.lose(list(held), self.name, held, why, max_lost=self.max_lost))
        self._beat_now.set()
