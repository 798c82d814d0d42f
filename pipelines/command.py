"""The body of ``pixal3d-image-to-mesh`` (``pipelines.cli`` parses the arguments first, importing no torch, and
imports this module only to run them): checks, the plan, the batch, the parallel paths, the error lines."""
from __future__ import annotations

import argparse
import gc
import logging
import os
import re
import sys
from collections.abc import Sequence
from contextlib import ExitStack, closing
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from pixal3d.config import CascadeConfig
from pixal3d.files import write_json_atomic
from pixal3d.interrupts import terminate_as_exception
from pixal3d.locks import exclusive_lock
from pixal3d.models.preprocess import ImageError, probe_image
from pixal3d.parallel import (
    ParallelConfigError,
    ParallelRuntime,
    ParallelSettings,
    PeerFailedError,
    init_parallel,
)
from pixal3d.parallel.topology import Topology
from pixal3d.staging.policy import gib

from .batch import BatchItem, default_order
from .cli_args import DEFAULT_CONFIG, parse_args  # noqa: F401 -- DEFAULT_CONFIG re-exported
from .data_parallel import DataJob, GroupStoppedError
from .errors import Failure, UsageError, classify, one_line
from .job import Job, expand_inputs
from .leftovers import clean_leftovers, cleaned_line
from .parallel import rank_device
from .pipeline import Pixal3D
from .session import Session, check_outputs, plan_outputs
from .plan import RunPlan, check_inputs, default_device, parse_device
from .result import run_json_path
from .work_dir import LOCK as WORK_DIR_LOCK
from .work_dir import WorkDir

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
OUR_LOGGERS = ("pixal3d", "pipelines", "pixal3d-image-to-mesh")
FLAGS = {"memory_budget": "--memory-budget", "policy": "--memory-policy", "seed": "--seed", "fov": "--fov",
         "work_dir": "--work-dir", "mode": "--parallel", "pp": "--pp", "patches": "--patches", "warmup": "--warmup",
         "pp_split": "--pp-split", "data_groups": "--data-groups"}
"""The command's flag for each library setting: library messages name a setting ``name=value`` (or, for one with
an underscore, by its name), an error about one setting carries it (``SettingError.setting``)."""
_VALUED = re.compile(r"\b(%s)=([^\s,;:)]*)" % "|".join(FLAGS))
_NAMED = re.compile(r"\b(%s)\b(?!=)" % "|".join(name for name in FLAGS if "_" in name))


def in_flags(text: str) -> str:
    """Library words in the command's: ``warmup=2`` becomes ``--warmup 2``, ``memory_budget`` ``--memory-budget``."""
    text = _VALUED.sub(lambda m: f"{FLAGS[m[1]]} {m[2]}".rstrip(), text)
    return _NAMED.sub(lambda m: FLAGS[m[1]], text)

logger = logging.getLogger("pixal3d-image-to-mesh")
_log_handler: logging.Handler | None = None

