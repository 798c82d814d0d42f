"""One job as a stream of updates: waiting for the models, the plan, each stage and sampler step with the
memory trace so far, then the GLB, run.json and the per-stage table (or the error, on one line).

The cascade runs in a thread of its own; the generator polls it (``poll`` seconds) and reads the new lines
of the JSONL memory trace that ``Pixal3D.run(trace=...)`` flushes as it goes, so a page can redraw the
memory plot while the run happens. Nothing here imports Gradio.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pixal3d.models.preprocess import ImageError

from ..errors import error_line
from ..job import Job
from ..plan import RunPlan
from ..result import Result, run_json_path
from ..session import Session

REFUSAL = "cannot run on this machine: "

_job_numbers = itertools.count(1)


@dataclass
class JobOutputs:
    """What a finished job left: the files (in the job's folder) and the per-stage table."""

    glb: Path
    record: Path
    trace: Path
    table: list[list[str]]
    seconds: float
    policy: str


@dataclass
class JobUpdate:
    """The job's state at one moment. ``records``: the memory trace so far (every record, not only new ones)."""

    status: str
    fraction: float = 0.0
    records: list[dict[str, Any]] = field(default_factory=list)
    plan: str | None = None
    outputs: JobOutputs | None = None
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.outputs is not None or self.error is not None


class TraceTail:
    """The records of a JSONL trace that is still being written: each ``read`` adds the complete new lines."""

    def __init__(self, path: Path):
        self.path = path
        self.records: list[dict[str, Any]] = []
        self._offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        """All records so far (a half-written last line waits for the next read)."""
        if not self.path.exists():
            return self.records
        with open(self.path, "rb") as handle:
            handle.seek(self._offset)
            chunk = handle.read()
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        self.records.extend(json.loads(line) for line in lines if line.strip())
        return self.records


class JobCancelled(Exception):
    """The job's page went away (its generator was closed): the run stops at its next stage or sampler step."""


class _Progress:
    """What the run's callback last reported, read by the polling generator; raises ``JobCancelled`` into the
    run once the job is cancelled."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.stage = ""
        self.index = 0
        self.stages = 1
        self.step = 0
        self.steps = 0
        self.plan: RunPlan | None = None
        self.waiting = False

    def __call__(self, report: dict[str, Any]) -> None:
        if self.cancelled.is_set():
            raise JobCancelled("the page that asked for this job was closed")
        if report["kind"] == "stage":
            self.stage, self.index, self.stages = report["stage"], report["index"], report["stages"]
            self.step = self.steps = 0
        elif report["kind"] == "step":
            self.step, self.steps = report["step"], report["steps"]

    def waits(self) -> None:
        self.waiting = True

    def started(self, plan: RunPlan) -> None:
        self.plan, self.waiting = plan, False

    def status(self) -> str:
        if self.waiting:
            return "waiting: another job is using the models; yours starts when it ends"
        if self.plan is None:
            return "planning"
        if not self.stage:
            return f"starting (policy {self.plan.policy.value})"
        text = f"stage {self.index + 1}/{self.stages} · {self.stage}"
        return text + (f" · sampler step {self.step}/{self.steps}" if self.steps else "")

    def fraction(self) -> float:
        within = self.step / self.steps if self.steps else 0.0
        return min(1.0, (self.index + within) / max(self.stages, 1)) if self.stage else 0.0


def plan_or_refusal(session: Session, job: Job) -> str:
    """The memory plan and the chosen policy with its reasons (``RunPlan.table()``, the text ``--plan`` prints), or
    ``REFUSAL`` and the one-line reason when the plan cannot be made or the machine cannot run it."""
    try:
        return session.plan(job).table()
    except Exception as err:  # noqa: BLE001 - every failure to plan is shown, as a refusal with its reason
        return REFUSAL + error_line(err)


@dataclass(frozen=True)
class Upload:
    """What the page's form carries for the config's kind of input: field name (``InputKind.upload``) → its files
    (``Uploaded``: where Gradio keeps them) or its text or number."""

    parts: dict[str, Any]


def run_job(session: Session, source: Any, job: Job, *, outputs: Path, name: str | None = None,
            poll: float = 0.5) -> Iterator[JobUpdate]:
    """Run ``job`` on ``source`` in ``session``, yielding an update every ``poll`` seconds and a last one with the
    outputs (written under ``outputs`` by ``Session.write``) or the error. ``source``: an input of the job's kind
    as the library takes it (an image: a path, a PIL image or an array; None: the kind's "nothing uploaded"), or the
    page's ``Upload``, which the kind turns into one in the job's folder (``InputKind.receive``: its ``ImageError``
    is the error update, on one line; the fields it writes besides the input, such as a mesh to texture, become the
    job's: ``InputKind.received``)."""
    kind = job.kind
    parts = source.parts if isinstance(source, Upload) else {kind.upload[0].name: source}
    missing = next((f.missing for f in kind.upload if f.required and _absent(parts.get(f.name))), None)
    if missing is not None:
        yield JobUpdate(status=f"error: {missing}", error=error_line(ImageError(missing)))
        return
    if isinstance(source, Upload):
        stem = kind.upload_stem(parts)
    else:
        stem = Path(name or (str(source) if isinstance(source, (str, Path)) else kind.name)).stem or kind.name
    folder = outputs / f"{next(_job_numbers):04d}-{stem}"
    if isinstance(source, Upload):
        try:
            source = kind.receive(parts, folder, {option: getattr(job, option) for option in kind.options})
            job = dataclasses.replace(job, **kind.received(folder))
        except (ImageError, OSError) as err:
            message = error_line(err)
            yield JobUpdate(status=f"error: {message}", error=message)
            return
    folder.mkdir(parents=True, exist_ok=True)
    yield from _run_in(session, source, stem, folder, job, poll)


def _absent(value: Any) -> bool:
    """Nothing given: None, or no files."""
    return value is None or (isinstance(value, tuple) and not value)


def _run_in(session: Session, image: Any, stem: str, folder: Path, job: Job, poll: float) -> Iterator[JobUpdate]:
    trace = folder / f"{stem}.trace.jsonl"
    tail, progress, finished = TraceTail(trace), _Progress(), {}
    job = dataclasses.replace(job, images=(job.image(image, stem),),
                              command=job.command or ("pixal3d-app", "--config", job.config.source))

    def work() -> None:
        try:
            for item in session.run(job, callback=progress, trace=trace, on_wait=progress.waits,
                                    on_start=progress.started):
                if not item.ok:
                    raise item.error
                finished["result"] = item.result
        except BaseException as err:  # noqa: BLE001 - handed to the generator, which reports it
            finished["error"] = err

    thread = threading.Thread(target=work, name=f"pixal3d-job-{stem}", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            yield _update(progress, tail)
            thread.join(poll)
    except GeneratorExit:  # nobody reads on (the visitor closed the page): free the models for the next job
        progress.cancelled.set()
        raise
    if "error" in finished:
        message = error_line(finished["error"])
        yield JobUpdate(status=f"error: {message}", fraction=progress.fraction(), records=tail.read(),
                        plan=_plan_text(progress), error=message)
        return
    result: Result = finished["result"]
    done = _save(session, result, job, folder / f"{stem}.glb", trace)
    yield JobUpdate(status=f"done in {done.seconds:.1f} s (policy {done.policy}): {done.glb.name}", fraction=1.0,
                    records=tail.read(), plan=_plan_text(progress), outputs=done)


def _update(progress: _Progress, tail: TraceTail) -> JobUpdate:
    return JobUpdate(status=progress.status(), fraction=progress.fraction(), records=list(tail.read()),
                     plan=_plan_text(progress))


def _plan_text(progress: _Progress) -> str | None:
    return progress.plan.table() if progress.plan is not None else None


def _save(session: Session, result: Result, job: Job, glb: Path, trace: Path) -> JobOutputs:
    """The GLB and run.json (with the visitor's settings beside the config) next to the trace: the session's one
    writer, the GLB renamed last."""
    session.write(result, job, glb)
    return JobOutputs(glb=glb, record=run_json_path(glb), trace=trace, table=result.stage_rows(),
                      seconds=result.seconds, policy=result.policy.value)
