"""One worker process per device: it keeps a pipeline between jobs (a ``pipelines.session.Session``: rebuilt only
when the plan changes) and runs the groups of jobs its worker (``node.py``) claimed for it through
``Pixal3D.run_batch`` over the data folder's work directory, so every stage of every job is recorded as it finishes
and a job started again, here or on another machine, resumes at its first unrecorded stage.

It talks to its worker over two pipes: commands in (``run`` a group, ``cancel`` a job, a job's lease was ``lost``),
events out (``ready``, ``progress``, ``ended``, ``released``, ``idle``). When the command pipe closes (the worker
stopped, or was killed) it exits at once: whatever it was doing is in the records, and the next claimer resumes it.
It ends a job itself, in the queue's database, only while its worker still holds the job's lease: the results are
written after a check that it does, and the end is committed only if it still does (``Queue.finish``), so a job ends
once even when a worker that lost its lease comes back; the stage records it would write once the job's new owner
has opened them are refused (``work_dir.RecordsTakenOver``).

A group is several queued jobs with one plan (every setting but the seed), run stage by stage under ``staged`` and
``offload`` so each model is loaded once for the group. A cancelled job, or one past its time, stops the group at
the next stage or sampler step: that job ends (cancelled, or failed with the timeout), the others are released
back to the queue and resume from their records. A job whose lease was lost stops the group the same way without
ending: the worker that holds it now ends it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from pixal3d.config import CascadeConfig, load_config
from pixal3d.files import atomic_path

from ..errors import error_line
from ..inputs import kind_named
from ..job import Job
from ..plan import RunPlan
from ..session import Session
from .db import Queue, QueueError, open_queue
from .store import DataFolder

logger = logging.getLogger(__name__)


class JobStopped(Exception):
    """A job of the running group was cancelled or ran past its time: the group stops at this stage or step."""

    def __init__(self, job: str, status: str, message: str):
        super().__init__(message)
        self.job, self.status = job, status


def worker_main(commands: Connection, events: Connection, device: str, config: str, data: str,
                threads: int | None, queue_url: str, owner: str) -> None:
    """The worker process's body (``multiprocessing`` spawn target)."""
    logging.basicConfig(level=logging.WARNING, format=f"pixal3d-serve[{device} {os.getpid()}]: %(levelname)s: "
                                                      f"%(message)s")
    import torch
    import transformers
    from tqdm import tqdm

    transformers.logging.disable_progress_bar()  # its "Loading weights" bar on every load, in the server's log
    # The batch's progress bar (disabled) takes tqdm's lock, by default a multiprocessing lock: a named semaphore
    # that a worker killed with its server (SIGKILL, SIGTERM) never unlinks, so Python's resource tracker warned of
    # a "leaked semaphore" at every stop. A thread lock does the same job inside this one process.
    tqdm.set_lock(threading.RLock())
    if threads is not None:
        torch.set_num_threads(threads)
    store = DataFolder(data)
    where = Where(store, open_queue(queue_url, store.root, patience=None), owner)
    session, config = Session("serve", device=device), load_config(config)
    runs: queue.Queue[dict[str, Any]] = queue.Queue()
    cancelled: dict[str, str] = {}  # job -> "cancel" or "lost"

    def listen() -> None:
        """Commands from the server; the pipe closing means the server is gone: exit now (the records keep all)."""
        while True:
            try:
                message = commands.recv()
            except (EOFError, OSError):
                os._exit(0)
            if message["op"] in ("cancel", "lost"):
                cancelled[message["job"]] = message["op"]
            else:
                runs.put(message)

    threading.Thread(target=listen, name="pixal3d-serve-commands", daemon=True).start()
    events.send({"event": "ready", "pid": os.getpid(), "device": device, "threads": torch.get_num_threads()})
    while True:
        message = runs.get()
        if message["op"] == "stop":
            session.close()
            return
        try:
            run_group(session, config, where, message["jobs"], timeout=message.get("timeout"),
                      cancelled=cancelled, send=events.send)
        except QueueError as err:  # the queue cannot record an end (its disk is full): the jobs go back instead
            logger.warning("the queue could not record how this group's jobs ended (%s); they go back to the "
                           "queue and resume from their records", " ".join(str(err).split()))
            events.send({"event": "released", "jobs": [job["id"] for job in message["jobs"]]})
        events.send({"event": "idle"})