__all__ = ["UsageError", "main"]  # UsageError lives in pipelines.errors; re-exported for existing imports


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the command; returns the exit code."""
    return run(parse_args(argv), argv)


def run(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """Run the command for parsed ``args`` (``argv``: as given, ``None`` for ``sys.argv``); returns the exit code."""
    # Freeze what the imports created (torch, transformers: millions of objects) so the gc.collect
    # that every model release runs scans only the run's own objects (0.5 s → ~0.01 s per release).
    gc.freeze()
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.command = command_as_typed(argv)
    _configure_logging(quiet=args.quiet)
    if args.quiet:
        _quiet_transformers()
    try:
        settings = parallel_settings(args)
        if settings is None:
            return _command(args)
        if settings.mode == "data":
            return _data_command(args, settings)
        topology = Topology.from_env(settings)
        if args.plan and settings.pp_split != "auto":  # each rank can plan; rank 0 prints its plan, nobody joins
            return _command(args, settings) if topology.global_rank == 0 else 0
        runtime = init_parallel(settings, device=rank_device(parse_device(args.device) if args.device else
                                                             default_device(), topology))
    except (UsageError, ParallelConfigError) as err:  # the same on every rank: said once
        return _fail(_classify(err, started=False)) if launch_rank() == 0 else 2
    # With --data-groups each group's rank 0 leads its group and takes part in the data job (it claims images);
    # the group's other ranks follow it alone.
    job = None
    try:
        if topology.data_groups > 1 and topology.rank == 0 and not args.plan:
            job = DataJob.join(settings)
        return _command(args, runtime, runtime=runtime, job=job) if topology.rank == 0 else _follow(args, runtime)
    except BaseException as err:  # an unforeseen error: the other ranks stop too, then the traceback
        runtime.fail(err)
        raise
    finally:
        if job is not None:
            job.close()
        runtime.close()


def _data_command(args: argparse.Namespace, settings: ParallelSettings) -> int:
    """A rank of a ``--parallel data`` job: the whole command on its share of the images (``data_parallel``)."""
    if args.plan:  # each rank can plan alone; rank 0 prints its plan
        return _command(args, settings) if launch_rank() == 0 else 0
    job = DataJob.join(settings)
    try:
        return _command(args, settings, job=job)
    finally:
        job.close()


def command_as_typed(argv: Sequence[str] | None = None) -> list[str]:
    """run.json's and batch.json's ``command``: the program as the user started it (``python
    scripts/image_to_mesh.py``, ``pixal3d-image-to-mesh``, ``python -m pipelines.cli``) and its arguments, so
    pasting it runs the same thing; ``main(argv)`` called from Python is recorded under the command's name."""
    if argv is not None:
        return ["pixal3d-image-to-mesh", *argv]
    program = sys.argv[0]
    if program and Path(program).resolve() == Path(__file__).with_name("cli.py").resolve():
        head = ["python", "-m", "pipelines.cli"]
    elif program.endswith(".py"):
        head = ["python", program]
    else:
        head = [Path(program).name or "pixal3d-image-to-mesh"]
    return [*head, *sys.argv[1:]]


def _quiet_transformers() -> None:
    """Silence transformers' "Loading weights" bar (it ignores our --quiet) without importing transformers, whose
    modeling code costs seconds that ``--plan`` never needs: it reads huggingface_hub's switch when imported."""
    if "transformers" in sys.modules:
        sys.modules["transformers"].logging.disable_progress_bar()
    else:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def _command(args: argparse.Namespace, parallel: ParallelSettings | ParallelRuntime | None = None, *,
             runtime: ParallelRuntime | None = None, job: DataJob | None = None) -> int:
    """Everything one process does (rank 0's part of a parallel job, or a data group, included): check, plan,
    run, write."""
    started = False
    lead = _leads(runtime, job)  # says what every rank would say alike
    try:
        with terminate_as_exception(), ExitStack() as held:
            prepared = _prepare(args, held, parallel, job=job)
            for path, err in prepared.rejected if lead else ():
                _skip_line(path.name, one_line(err))
            if lead and (args.plan or not args.quiet):
                print(in_flags(prepared.plan.table()), flush=True)
                if _several(args):
                    print(_batch_line(prepared, args), flush=True)
            if args.plan:
                return 0
            session = held.enter_context(Session("cli", device=prepared.plan.device, parallel=parallel, lean=True))
            session.prepare(prepared.asked, prepared.plan)  # fetches and verifies the weights
            started = True
            return _run(session, prepared, args, job)
    except BaseException as err:  # classify() decides; anything it does not know is re-raised
        failure = _classify(err, started=started)
        if failure is None:
            raise
        if runtime is not None:
            runtime.fail(err)  # the other ranks stop too (nothing happens if they already know)
            if failure.kind == "interrupted":  # torchrun's agent stops every rank when one dies: say which
                failure = replace(failure, message=f"{failure.message}; {ended_ranks_line(runtime)}")
        if job is not None and job.rank == 0 and not isinstance(err, PeerFailedError):
            job.post_exit(failure.exit_code, readers=0)  # the other groups stop before their next image
        if failure.kind == "interrupted" and args.work_dir is not None:
            failure = replace(failure, message=f"{failure.message}; run the same command again to resume from "
                                               f"{args.work_dir}")
        return _fail(failure)


def _leads(runtime: ParallelRuntime | None, job: DataJob | None) -> bool:
    """Whether this process says what every group's leader would say alike (the plan, skipped inputs) and holds
    the locks against other runs: rank 0 of the job."""
    return (job is None or job.rank == 0) and (runtime is None or runtime.topology.global_rank == 0)


