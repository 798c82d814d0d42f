"""The session: a pipeline kept for its plan, and the one writer of a job's results, for any front end.

    with Session("serve", device="cpu") as session:
        for item in session.run(job):                       # Pixal3D.run_batch over the job's images
            if item.ok:
                session.write(item.result, job, folder / "result.glb", record=folder / "run.json")

Kept: the pipeline built for one job serves the next while the plan is the same (config, resolved policy,
device, the stages fitted alike under the same memory budget), so the policy decides what stays loaded between
jobs (``resident`` keeps its models, ``staged`` holds none); another plan closes it and builds a new one. One
job runs at a time (a lock: two cascades at once would need twice the memory the plan promised); ``run`` says
when it waits.

One writer: ``write`` puts a result's GLB, its run.json and (when asked) its latents down as one group, the GLB
renamed last (``Result.save_outputs``: a kill between the renames never leaves a GLB without its record), and
run.json gains one entry named after the front end (``"cli"``, ``"app"``, ``"serve"``) with the job's settings
and what that front end adds. ``check_outputs`` proves before the run that every output can be written, and
``write_summary`` ends a batch with one line and ``batch.json``.
"""
from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any, Self

import torch

from pixal3d.files import folds_case, write_json_atomic

from .batch import BatchItem, trace_path
from .build import SHAPE_ONLY
from .camera import CameraStage
from .errors import one_line
from .job import Job, UsageError
from .pipeline import Pixal3D
from .plan import RunPlan, default_device
from .ranks import Rank
from .result import Result, run_json_path

logger = logging.getLogger(__name__)