@dataclass(frozen=True)
class Where:
    """Where a worker process's jobs live: the data folder, the queue, and the name whose leases they run under."""

    data: DataFolder
    queue: Queue
    owner: str


def run_group(session: Session, config: CascadeConfig, where: Where, jobs: list[dict[str, Any]], *,
              timeout: float | None, cancelled: dict[str, str], send: Callable[[dict[str, Any]], None]) -> None:
    """Run ``jobs`` (one plan; their settings against ``config``; each with the ``attempt`` its worker claimed) as
    one batch, a job of several images in ``session``; every job ends (in the queue), is released, or is left to
    the worker that took its lost lease."""
    store = where.data
    try:
        asked = [_asked(store, config, job) for job in jobs]
        group = dataclasses.replace(asked[0], work_dir=store.work.root, command=("pixal3d-serve",), images=tuple(
            one.image(str(store.folder(job["id"]) / job["input"]), job["id"]) for one, job in zip(asked, jobs)))
        plan = session.plan(group)
        session.prepare(group, plan)
    except Exception as err:  # noqa: BLE001 - the plan or the weights fail every job of this plan alike
        for job in jobs:
            _end(where, job, {"status": "failed", "error": error_line(err)}, send)
        return
    # No file lock between two runs of one job: the queue's lease decides who runs it. A run that lost its lease
    # while it could not notice (paused by SIGSTOP, a frozen container, a worker of a killed server still exiting)
    # writes no stage record once the new owner has opened the job's records (``work_dir.RecordsTakenOver``), no
    # result (``Queue.holds`` before ``_save``) and no end (``Queue.finish`` is fenced by the claim's attempt).
    _run(session, group, plan, where, jobs, timeout=timeout, cancelled=cancelled, send=send)


def _run(session: Session, group: Job, plan: RunPlan, where: Where, jobs: list[dict[str, Any]], *,
         timeout: float | None, cancelled: dict[str, str], send: Callable[[dict[str, Any]], None]) -> None:
    store = where.data
    ids = [image.name for image in group.images]
    by_id = {job["id"]: job for job in jobs}
    deadline = None if timeout is None else time.monotonic() + timeout * len(ids)
    current = {"job": ids[0]}
    ended: list[str] = []

    def callback(report: dict[str, Any]) -> None:
        job = current["job"] = report["image"]
        if report.get("kind") == "stage" and job not in cancelled:  # the flag at once, not at the next heartbeat
            reason = where.queue.stop_reason(job, where.owner, by_id[job]["attempt"])
            if reason is not None:
                cancelled[job] = reason
        stopped = next((i for i in ids if i in cancelled and i not in ended), None)
        if stopped is not None and cancelled[stopped] == "lost":
            raise JobStopped(stopped, "lost", "its lease was lost: another worker runs it now")
        if stopped is not None:
            raise JobStopped(stopped, "cancelled", "cancelled by DELETE /jobs/{id}")
        if deadline is not None and time.monotonic() > deadline:
            raise JobStopped(job, "failed", f"the job ran past its {timeout:g} s (--job-timeout) and was stopped")
        send({"event": "progress", "job": job, **{k: report.get(k) for k in ("kind", "stage", "index", "stages",
                                                                            "step", "steps")}})

    trace = _trace_file(store, ids[0])
    done: list[str] = []
    loads: Counter[str] = Counter()  # model -> loads during this group's run (a group under staged: 1 each)

    def count(event: Any) -> None:
        if event.kind in ("load", "reload"):
            loads[event.model] += 1

    try:
        for item in session.run(group, plan=plan, callback=callback, trace=trace, events=count):
            job = by_id[item.name]
            if item.ok:
                if where.queue.holds(item.name, where.owner, job["attempt"]):
                    _save(session, group, store, item)
                    done.append(item.name)
                _end(where, job, {**_done_status(item, len(ids)), "group_loads": dict(loads)}, send)
            else:
                _end(where, job, {"status": "failed", "error": item.message, "stage": item.stage}, send)
            ended.append(item.name)
    except JobStopped as stop:
        if stop.status == "lost":
            send({"event": "ended", "job": stop.job, "status": None})
        else:
            _end(where, by_id[stop.job], {"status": stop.status, "error": str(stop)}, send)
        ended.append(stop.job)
    except Exception as err:  # noqa: BLE001 - the job in progress fails with the line; the others go back
        _end(where, by_id[current["job"]], {"status": "failed", "error": error_line(err)}, send)
        ended.append(current["job"])
    finally:
        _keep_traces(store, trace, done)
    released = [i for i in ids if i not in ended]
    if released:
        send({"event": "released", "jobs": released})
    for job_id in ids:
        cancelled.pop(job_id, None)