def _follow(args: argparse.Namespace, runtime: ParallelRuntime) -> int:
    """A rank ≠ 0: plan, fetch and check only the flow models' weights, then follow rank 0 (``--plan``: plan
    only, taking part in gathering the ranks' memory for ``--pp-split auto``)."""
    try:
        asked = Job.from_args(args)
        plan = Pixal3D.plan(asked.config, policy=asked.memory_policy, device=runtime.device,
                            memory_budget=asked.budget, parallel=runtime)
        if args.plan:
            return 0
        with Pixal3D.from_plan(plan) as pipe:
            pipe.follow()
    except ParallelConfigError as err:  # rank 0 says it, or names this rank when only this one has it
        started = runtime.requests > 0  # rank 0 has announced an image
        runtime.fail(err)
        return 1 if started else 2
    except BaseException as err:  # classify() decides; anything it does not know goes to main
        failure = _classify(err, started=runtime.requests > 0)
        if failure is None:
            raise
        runtime.fail(err)
        message = failure.message if failure.message.startswith("rank ") else \
            f"rank {runtime.topology.rank}: {failure.message}"
        print(f"pixal3d-image-to-mesh: error: {message}", file=sys.stderr)
        return failure.exit_code
    return 0


def ended_ranks_line(runtime: ParallelRuntime) -> str:
    """Why a parallel job's rank 0 was stopped, as far as it can tell: the ranks on this machine that had ended."""
    ended = runtime.ended_ranks()
    if not ended:
        return ("if torchrun sent it, another rank of the job ended (torchrun stops every rank when one does): "
                "its own output, or the system log for the OOM killer, says why")
    names = ", ".join(f"rank {rank} (pid {pid})" for rank, pid in ended)
    return (f"{names} of the parallel job had ended without a word (killed: SIGKILL or the OOM killer?), and "
            f"torchrun stops every rank when one ends")


def _fail(failure: Failure) -> int:
    print(f"pixal3d-image-to-mesh: error: {failure.message}", file=sys.stderr)
    return failure.exit_code


def _classify(err: BaseException, *, started: bool) -> Failure | None:
    """``classify`` in the command's words (``in_flags``), an error about one setting prefixed by its flag."""
    failure = classify(err, started=started)
    if failure is None:
        return None
    setting = getattr(err, "setting", None)
    prefix = f"{FLAGS[setting]}: " if setting in FLAGS else ""
    return replace(failure, message=prefix + in_flags(failure.message))


def _skip_line(name: str, message: str) -> None:
    print(f"pixal3d-image-to-mesh: skipped {name}: {in_flags(message)}", file=sys.stderr, flush=True)


def _several(args: argparse.Namespace) -> bool:
    return len(args.inputs) > 1 or any(p.is_dir() for p in args.inputs)


def _configure_logging(*, quiet: bool) -> None:
    """One stderr handler on our own loggers (warnings; errors only with --quiet). Library loggers
    (huggingface_hub, transformers, ...) keep their own configuration: the root logger is left alone."""
    global _log_handler
    if _log_handler is None:
        _log_handler = _StderrHandler()
        _log_handler.setFormatter(_InFlags("pixal3d: %(levelname)s: %(message)s"))
        for name in OUR_LOGGERS:
            logging.getLogger(name).addHandler(_log_handler)
    _log_handler.setLevel(logging.ERROR if quiet else logging.WARNING)


class _InFlags(logging.Formatter):
    """Log lines in the command's words (``in_flags``)."""

    def format(self, record: logging.LogRecord) -> str:
        return in_flags(super().format(record))