class Session:
    """Jobs of one front end (``front_end``: what run.json's entry is called) on ``device`` (default: CUDA, else
    MPS, else CPU). ``rank``: this process's part in a job under torchrun (the command's roles: ``pipelines.launch``;
    default one process). ``lean``: plan only
    what each job needs (with a field of view given, no camera model), for a process that runs one job; a
    session that keeps its pipeline plans the whole cascade, so that a job with a field of view reuses it."""

    def __init__(self, front_end: str, *, device: str | torch.device | None = None,
                 rank: Rank | None = None, lean: bool = False):
        self.front_end = front_end
        self.device = torch.device(device) if device is not None else default_device()
        self.rank = rank
        self.lean = lean
        self._lock = threading.Lock()
        self._pipe: Pixal3D | None = None
        self._budget: str | None = None  # the memory budget asked for when the kept pipeline was built

    @property
    def pipeline(self) -> Pixal3D | None:
        """The pipeline kept from the last job (None before the first and after ``close``)."""
        return self._pipe

    @property
    def busy(self) -> bool:
        """True while a job holds the models."""
        return self._lock.locked()

    # -- planning ------------------------------------------------------------------------------
    def plan(self, job: Job) -> RunPlan:
        """The memory plan and the policy for ``job`` (headers only; raises ``NotEnoughMemoryError``,
        ``PolicyError``, ``WeightsError``, ``ConfigError`` as ``Pixal3D.plan`` does)."""
        fixed = self.lean and job.fov is not None and all(image.fov is not None for image in job.images)
        # no camera model to fetch; the camera stage as the job's kind reads it
        replace = {"camera": job.kind.adapt(CameraStage(None, use_moge=False), job.config)} if fixed else None
        return Pixal3D.plan(job.config, policy=job.memory_policy, device=self.device, parallel=self.rank,
                            memory_budget=job.budget, replace=replace, input_kind=job.kind.name,
                            until=SHAPE_ONLY if job.shape_only else None)

    def prepare(self, job: Job, plan: RunPlan | None = None) -> Pixal3D:
        """The pipeline ``job`` runs on (``plan``: its plan, when made already): the kept one if the plan is the
        same, else a new one (the old one closed first). Fetches and verifies weights; loads no model."""
        with self._lock:
            return self._pipeline_for(plan or self.plan(job), job)

    def _pipeline_for(self, plan: RunPlan, job: Job) -> Pixal3D:
        current, budget = self._pipe, job.settings()["memory_budget"]
        if current is not None and self._budget == budget and same_plan(current.run_plan, plan):
            return current
        if current is not None:
            logger.info("plan changed (policy %s → %s); releasing the previous pipeline's models",
                        current.policy.value, plan.policy.value)
            self._pipe = None
            current.close()
        self._pipe, self._budget = Pixal3D.from_plan(plan), budget
        return self._pipe

    # -- running -------------------------------------------------------------------------------
    def run(self, job: Job, *, plan: RunPlan | None = None, order: str | None = None,
            on_wait: Callable[[], None] | None = None, on_start: Callable[[RunPlan], None] | None = None,
            **options: Any) -> Iterator[BatchItem]:
        """``job``'s images through the kept pipeline (``Pixal3D.run_batch``: each image's name, seed and field of
        view; the job's work directory), yielding each as it finishes or fails. Waits for a job that holds the
        models (``on_wait()`` first); ``on_start(plan)`` once this one holds them. ``order``: default the job's,
        else the policy's; ``options``: ``run_batch``'s (``callback``, ``trace``, ``events``, ``progress``,
        ...). The models are held until the iterator ends or is closed."""
        if not self._lock.acquire(blocking=False):
            if on_wait is not None:
                on_wait()
            self._lock.acquire()
        try:
            plan = plan or self.plan(job)
            if on_start is not None:
                on_start(plan)
            pipe = self._pipeline_for(plan, job)
            images = job.images
            sources = [i.source for i in images]
            inputs = {job.kind.batch_argument: sources, "num_views": job.num_views, "fov": [i.fov for i in images]}
            if "mesh" in job.kind.arguments:  # one mesh, textured from each image
                inputs |= {"mesh": job.mesh, "mesh_pose": job.mesh_pose}
            with closing(pipe.run_batch(**inputs, names=[i.name for i in images], seed=[i.seed for i in images],
                                        order=order or job.order, work_dir=job.work_dir,
                                        trace_meta={self.front_end: {"settings": job.settings()}}, **options)) as batch:
                yield from batch
        finally:
            self._lock.release()

    # -- writing -------------------------------------------------------------------------------
    def write(self, result: Result, job: Job, glb: Path, *, record: Path | None = None, latents: Path | None = None,
              output: str | Path | None = None, extra: Mapping[str, Any] | None = None) -> list[Path]:
        """The GLB, its run.json (default ``<glb stem>.run.json``) and, when given, its latents, as one group whose
        commit point is the GLB (renamed last). run.json names the command as the job gives it, ``output`` (what it
        calls the GLB; default its path), and gains the entry ``<front end>``: the job's settings (this image's
        seed) and ``extra``."""
        entry = {"settings": {**job.settings(), "seed": result.seed}, **(extra or {})}
        return result.save_outputs(glb, record=run_json_path(glb) if record is None else record, latents=latents,
                                   command=job.command, output=output, extension={self.front_end: entry})

    # -- the end -------------------------------------------------------------------------------
    def close(self) -> None:
        """Release every model (waits for a running job)."""
        with self._lock:
            if self._pipe is not None:
                self._pipe.close()
                self._pipe = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        """Closed; an error is passed on to the pipeline (under torchrun the other ranks stop too)."""
        pipe, self._pipe = self._pipe, None
        if pipe is not None:
            pipe.__exit__(exc_type, exc, tb)


def same_plan(a: RunPlan, b: RunPlan) -> bool:
    """Same config, resolved policy and device, the same stages fitted alike (with the same memory budget asked for,
    ``auto`` following the memory available when planned): the pipeline built for ``a`` serves ``b``."""
    return (a.config == b.config and a.policy == b.policy and a.device == b.device and a.choices() == b.choices()
            and [s.name for s in a.stages] == [s.name for s in b.stages])  # a shape-only plan is not the full one


# -- what the command will write, checked before the run -------------------------------------------
def plan_outputs(inputs: Sequence[Path], output: Path | None) -> list[Path]:
    """One ``.glb`` per input: ``-o file.glb`` for one input, ``-o folder`` (or ``outputs/``) for any."""
    if output is not None and output.suffix.lower() == ".glb":
        if len(inputs) > 1:
            raise UsageError(f"-o {output} names one file but there are {len(inputs)} inputs; pass a folder")
        return [output]
    folder = output if output is not None else Path("outputs")
    return [folder / f"{p.stem}.glb" for p in inputs]


