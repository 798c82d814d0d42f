"""The process roles of a job under torchrun, decided once from the environment, each a small function over a
``Session``:

- ``alone``: no torchrun (or ``--plan`` where each rank can plan alone): check, plan, run, write;
- ``data_group``: a rank of ``--parallel data``: the same on its share of the images (``pipelines.data_parallel``);
- ``leader``: rank 0 of a CFG / PipeFusion job (of a data group's, with ``--data-groups``): the same, image by
  image, the other ranks following its flow stages;
- ``follower``: any other rank of such a job: plan and fetch its part of the flow models, then follow rank 0.

``launch(job, voice)`` decides which, from ``job.parallel`` and torchrun's environment. Every rank decides the
same refusals before any rendezvous (``parallel_settings``; a job's own values were checked when it was made);
rank 0 says such a refusal once and every rank exits 2. A rank other than 0 never exits first with a refusal rank 0
says: under torchrun the first rank to exit makes the agent stop the others, and rank 0 could be stopped before
its line is out (issue 36, 6.1). So it waits until torchrun stops it, after rank 0 has printed and exited, and says
the line itself only if that does not come (``REFUSED_WAIT_S``).

The front end speaks through a ``Voice``: what it prints, in its own words.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack, closing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch

from pixal3d.interrupts import terminate_as_exception
from pixal3d.locks import exclusive_lock
from pixal3d.models.preprocess import ImageError
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
from .data_parallel import DataJob, GroupStoppedError
from .errors import Failure, one_line
from .job import Job, UsageError
from .leftovers import clean_leftovers, cleaned_line
from .parallel import rank_device, rank_of
from .plan import RunPlan, check_inputs, default_device, parse_device
from .ranks import Rank
from .result import Result, run_json_path
from .session import Session, batch_rows, check_outputs, plan_outputs, write_summary
from .work_dir import LOCK as WORK_DIR_LOCK
from .work_dir import WorkDir

logger = logging.getLogger(__name__)

REFUSED_WAIT_S = 60.0
"""How long a rank other than 0 of a refused torchrun job waits for torchrun to stop it (rank 0 has said why and
exited) before it says the refusal itself and exits."""


class Voice(Protocol):
    """What a front end says, in its own words (the command's: ``pipelines.cli.CommandVoice``)."""

    name: str  # what run.json's entry of the front end is called

    def failure(self, err: BaseException, *, started: bool) -> Failure | None:
        """``pipelines.errors.classify`` in the front end's words (None: a bug, whose traceback must show)."""

    def words(self, text: str) -> str:
        """The library's words in the front end's (``memory_budget`` → ``--memory-budget``)."""

    def error(self, message: str) -> None:
        """The one error line."""

    def note(self, message: str) -> None:
        """A line beside the run on stderr (an input skipped, leftovers of a killed run removed)."""

    def say(self, text: str, *, failed: bool = False) -> None:
        """Output for the user (the plan, the per-stage table, the summary; ``failed``: on stderr)."""


# -- deciding the role ------------------------------------------------------------------------------------
def launch_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's rank as torchrun set it (0 without torchrun)."""
    return int((os.environ if env is None else env).get("RANK", "0"))


def launch(job: Job, voice: Voice, env: Mapping[str, str] | None = None) -> int:
    """Run ``job`` in the role this process has (see the module's doc); returns the exit code."""
    env = os.environ if env is None else env
    try:
        settings = parallel_settings(job, env)
        if settings is None:
            return alone(job, voice)
        if settings.mode == "data":
            return data_group(job, voice, settings)
        topology = Topology.from_env(settings, env)
        if job.plan_only and settings.pp_split != "auto":  # each rank can plan; rank 0 prints its plan, nobody joins
            return alone(job, voice, settings) if topology.global_rank == 0 else 0
        device = parse_device(job.device) if job.device else default_device()
        runtime = init_parallel(settings, device=rank_device(device, topology))
    except (UsageError, ParallelConfigError) as err:  # the same on every rank: said once
        return refused(err, voice, env)
    try:
        return leader(job, voice, runtime) if topology.rank == 0 else follower(job, voice, rank_of(runtime, device))
    except BaseException as err:  # an unforeseen error: the other ranks stop too, then the traceback
        runtime.fail(err)
        raise
    finally:
        runtime.close()


def refused(err: BaseException, voice: Voice, env: Mapping[str, str] | None = None, *,
            wait_s: float = REFUSED_WAIT_S) -> int:
    """A refusal every rank decides alike (``err``, before any weight is read): rank 0 says it; any other rank,
    under torchrun, waits for torchrun to stop it (after rank 0 has printed and exited), saying the line itself
    only if ``wait_s`` passes first. Returns the exit code."""
    failure = voice.failure(err, started=False)
    if failure is None:
        raise err
    env = os.environ if env is None else env
    rank = launch_rank(env)
    if rank == 0:
        voice.error(failure.message)
    else:
        wait_for_rank_0(failure, voice, env, wait_s=wait_s)
    return failure.exit_code


def wait_for_rank_0(failure: Failure, voice: Voice, env: Mapping[str, str], *, wait_s: float) -> None:
    """On a rank other than 0 with a failure rank 0 says too: under torchrun (whose agent stops every rank when
    the first one exits), wait until torchrun stops this one; say the line as this rank's if it never does."""
    if "TORCHELASTIC_RUN_ID" not in env:  # not started by torchrun: nobody stops the others when this one exits
        return
    time.sleep(wait_s)
    voice.error(f"rank {launch_rank(env)}: {failure.message}")


def parallel_settings(job: Job, env: Mapping[str, str] | None = None) -> ParallelSettings | None:
    """``--parallel`` and its knobs as ``ParallelSettings`` checked against torchrun's environment (the same
    on every rank, before any rendezvous); None for ``--parallel none``, today's single process."""
    env = os.environ if env is None else env
    ask = job.parallel
    world = int(env.get("WORLD_SIZE", "1"))
    knobs = ask.knobs()
    if ask.mode == "none":
        if ask.data_groups is not None:
            raise UsageError("--data-groups needs --parallel cfg, pipefusion or both (--parallel is none)")
        if knobs:
            raise UsageError(f"{' '.join(knobs)} needs --parallel pipefusion or both (--parallel is none)")
        if world > 1:
            raise UsageError(f"torchrun started {world} processes but --parallel is none, so each would run the whole "
                             f"cascade and write the same files; pass --parallel cfg, pipefusion or both, or run "
                             f"without torchrun")
        return None
    groups = 1 if ask.data_groups is None else ask.data_groups
    if ask.data_groups is not None and ask.mode == "data":
        raise UsageError(f"--data-groups {ask.data_groups}: --parallel data makes every process a data group of its "
                         f"own; drop --data-groups")
    if ask.mode != "data" and job.order == "stage":
        raise UsageError(f"--batch-order stage needs one process per image; under --parallel {ask.mode} the "
                         f"other ranks follow rank 0 image by image: drop it, use --parallel data (each process "
                         f"runs whole images), or run without --parallel")
    if ask.mode != "data" and groups == 1 and job.work_dir is not None:
        given = (f"--data-groups {ask.data_groups} is one group, whose" if ask.data_groups is not None else
                 "the other ranks follow rank 0 image by image: a work directory is for")
        raise UsageError(
            f"--work-dir needs 2 or more data groups under --parallel {ask.mode} ({given} other ranks follow rank 0 "
            f"image by image; the groups claim images in the work directory): give --data-groups 2 or more, use "
            f"--parallel data (each process runs whole images), or run without --parallel"
            if ask.data_groups is not None else
            f"--work-dir needs data groups under --parallel {ask.mode} (the other ranks follow rank 0 image by image; "
            f"the groups claim images in the work directory): add --data-groups K (2 or more), use --parallel data "
            f"(each process runs whole images), or run without --parallel")
    cfg = 2 if ask.mode in ("cfg", "both") else 1
    piped = ask.mode in ("pipefusion", "both")
    if "RANK" not in env or "WORLD_SIZE" not in env:
        ranks = 2 if ask.mode == "data" else groups * (2 * cfg if piped else cfg)
        raise ParallelConfigError(f"--parallel {ask.mode} runs under torchrun, which starts the processes: "
                                  f"torchrun --nproc-per-node {ranks} scripts/image_to_mesh.py ... "
                                  f"(docs/parallel.md)")
    if ask.mode == "data":
        if knobs:
            raise UsageError(f"{' '.join(knobs)} needs --parallel pipefusion or both (--parallel data runs every "
                             f"image whole on one process)")
        return ParallelSettings(mode="data", data_groups=world, timeout_s=ask.timeout_s)
    pp = ask.pp if ask.pp is not None else (max(1, world // (cfg * groups)) if piped else 1)
    settings = ParallelSettings(mode=ask.mode, pp=pp, patches=ask.patches if ask.patches is not None else
                                (pp if piped else 1), warmup=1 if ask.warmup is None else ask.warmup,
                                timeout_s=ask.timeout_s, pp_split=ask.pp_split, data_groups=groups)
    settings.check_world_size(world)
    return settings


# -- the roles ----------------------------------------------------------------------------------------------
def alone(job: Job, voice: Voice, parallel: ParallelSettings | None = None) -> int:
    """One process: the whole job (``parallel``: the settings a rank plans with alone, for ``--plan``)."""
    return command(job, voice, rank_of(parallel, _device(job)) if parallel is not None else Rank())


def data_group(job: Job, voice: Voice, settings: ParallelSettings) -> int:
    """A rank of a ``--parallel data`` job: the whole job on its share of the images (``data_parallel``)."""
    if job.plan_only:  # each rank can plan alone; rank 0 prints its plan
        return alone(job, voice, settings) if launch_rank() == 0 else 0
    share = DataJob.join(settings)
    try:
        return command(job, voice, replace(rank_of(settings, _device(job)), share=share))
    finally:
        share.close()


def leader(job: Job, voice: Voice, runtime: ParallelRuntime) -> int:
    """Rank 0 of a CFG / PipeFusion job (or of a data group's, which then claims images with the other groups'
    leaders): the whole job, image by image, the other ranks following."""
    share = DataJob.join(runtime.settings) if runtime.topology.data_groups > 1 and not job.plan_only else None
    try:
        return command(job, voice, replace(rank_of(runtime, runtime.device), share=share))
    finally:
        if share is not None:
            share.close()


def follower(job: Job, voice: Voice, rank: Rank) -> int:
    """A rank ≠ 0: plan, fetch and check only the flow models' weights, then follow rank 0 (``--plan``: plan
    only, taking part in gathering the ranks' memory for ``--pp-split auto``)."""
    runtime = rank.runtime
    session = Session(voice.name, device=runtime.device, rank=rank)
    try:
        plan = session.plan(job)
        if job.plan_only:
            return 0
        with session:
            session.prepare(job, plan).follow()
    except ParallelConfigError as err:  # rank 0 says it, or names this rank when only this one has it
        started = runtime.requests > 0  # rank 0 has announced an image
        runtime.fail(err)
        if not started:  # a refusal rank 0 says too: never exit before it has
            wait_for_rank_0(voice.failure(err, started=False), voice, os.environ, wait_s=REFUSED_WAIT_S)
        return 1 if started else 2
    except BaseException as err:  # classify() decides; anything it does not know goes to main
        failure = voice.failure(err, started=runtime.requests > 0)
        if failure is None:
            raise
        runtime.fail(err)
        message = failure.message if failure.message.startswith("rank ") else \
            f"rank {runtime.topology.rank}: {failure.message}"
        voice.error(message)
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


# -- what every role that runs images does ------------------------------------------------------------
@dataclass(frozen=True)
class Prepared:
    """What was found before reading a weight: the session and its plan, (input, output) per usable input, the
    inputs refused from their headers (a batch goes on without them), every input in order, and the job with its
    images."""

    session: Session
    plan: RunPlan
    pairs: list[tuple[Path, Path]]
    refused: list[tuple[Path, ImageError]]
    inputs: list[Path]
    job: Job

    @property
    def outputs(self) -> dict[Path, Path]:
        return dict(self.pairs)


def command(job: Job, voice: Voice, rank: Rank | None = None) -> int:
    """Everything a process that runs images does (alone, a data group, a leader; ``rank``: this process's, built
    for its role): check, plan, run, write, sum up; a failure is one line (``voice``) and the exit code."""
    rank = rank if rank is not None else Rank()
    lead, started = rank.speaks, False  # says what every rank would say alike
    try:
        with terminate_as_exception(), ExitStack() as held:
            prepared = prepare(job, held, rank, voice=voice)
            session = prepared.session
            for path, err in prepared.refused if lead else ():
                voice.note(f"skipped {path.name}: {voice.words(one_line(err))}")
            if lead and (job.plan_only or not job.quiet):
                voice.say(voice.words(prepared.plan.table()))
                if job.several:
                    voice.say(batch_line(prepared))
            if job.plan_only:
                return 0
            held.enter_context(session)
            session.prepare(prepared.job, prepared.plan)  # fetches and verifies the weights
            started = True
            return run(session, prepared, voice, rank.share)
    except BaseException as err:  # the voice's classify decides; anything it does not know is re-raised
        failure = voice.failure(err, started=started)
        if failure is None:
            raise
        runtime, share = rank.runtime, rank.share
        if runtime is not None:
            runtime.fail(err)  # the other ranks stop too (nothing happens if they already know)
            if failure.kind == "interrupted":  # torchrun's agent stops every rank when one dies: say which
                failure = replace(failure, message=f"{failure.message}; {ended_ranks_line(runtime)}")
        if share is not None and share.rank == 0 and not isinstance(err, PeerFailedError):
            share.post_exit(failure.exit_code, readers=0)  # the other groups stop before their next image
        if failure.kind == "interrupted" and job.work_dir is not None:
            failure = replace(failure, message=f"{failure.message}; run the same command again to resume from "
                                               f"{job.work_dir}")
        voice.error(failure.message)
        return failure.exit_code


def prepare(job: Job, held: ExitStack, rank: Rank, *, voice: Voice) -> Prepared:
    """Everything that can be checked before a weight is read, in this order: the inputs (of the job's kind: images
    Pillow can open, views folders whose transforms.json and frames check, usable by this config's stages; in a
    batch a bad one costs only itself), the outputs (not folders, writable, not colliding, not being written by
    another run: locked), the work directory, the device (this rank's), the plan (from safetensors headers only;
    with a field of view given, no camera model). A data job's ranks != 0 leave the locks to rank 0
    and open the work directory after it."""
    kind, options = job.kind, {"num_views": job.num_views}
    if job.mesh is not None:  # read and checked once, before any weight (MeshError: one line)
        from .inputs.mesh import read_run_mesh

        job = dataclasses.replace(job, mesh=read_run_mesh(job.mesh, job.mesh_pose))
    inputs = everything = kind.expand(job.inputs)
    refused: list[tuple[Path, ImageError]] = []
    if job.several:
        refused = [(path, err) for path in inputs if (err := _unusable(job, path)) is not None]
        if len(refused) == len(inputs):
            raise UsageError(f"none of the {len(inputs)} inputs is a usable {kind.noun}; the first: "
                             f"{one_line(refused[0][1])}")
        inputs = [path for path in inputs if path not in dict(refused)]
    else:  # from the headers (a views folder: transforms.json and every frame), before any weight is read
        check_inputs(job.config, [kind.probe(path, options) for path in inputs], kind=kind)
    pairs = list(zip(inputs, plan_outputs(inputs, job.output)))
    check_outputs(pairs, job)
    share, lead = rank.share, rank.speaks
    if job.work_dir is not None:  # a folder that is not a work directory is refused before any weight is read
        if share is not None:
            share.in_turn(lambda: WorkDir(job.work_dir))  # rank 0 makes it, then the others find it made
        else:
            WorkDir(job.work_dir)
    if not job.plan_only and lead:
        for _, output in pairs:
            held.enter_context(exclusive_lock(output.with_name(f".{output.name}.lock"), wait=False,
                                              what=str(output), owner="another run"))
        if job.work_dir is not None:
            held.enter_context(exclusive_lock(job.work_dir / WORK_DIR_LOCK, wait=False,
                                              what=str(job.work_dir), owner="another run"))
        latents = [job.keep_latents / f"{i.stem}.latents.pt" for i, _ in pairs] if job.keep_latents else []
        # Under --parallel data the other groups write these outputs and records meanwhile, without these locks: a
        # temporary file or a lone run.json may be theirs, so only lock files nobody holds are cleared there.
        removed = clean_leftovers([o for _, o in pairs], latents=latents, work_dir=job.work_dir,
                                  temporaries=share is None)
        if removed:
            voice.note(cleaned_line(removed))
    job = job.with_images([job.image(path, path.stem) for path, _ in pairs])
    session = Session(voice.name, device=rank.place(_device(job)), rank=rank, lean=True)
    return Prepared(session, session.plan(job), pairs, refused, everything, job)


def _device(job: Job) -> torch.device:
    """The job's ``--device``, else the default one (CUDA, else MPS, else CPU)."""
    return parse_device(job.device) if job.device else default_device()


def _unusable(job: Job, path: Path) -> ImageError | None:
    try:
        check_inputs(job.config, [job.kind.probe(path, {"num_views": job.num_views})], kind=job.kind)
    except ImageError as err:
        return err
    return None


def run(session: Session, prepared: Prepared, voice: Voice, share: DataJob | None = None) -> int:
    """Every usable input through the session; each result written as it comes. One input: its error is the
    job's. Several: a failed image is one line and the others go on; the summary ends it. In a data job this rank
    runs its share, and rank 0 writes the summary of every rank's images."""
    job, outputs = prepared.job, prepared.outputs
    order = batch_order(prepared.plan, job)
    items: list[BatchItem] = []
    with closing(session.run(job, plan=prepared.plan, order=order, progress=not job.quiet, trace=job.trace)) as batch:
        for item in batch:
            items.append(item)
            if item.ok:
                written(session, item, outputs[Path(item.input)], job, voice)
            elif not job.several:
                raise item.error
            else:
                voice.note(f"skipped {Path(item.input).name}: {voice.words(item.message)}")
    if share is not None:
        session.close()  # its models go, and a group's followers are told the end now, not after the slowest group
        return shared_summary(share, items, prepared, order, voice)
    return summary(batch_rows(items, outputs, voice.words), prepared, order, voice) if job.several else 0


def written(session: Session, item: BatchItem, output: Path, job: Job, voice: Voice) -> None:
    """Write ``item``'s result (the session's one writer) and say so: its per-stage table, its camera, where."""
    result: Result = item.result
    latents = job.keep_latents / f"{item.name}.latents.pt" if job.keep_latents is not None else None
    session.write(result, job, output, latents=latents)
    if not job.quiet:
        lines = [result.table(), *([camera] if (camera := result.camera_line()) is not None else [])]
        resumed = f", {len(item.resumed)} stages from {job.work_dir}" if item.resumed else ""
        lines.append(f"{output} ({result.seconds:.1f} s, policy {result.policy.value}{resumed}); "
                     f"run record {run_json_path(output)}")
        voice.say("\n".join(lines))


def summary(rows: list[dict], prepared: Prepared, order: str, voice: Voice, *, lead: bool = False) -> int:
    """The batch's summary line and ``batch.json``; 1 when any image failed."""
    line, failed = write_summary(prepared.job, rows, order=order, inputs=prepared.inputs, outputs=prepared.outputs,
                                 refused=prepared.refused, lead=lead)
    voice.say(line, failed=failed)
    return 1 if failed else 0


def shared_summary(share: DataJob, items: Sequence[BatchItem], prepared: Prepared, order: str, voice: Voice) -> int:
    """A data job's end: every rank's rows to rank 0, which writes ``batch.json`` and the summary line (and names a
    rank that sent nothing); every rank returns rank 0's exit code."""
    rows = [{**row, "rank": share.rank} for row in batch_rows(items, prepared.outputs, voice.words)]
    try:
        gathered = share.gather(rows)
    except GroupStoppedError as err:
        summary([row for part in err.rows for row in part], prepared, order, voice, lead=True)
        share.post_exit(1, readers=len(err.rows) - 1)
        raise
    if gathered is None:
        return share.wait_exit()
    code = summary([row for part in gathered for row in part], prepared, order, voice, lead=True)
    share.post_exit(code, readers=share.groups - 1)
    return code


def batch_order(plan: RunPlan, job: Job) -> str:
    """``--batch-order``, else the policy's default; image by image under ``--parallel`` (the other ranks follow;
    a data group runs its images as one process would)."""
    if plan.role.shares_flows:
        return "image"
    return job.order or default_order(plan.policy)


def batch_line(prepared: Prepared) -> str:
    """How a batch will go: its order, and under stage order how much of the image states waits in memory between
    stages (the rest on disk)."""
    order = batch_order(prepared.plan, prepared.job)
    room = prepared.plan.state_budget()
    how = ("image by image" if order != "stage" else
           f"stage by stage, image states kept in memory up to {gib(room)} between stages (more wait on disk)"
           if room > 0 else "stage by stage, image states waiting on disk between stages (the largest stage "
           "leaves no memory for them)")
    images = len(prepared.pairs)
    work_dir = prepared.job.work_dir
    return f"batch: {images} image{'s' if images != 1 else ''}, {how}" + (f"; records in {work_dir}" if work_dir else "")