class _StderrHandler(logging.StreamHandler):
    """A stream handler writing to whatever ``sys.stderr`` is when a record comes (tests and embedding
    programs replace it between calls)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


# -- 1. everything that can be checked before a weight is read -------------------------------------
class Prepared(NamedTuple):
    """What the command found before reading a weight: the plan, (input, output) per usable input, the inputs
    refused from their headers (a batch goes on without them) and every input in order."""

    plan: RunPlan
    jobs: list[tuple[Path, Path]]
    rejected: list[tuple[Path, ImageError]]
    inputs: list[Path]
    asked: Job


def _prepare(args: argparse.Namespace, held: ExitStack, parallel: ParallelSettings | ParallelRuntime | None = None,
             *, job: DataJob | None = None) -> Prepared:
    """``job``: a data job's ranks != 0 leave the locks against other runs to rank 0, and open the work directory
    after it."""
    lead = _leads(parallel if isinstance(parallel, ParallelRuntime) else None, job)
    # 1. config and the run's settings: ranges are the config's own (pixal3d.config) and the run's (state.py)
    asked = Job.from_args(args, command=args.command)
    config = asked.config
    # 2. inputs: images Pillow can open, usable by this config's stages (e.g. alpha without a remover); in a
    #    batch a bad one costs only itself: reported, skipped, counted in the summary
    inputs = everything = expand_inputs(args.inputs)
    rejected: list[tuple[Path, ImageError]] = []
    if _several(args):
        rejected = [(path, err) for path in inputs if (err := _unusable(config, path)) is not None]
        if len(rejected) == len(inputs):
            raise UsageError(f"none of the {len(inputs)} inputs is a usable image; the first: "
                             f"{one_line(rejected[0][1])}")
        inputs = [path for path in inputs if path not in dict(rejected)]
    else:
        for path in inputs:
            probe_image(path)  # not an image, or too small: from the header, before any weight is read
        check_inputs(config, inputs)
    # 3. outputs: not folders, writable, not colliding, not being written by another run; the work directory
    jobs = list(zip(inputs, plan_outputs(inputs, args.output)))
    check_outputs(jobs, asked)
    if args.work_dir is not None:  # a folder that is not a work directory is refused before any weight is read
        if job is not None:
            job.in_turn(lambda: WorkDir(args.work_dir))  # rank 0 makes it, then the others find it made
        else:
            WorkDir(args.work_dir)
    if not args.plan and lead:
        for _, output in jobs:
            held.enter_context(exclusive_lock(output.with_name(f".{output.name}.lock"), wait=False,
                                              what=str(output), owner="another run"))
        if args.work_dir is not None:
            held.enter_context(exclusive_lock(args.work_dir / WORK_DIR_LOCK, wait=False,
                                              what=str(args.work_dir), owner="another run"))
        latents = [args.keep_latents / f"{i.stem}.latents.pt" for i, _ in jobs] if args.keep_latents else []
        # Under --parallel data the other groups write these outputs and records meanwhile, without these locks: a
        # temporary file or a lone run.json may be theirs, so only lock files nobody holds are cleared there.
        removed = clean_leftovers([o for _, o in jobs], latents=latents, work_dir=args.work_dir,
                                  temporaries=job is None)
        if removed:
            print(f"pixal3d-image-to-mesh: {cleaned_line(removed)}", file=sys.stderr, flush=True)
    device = parse_device(args.device) if args.device else default_device()
    # 4. the plan, from safetensors headers only (nothing but pipeline.json is downloaded for it); with --fov
    #    every image has its field of view, so no camera model is planned or fetched
    plan = Session("cli", device=device, parallel=parallel, lean=True).plan(asked)
    return Prepared(plan, jobs, rejected, everything, asked)


def _unusable(config: CascadeConfig, path: Path) -> ImageError | None:
    try:
        probe_image(path)
        check_inputs(config, [path])
    except ImageError as err:
        return err
    return None


def launch_rank(env: dict[str, str] | None = None) -> int:
    """This process's rank as torchrun set it (0 without torchrun)."""
    return int((os.environ if env is None else env).get("RANK", "0"))