def check_outputs(pairs: Sequence[tuple[Path, Path]], job: Job) -> None:
    """Everything ``job`` will write for ``pairs`` (input, GLB) can be written: no output is a folder, every folder
    is writable, and no two outputs are one file on a case-insensitive file system (``Cup.glb`` and ``cup.glb``
    on macOS)."""
    for input_path, output in pairs:
        check_file_path(output, "-o")
        check_file_path(run_json_path(output), "-o")
        check_writable(output.parent, "-o")
        if job.keep_latents is not None:
            check_writable(job.keep_latents, "--keep-latents")
            check_file_path(job.keep_latents / f"{input_path.stem}.latents.pt", "--keep-latents")
        for trace in {job.trace, trace_path(job.trace, input_path.stem, several=job.several)} - {None}:
            check_file_path(trace, "--trace")  # one trace for a stage-ordered batch, one per image otherwise
            check_writable(trace.parent, "--trace")
    outputs = [output for _, output in pairs]
    if len(outputs) > 1 and any(folds_case(folder) for folder in {o.parent for o in outputs}):
        folded: dict[tuple[Path, str], Path] = {}
        for output in outputs:
            other = folded.setdefault((output.parent, output.name.casefold()), output)
            if other != output:
                raise UsageError(f"outputs {other.name} and {output.name} differ only in case, and {output.parent} is "
                                 f"on a case-insensitive file system where they are one file; rename an input")


def check_file_path(path: Path, option: str) -> None:
    """``path`` is not an existing folder (found now, not after the whole run)."""
    if path.is_dir():
        raise UsageError(f"{option}: {path} is a folder, so no file can be written there; name a file or "
                         f"remove the folder")


def check_writable(folder: Path, option: str = "-o") -> None:
    """Create ``folder`` if needed and prove a file can be written there (then remove it)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".pixal3d-write-test-"):
            pass
    except OSError as err:
        raise UsageError(f"{option}: folder {folder} is not writable ({err.strerror or err}); "
                         f"choose another {option}") from None


# -- a batch's summary ------------------------------------------------------------------------------
def batch_rows(items: Sequence[BatchItem], outputs: Mapping[Path, Path],
               words: Callable[[str], str] = str) -> list[dict[str, Any]]:
    """``batch.json``'s row of each image of ``items`` (``outputs``: input → GLB; ``words``: the front end's words
    for the library's, in the error lines)."""
    rows = []
    for item in items:
        output = outputs[Path(item.input)]
        row = {"input": item.input, "name": item.name, "status": "written" if item.ok else "failed",
               "kind": item.failure.kind if item.failure else None, "stage": item.stage,
               "error": words(item.message) or None, "resumed": list(item.resumed), "notes": list(item.notes)}
        if item.ok:
            row |= {"output": str(output), "run_record": str(run_json_path(output)),
                    "seconds": round(item.result.seconds, 4)}
        rows.append(row)
    return rows


def write_summary(job: Job, rows: list[dict[str, Any]], *, order: str, inputs: Sequence[Path],
                  outputs: Mapping[Path, Path], refused: Sequence[tuple[Path, BaseException]] = (),
                  lead: bool = False) -> tuple[str, bool]:
    """The batch's summary line and ``batch.json`` beside the outputs (written atomically); returns the line and
    whether any image failed. ``rows``: every image's (``batch_rows``; a data job's from every rank), in any order;
    ``refused``: inputs refused from their headers before the run; ``lead``: rank 0 of a data job, where an image
    without a row (its rank stopped) is ``unknown``."""
    rows = [{"input": str(path), "name": path.stem, "status": "failed", "kind": "input", "stage": None,
             "error": one_line(err)} for path, err in refused] + list(rows)
    if lead:
        known = {row["input"] for row in rows}
        rows += [{"input": str(path), "name": path.stem, "status": "unknown", "kind": None, "stage": None,
                  "error": "its rank sent no report"} for path in outputs if str(path) not in known]
    position = {str(path): i for i, path in enumerate(inputs)}
    rows.sort(key=lambda row: position[row["input"]])
    written = sum(row["status"] == "written" for row in rows)
    failures = [f"{Path(row['input']).name}: {_reason(row)}" for row in rows if row["status"] != "written"]
    line = f"{written} written, {len(failures)} failed" + (": " + "; ".join(failures) if failures else "")
    folder = next(iter(outputs.values())).parent
    write_json_atomic(folder / "batch.json", {
        "command": list(job.command), "order": order, "work_dir": None if job.work_dir is None else str(job.work_dir),
        "written": written, "failed": len(failures), "summary": line, "images": rows})
    return line, bool(failures)


def _reason(row: dict) -> str:
    """A failure's first clause without its path (``not an image Pillow can read``)."""
    text = row["error"].split(";")[0]
    for spelling in (row["input"], Path(row["input"]).name):
        text = text.replace(spelling, "")
    return " ".join(text.split()).removeprefix("is ")
