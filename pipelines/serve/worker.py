"""One worker process per device: it keeps a pipeline between jobs (a ``pipelines.session.Session``: rebuilt only
when the plan changes) and runs the groups of jobs the scheduler hands it through ``Pixal3D.run_batch`` over the data
folder's work directory, so every stage of every job is recorded as it finishes and a job started again resumes at
its first unrecorded stage.

It talks to the server over two pipes: commands in (``run`` a group, ``cancel`` a job), events out (``ready``,
``progress``, ``ended``, ``released``, ``idle``). When the command pipe closes (the server stopped, or was killed)
the worker exits at once: whatever it was doing is in the records, and the next server resumes it.

A group is several queued jobs with one plan (every setting but the seed), run stage by stage under ``staged`` and
``offload`` so each model is loaded once for the group. A cancelled job, or one past its time, stops the group at
the next stage or sampler step: that job ends (cancelled, or failed with the timeout), the others are released
back to the queue and resume from their records.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from multiprocessing.connection import Connection
from typing import Any

from pixal3d.config import CascadeConfig, load_config
from pixal3d.files import atomic_path
from pixal3d.locks import exclusive_lock

from ..errors import error_line
from ..job import Job
from ..plan import RunPlan
from ..session import Session
from .store import JobStore

logger = logging.getLogger(__name__)


class JobStopped(Exception):
    """A job of the running group was cancelled or ran past its time: the group stops at this stage or step."""

    def __init__(self, job: str, status: str, message: str):
        super().__init__(message)
        self.job, self.status = job, status


def worker_main(commands: Connection, events: Connection, device: str, config: str, data: str,
                threads: int | None) -> None:
    """The worker process's body (``multiprocessing`` spawn target)."""
    logging.basicConfig(level=logging.WARNING, format=f"pixal3d-serve[{device} {os.getpid()}]: %(levelname)s: "
                                                      f"%(message)s")
    import torch
    import transformers

    transformers.logging.disable_progress_bar()  # its "Loading weights" bar on every load, in the server's log
    if threads is not None:
        torch.set_num_threads(threads)
    store = JobStore(data)
    session, config = Session("serve", device=device), load_config(config)
    runs: queue.Queue[dict[str, Any]] = queue.Queue()
    cancelled: set[str] = set()

    def listen() -> None:
        """Commands from the server; the pipe closing means the server is gone: exit now (the records keep all)."""
        while True:
            try:
                message = commands.recv()
            except (EOFError, OSError):
                os._exit(0)
            if message["op"] == "cancel":
                cancelled.add(message["job"])
            else:
                runs.put(message)

    threading.Thread(target=listen, name="pixal3d-serve-commands", daemon=True).start()
    events.send({"event": "ready", "pid": os.getpid(), "device": device, "threads": torch.get_num_threads()})
    while True:
        message = runs.get()
        if message["op"] == "stop":
            session.close()
            return
        run_group(session, config, store, message["jobs"], timeout=message.get("timeout"), cancelled=cancelled,
                  send=events.send)
        events.send({"event": "idle"})


def run_group(session: Session, config: CascadeConfig, store: JobStore, jobs: list[dict[str, Any]], *,
              timeout: float | None, cancelled: set[str], send: Callable[[dict[str, Any]], None]) -> None:
    """Run ``jobs`` (one plan; their settings against ``config``) as one batch, a job of several images in
    ``session``; every job ends (status.json written) or is released."""
    ids = [job["id"] for job in jobs]
    try:
        asked = [Job.from_request(job["settings"], config) for job in jobs]
        group = dataclasses.replace(asked[0], work_dir=store.work.root, command=("pixal3d-serve",), images=tuple(
            one.image(str(store.folder(job["id"]) / job["input"]), job["id"]) for one, job in zip(asked, jobs)))
        plan = session.plan(group)
        session.prepare(group, plan)
    except Exception as err:  # noqa: BLE001 - the plan or the weights fail every job of this plan alike
        for job_id in ids:
            _end(store, job_id, {"status": "failed", "error": error_line(err)}, send)
        return
    with ExitStack() as held:  # never two runs of one job (a worker of a killed server may still be exiting)
        for job_id in ids:
            held.enter_context(exclusive_lock(store.folder(job_id) / ".run.lock", wait=True))
        _run(session, group, plan, store, timeout=timeout, cancelled=cancelled, send=send)