def _asked(store: DataFolder, config: CascadeConfig, job: dict[str, Any]) -> Job:
    """A claimed job as it was asked for: its settings, as the kind of input its submission recorded (None: the
    config's own), with the fields that kind's ``receive`` wrote beside its input (a mesh to texture: ``Job.mesh``;
    a group's jobs share them, their plan says: ``plan_key``)."""
    name = store.input_kind(job["id"])
    kind = kind_named(config, name)
    return Job.from_request(job["settings"], config, input_kind=name, **kind.received(store.folder(job["id"])))


def _trace_file(store: DataFolder, first: str) -> Path:
    """Where a group's run writes its memory trace: ``DATA/traces/<its first job's id>.jsonl``."""
    traces = store.root / "traces"
    traces.mkdir(exist_ok=True)
    return traces / f"{first}.jsonl"


def _keep_traces(store: DataFolder, trace: Path, done: list[str]) -> None:
    """The group's memory trace (stage order: one for all; image order: one per image, ``<stem>.<id>.jsonl``)
    copied into each done job's folder; the group's trace files removed."""
    for job_id in done:
        own = trace.with_name(f"{trace.stem}.{job_id}{trace.suffix}")
        source = own if own.exists() else trace
        if source.exists():
            with atomic_path(store.folder(job_id) / "trace.jsonl") as tmp:
                shutil.copyfile(source, tmp)
    for leftover in trace.parent.glob(f"{trace.stem}*.jsonl"):
        leftover.unlink(missing_ok=True)


def _save(session: Session, group: Job, store: DataFolder, item: Any) -> None:
    """The GLB and run.json of a finished job (its settings, what was resumed and its group in run.json's
    ``serve``), by the session's one writer: the GLB renamed last."""
    folder = store.folder(item.name)
    session.write(item.result, group, folder / "result.glb", record=folder / "run.json", output="result.glb",
                  extra={"job": item.name, "resumed": list(item.resumed), "group": len(group.images),
                         "notes": list(item.notes)})


def _done_status(item: Any, group: int) -> dict[str, Any]:
    result = item.result
    resumed = set(item.resumed)
    return {"status": "done", "seconds": round(result.seconds, 4), "policy": result.policy.value,
            "resumed": list(item.resumed), "group": group, "notes": list(item.notes),
            "stages": [{"stage": r.stage, "seconds": round(r.seconds, 4), "peak_process_bytes": r.peak_process_bytes,
                        "peak_device_bytes": r.peak_device_bytes, "models": list(r.used),
                        "resumed": r.stage in resumed} for r in result.stages]}


def _end(where: Where, job: dict[str, Any], status: dict[str, Any], send: Callable[[dict[str, Any]], None]) -> None:
    """End the job in the queue if this worker still holds its lease; then its stage records go (an ended job is
    never resumed). A worker that lost the lease leaves both to the one that holds it."""
    if where.queue.finish(job["id"], where.owner, job["attempt"], status):
        shutil.rmtree(where.data.work_folder(job["id"]), ignore_errors=True)
    else:
        logger.warning("job %s: its lease was lost before it ended (%s); the worker that holds it ends it", job["id"],
                       status["status"])
    send({"event": "ended", "job": job["id"], "status": status})