def parallel_settings(args: argparse.Namespace, env: dict[str, str] | None = None) -> ParallelSettings | None:
    """``--parallel`` and its knobs as ``ParallelSettings`` checked against torchrun's environment (the same
    on every rank, before any rendezvous); None for ``--parallel none``, today's single process."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    knobs = [f"--{k.replace('_', '-')}" for k in ("pp", "pp_split", "patches", "warmup")
             if getattr(args, k) is not None]
    if args.parallel == "none":
        if args.data_groups is not None:
            raise UsageError("--data-groups needs --parallel cfg, pipefusion or both (--parallel is none)")
        if knobs:
            raise UsageError(f"{' '.join(knobs)} needs --parallel pipefusion or both (--parallel is none)")
        if world > 1:
            raise UsageError(f"torchrun started {world} processes but --parallel is none, so each would run the whole "
                             f"cascade and write the same files; pass --parallel cfg, pipefusion or both, or run "
                             f"without torchrun")
        return None
    # Every rank sees this alike, before any rendezvous: rank 0 says it once, every rank exits 2.
    groups = 1 if args.data_groups is None else args.data_groups
    if args.data_groups is not None and (args.parallel == "data" or args.data_groups < 1):
        raise UsageError(f"--data-groups {args.data_groups}: " + (
            "--parallel data makes every process a data group of its own; drop --data-groups"
            if args.parallel == "data" else "give 1 or more groups"))
    if args.parallel != "data" and args.batch_order == "stage":
        raise UsageError(f"--batch-order stage needs one process per image; under --parallel {args.parallel} the "
                         f"other ranks follow rank 0 image by image: drop it, use --parallel data (each process "
                         f"runs whole images), or run without --parallel")
    if args.parallel != "data" and groups == 1 and args.work_dir is not None:
        raise UsageError(f"--work-dir needs data groups under --parallel {args.parallel} (the other ranks follow "
                         f"rank 0 image by image): add --data-groups K, use --parallel data (each process runs "
                         f"whole images), or run without --parallel")
    cfg = 2 if args.parallel in ("cfg", "both") else 1
    piped = args.parallel in ("pipefusion", "both")
    if "RANK" not in env or "WORLD_SIZE" not in env:
        ranks = 2 if args.parallel == "data" else groups * (2 * cfg if piped else cfg)
        raise ParallelConfigError(f"--parallel {args.parallel} runs under torchrun, which starts the processes: "
                                  f"torchrun --nproc-per-node {ranks} scripts/image_to_mesh.py ... "
                                  f"(README: Several GPUs or machines)")
    if args.parallel == "data":
        if knobs:
            raise UsageError(f"{' '.join(knobs)} needs --parallel pipefusion or both (--parallel data runs every "
                             f"image whole on one process)")
        return ParallelSettings(mode="data", data_groups=world, timeout_s=args.parallel_timeout)
    pp = args.pp if args.pp is not None else (max(1, world // (cfg * groups)) if piped else 1)
    settings = ParallelSettings(mode=args.parallel, pp=pp, patches=args.patches if args.patches is not None else
                                (pp if piped else 1), warmup=1 if args.warmup is None else args.warmup,
                                timeout_s=args.parallel_timeout, pp_split=parse_pp_split(args.pp_split),
                                data_groups=groups)
    settings.check_world_size(world)
    return settings


def parse_pp_split(text: str | None) -> str | tuple[int, ...] | None:
    """``--pp-split``: ``auto`` or comma-separated block counts (``1,3``)."""
    if text is None or text == "auto":
        return text
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"--pp-split {text!r} is neither auto nor block counts such as 1,3") from None


# -- 2. the run ----------------------------------------------------------------------------------
def _run(session: Session, prepared: Prepared, args: argparse.Namespace, job: DataJob | None = None) -> int:
    """Every usable input through ``Pixal3D.run_batch``; each result written as it comes. One input: its error
    is the command's. Several: a failed image is one line and the others go on; the summary ends it. In a data
    job this rank runs its share, and rank 0 writes the summary of every rank's images."""
    several = _several(args)
    order = _order(prepared.plan, args)
    outputs = dict(prepared.jobs)
    items: list[BatchItem] = []
    asked = prepared.asked.with_images([prepared.asked.image(path, path.stem) for path in outputs])
    with closing(session.run(asked, plan=prepared.plan, order=order, progress=not args.quiet, trace=args.trace,
                             share=job)) as batch:
        for item in batch:
            items.append(item)
            if item.ok:
                _write(session, item, outputs[Path(item.input)], prepared.asked, args)
            elif not several:
                raise item.error
            else:
                _skip_line(Path(item.input).name, item.message)
    if job is not None:
        session.close()  # its models go, and a group's followers are told the end now, not after the slowest group
        return _job_summary(job, args, items, prepared, order)
    return _summary(args, items, prepared, order) if several else 0


def _job_summary(job: DataJob, args: argparse.Namespace, items: Sequence[BatchItem], prepared: Prepared,
                 order: str) -> int:
    """A data job's end: every rank's rows to rank 0, which writes ``batch.json`` and the summary line (and names a
    rank that sent nothing); every rank returns rank 0's exit code."""
    rows = [{**row, "rank": job.rank} for row in _rows(items, prepared)]
    try:
        gathered = job.gather(rows)
    except GroupStoppedError as err:
        _summary(args, [], prepared, order, rows=[row for part in err.rows for row in part], lead=True)
        job.post_exit(1, readers=len(err.rows) - 1)
        raise
    if gathered is None:
        return job.wait_exit()
    code = _summary(args, [], prepared, order, rows=[row for part in gathered for row in part], lead=True)
    job.post_exit(code, readers=job.groups - 1)
    return code