def _run(session: Session, group: Job, plan: RunPlan, store: JobStore, *, timeout: float | None,
         cancelled: set[str], send: Callable[[dict[str, Any]], None]) -> None:
    ids = [image.name for image in group.images]
    deadline = None if timeout is None else time.monotonic() + timeout * len(ids)
    current = {"job": ids[0]}
    ended: list[str] = []
    for job_id in ids:
        store.attempt(job_id, {"event": "started", "pid": os.getpid(), "group": len(ids)})

    def callback(report: dict[str, Any]) -> None:
        job = current["job"] = report["image"]
        stopped = next((i for i in ids if i in cancelled and i not in ended), None)
        if stopped is not None:
            raise JobStopped(stopped, "cancelled", "cancelled by DELETE /jobs/{id}")
        if deadline is not None and time.monotonic() > deadline:
            raise JobStopped(job, "failed", f"the job ran past its {timeout:g} s (--job-timeout) and was stopped")
        send({"event": "progress", "job": job, **{k: report.get(k) for k in ("kind", "stage", "index", "stages",
                                                                            "step", "steps")}})

    traces = store.root / "traces"
    traces.mkdir(exist_ok=True)
    trace = traces / f"{ids[0]}.jsonl"
    done: list[str] = []
    loads: dict[str, int] = {}  # model -> loads during this group's run (a group under staged: 1 each)

    def count(event: Any) -> None:
        if event.kind in ("load", "reload"):
            loads[event.model] = loads.get(event.model, 0) + 1

    try:
        for item in session.run(group, plan=plan, callback=callback, trace=trace, events=count):
            if item.ok:
                _save(session, group, store, item)
                done.append(item.name)
                _end(store, item.name, {**_done_status(item, len(ids)), "group_loads": dict(loads)}, send)
            else:
                _end(store, item.name, {"status": "failed", "error": item.message, "stage": item.stage}, send)
            ended.append(item.name)
    except JobStopped as stop:
        _end(store, stop.job, {"status": stop.status, "error": str(stop)}, send)
        ended.append(stop.job)
    except Exception as err:  # noqa: BLE001 - the job in progress fails with the line; the others go back
        _end(store, current["job"], {"status": "failed", "error": error_line(err)}, send)
        ended.append(current["job"])
    finally:
        for job_id in done:  # the group's memory trace (stage order: one for all; image order: one each)
            own = trace.with_name(f"{trace.stem}.{job_id}{trace.suffix}")
            source = own if own.exists() else trace
            if source.exists():
                with atomic_path(store.folder(job_id) / "trace.jsonl") as tmp:
                    shutil.copyfile(source, tmp)
        for leftover in traces.glob(f"{ids[0]}*.jsonl"):
            leftover.unlink(missing_ok=True)
    released = [i for i in ids if i not in ended]
    if released:
        send({"event": "released", "jobs": released})
    for job_id in ended:
        cancelled.discard(job_id)


def _save(session: Session, group: Job, store: JobStore, item: Any) -> None:
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


def _end(store: JobStore, job_id: str, status: dict[str, Any], send: Callable[[dict[str, Any]], None]) -> None:
    status = {**status, "finished": time.time()}
    store.end(job_id, status)
    shutil.rmtree(store.work_folder(job_id), ignore_errors=True)  # an ended job is never resumed
    store.attempt(job_id, {"event": "ended", "status": status["status"], "pid": os.getpid()})
    send({"event": "ended", "job": job_id, "status": status})