def _order(plan: RunPlan, args: argparse.Namespace) -> str:
    """``--batch-order``, else the policy's default; image by image under ``--parallel`` (the other ranks follow;
    a data group runs its images as one process would)."""
    if plan.parallel is not None and not plan.parallel.independent:
        return "image"
    return args.batch_order or default_order(plan.policy)


def _write(session: Session, item: BatchItem, output_path: Path, asked: Job, args: argparse.Namespace) -> None:
    result = item.result
    latents = args.keep_latents / f"{item.name}.latents.pt" if args.keep_latents is not None else None
    session.write(result, asked, output_path, latents=latents)
    if not args.quiet:
        print(result.table())
        if (camera := result.camera_line()) is not None:
            print(camera)
        resumed = f", {len(item.resumed)} stages from {args.work_dir}" if item.resumed else ""
        print(f"{output_path} ({result.seconds:.1f} s, policy {result.policy.value}{resumed}); "
              f"run record {run_json_path(output_path)}", flush=True)


def _batch_line(prepared: Prepared, args: argparse.Namespace) -> str:
    """How a batch will go: its order, and under stage order how much of the image
    states waits in memory between stages (the rest on disk)."""
    order = _order(prepared.plan, args)
    room = prepared.plan.state_budget()
    how = ("image by image" if order != "stage" else
           f"stage by stage, image states kept in memory up to {gib(room)} between stages (more wait on disk)"
           if room > 0 else "stage by stage, image states waiting on disk between stages (the largest stage "
           "leaves no memory for them)")
    images = len(prepared.jobs)
    return (f"batch: {images} image{'s' if images != 1 else ''}, {how}"
            + (f"; records in {args.work_dir}" if args.work_dir else ""))


def _rows(items: Sequence[BatchItem], prepared: Prepared) -> list[dict[str, Any]]:
    """``batch.json``'s row of each image run here."""
    outputs, rows = dict(prepared.jobs), []
    for item in items:
        output = outputs[Path(item.input)]
        row = {"input": item.input, "name": item.name, "status": "written" if item.ok else "failed",
               "kind": item.failure.kind if item.failure else None, "stage": item.stage,
               "error": in_flags(item.message) or None, "resumed": list(item.resumed), "notes": list(item.notes)}
        if item.ok:
            row |= {"output": str(output), "run_record": str(run_json_path(output)),
                    "seconds": round(item.result.seconds, 4)}
        rows.append(row)
    return rows


def _summary(args: argparse.Namespace, items: Sequence[BatchItem], prepared: Prepared, order: str, *,
             rows: list[dict[str, Any]] | None = None, lead: bool = False) -> int:
    """The batch's last line and ``batch.json`` beside the outputs; 1 when any image failed. ``rows``: the rows of
    every rank of a data job, instead of those of ``items``; an image without a row (its rank stopped) is
    ``unknown``."""
    outputs = dict(prepared.jobs)
    ran = _rows(items, prepared) if rows is None else rows
    rows = [{"input": str(path), "name": path.stem, "status": "failed", "kind": "input", "stage": None,
             "error": one_line(err)} for path, err in prepared.rejected] + ran
    if lead:
        known = {row["input"] for row in rows}
        rows += [{"input": str(path), "name": path.stem, "status": "unknown", "kind": None, "stage": None,
                  "error": "its rank sent no report"} for path in outputs if str(path) not in known]
    position = {str(path): i for i, path in enumerate(prepared.inputs)}
    rows.sort(key=lambda row: position[row["input"]])
    written = sum(row["status"] == "written" for row in rows)
    failures = [f"{Path(row['input']).name}: {_reason(row)}" for row in rows if row["status"] != "written"]
    line = f"{written} written, {len(failures)} failed" + (": " + "; ".join(failures) if failures else "")
    folder = next(iter(outputs.values())).parent
    write_json_atomic(folder / "batch.json", {
        "command": args.command, "order": order,
        "work_dir": None if args.work_dir is None else str(args.work_dir),
        "written": written, "failed": len(failures), "summary": line, "images": rows})
    print(line, file=sys.stderr if failures else sys.stdout, flush=True)
    return 1 if failures else 0


def _reason(row: dict) -> str:
    """A failure's first clause without its path (``not an image Pillow can read``)."""
    text = row["error"].split(";")[0]
    for spelling in (row["input"], Path(row["input"]).name):
        text = text.replace(spelling, "")
    return " ".join(text.split()).removeprefix("is ")


if __name__ == "__main__":
    raise SystemExit(main())
