"""The cascade under torchrun: rank 0 runs every stage, the other ranks join its flow stages.

``Pixal3D.from_config(config, parallel=ParallelSettings(...))`` on every rank of a torchrun job:

* **rank 0** (``Pixal3D.run``) runs the whole cascade. Its four flow stages sample through
  ``flow_stage.sample`` → ``parallel_sample`` with the run's runtime (``RunState.parallel``); everything
  else (preprocess, camera, conditioning, decoders, export) runs on rank 0 alone, and only rank 0 has
  outputs. ``Leader`` frames each image: it announces the image and the flow stages it will sample
  (each follower checks them against its own), exchanges every rank's per-stage peak memory at the
  end, reports a failure to the followers, and announces the end when the pipeline closes.
* **ranks ≠ 0** (``Pixal3D.follow``) hold only their shards of the flow models: per image,
  ``FollowerStage`` by ``FollowerStage`` the staging registry loads the stage's shard (and releases,
  parks or keeps the previous one as the policy says), ``parallel_sample`` runs with no inputs (rank 0's
  are broadcast), and ``BetweenImages`` lets the last shard go while rank 0 decodes and exports.

Every message is a request of the job (``pixal3d.parallel.session``), so a failure on any rank, inside
a flow stage or not, stops every rank within the job's timeout, each naming the failed rank.

Parallelism reaches ``Pixal3D`` in two places only: the plan is transformed for this rank (``rank_plan``:
its device, its stages, the shards the plan counts, its share of the machine) and rank 0's executor gets
the ``Leader`` hook. The job's settings or an already joined runtime are told apart here, nowhere else.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from pixal3d import devices
from pixal3d.config import CascadeConfig
from pixal3d.models.loading import read_spec
from pixal3d.parallel import (
    ParallelConfigError,
    ParallelRuntime,
    ParallelSettings,
    PeerFailedError,
    init_parallel,
    load_flow_shard,
    parallel_sample,
)
from pixal3d.parallel.session import announce, exchange, receive
from pixal3d.parallel.shard import shard_tensor_names
from pixal3d.parallel.split import describe_split, model_split
from pixal3d.parallel.topology import Topology
from pixal3d.pipeline_json import ResolvedWeights, planned_sizes
from pixal3d.staging import Machine, Stage
from pixal3d.staging.executor import Executor, Hook, Item, Store
from pixal3d.staging.policy import usable

from .ranks import Rank, Sized
from .state import PROVIDED, RunState

FOLLOWER_PROVIDED = ("parallel",)


@dataclass
class FollowerState:
    """A follower's run: only the job's runtime (its flow stages read nothing else)."""

    parallel: ParallelRuntime


def flow_stages(stages: Sequence[Stage]) -> list[Stage]:
    """The stages that sample a flow model (``flow_model`` set), in run order."""
    return [s for s in stages if getattr(s, "flow_model", None) is not None]


def _sampler(stage: Stage) -> Any:
    """A flow stage's ``config.sampler`` (a ``FollowerStage``'s ``sampler``)."""
    sampler = getattr(stage, "sampler", None) or getattr(getattr(stage, "config", None), "sampler", None)
    if sampler is None:
        raise ParallelConfigError(f"stage {stage.name!r} names flow_model {stage.flow_model!r} but has no "
                                  f"config.sampler; a stage sampled in parallel needs its sampler settings there")
    return sampler


def flow_signature(stages: Sequence[Stage]) -> list[dict[str, Any]]:
    """What every rank must agree on per flow stage: name, flow model and sampler settings."""
    return [{"stage": s.name, "flow_model": s.flow_model, "sampler": asdict(_sampler(s))} for s in flow_stages(stages)]


class FollowerStage(Stage):
    """A follower's part of one flow stage: its shard of the flow model, sampling with rank 0's inputs."""

    inputs = FOLLOWER_PROVIDED

    def __init__(self, stage: Stage):
        self.name = stage.name
        self.flow_model = stage.flow_model
        self.needs = (stage.flow_model,)
        self.sampler = _sampler(stage)
        self._working_set = int(stage.working_set() or 0)  # the flow stage's estimate (an upper bound here)

    def working_set(self) -> int:
        return self._working_set

    def run(self, state: FollowerState, models: Mapping[str, nn.Module]) -> None:
        parallel_sample(models[self.flow_model], None, cond=None, neg_cond=None, sampler=self.sampler,
                        runtime=state.parallel)


class BetweenImages(Stage):
    """A follower after an image's last flow stage: entering it lets that stage's shard go (per policy)."""

    name = "between_images"

    def working_set(self) -> int:
        return 0

    def run(self, state: FollowerState, models: Mapping[str, nn.Module]) -> None:
        return None


def follower_stages(stages: Sequence[Stage]) -> list[Stage]:
    """A follower's stages: one ``FollowerStage`` per flow stage of the cascade, then ``BetweenImages``."""
    return [*(FollowerStage(s) for s in flow_stages(stages)), BetweenImages()]


class Skipping(Store):
    """A follower's store: an announced image starts at the first flow stage rank 0 will sample (``item.source``:
    how many it resumed from its work directory and will not sample again); a follower's stages leave no state."""

    def resume(self, item: Item) -> int:
        return int(item.source or 0)

    def restore(self, item: Item, k: int, state: Any) -> None:
        return None


# -- the plan of one rank ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RankPlan(Rank):
    """This rank's part of a parallel job, decided with the plan: the settings, where this rank sits, its
    device, and the job's runtime when the caller joined it before planning (else ``join`` joins it); ``share``:
    a data group's part of the job's images (``data_parallel.DataJob``, held by the group's leader)."""

    settings: ParallelSettings
    topology: Topology
    device: torch.device
    runtime: ParallelRuntime | None = None
    owns_runtime: bool = False                  # joined while planning (pp_split auto): this pipeline closes it
    capacities: tuple[int, ...] | None = None   # pp_split auto: each pipeline stage's usable memory, in bytes
    splits: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # flow model -> blocks/rank
    share: Any = None

    streams = False  # the flow models are a pipeline rank's shards: the plan counts them whole, never streamed

    @property
    def follower(self) -> bool:
        """Whether this rank only joins rank 0's flow stages (``Pixal3D.follow``); never in data mode."""
        return self.topology.rank != 0 and not self.independent

    @property
    def number(self) -> int:
        return self.topology.rank

    @property
    def speaks(self) -> bool:
        """Rank 0 of the job: of its data groups (``share``) and of the group's ranks."""
        return ((self.share is None or self.share.rank == 0)
                and (self.runtime is None or self.runtime.topology.global_rank == 0))

    @property
    def shares_flows(self) -> bool:
        return not self.independent

    @property
    def independent(self) -> bool:
        """Data mode: every rank runs whole images of its own (no flow stage is shared)."""
        return self.settings.mode == "data"

    def split(self, num_blocks: int) -> tuple[int, ...]:
        """Each pipeline rank's block count for a flow model of ``num_blocks`` blocks."""
        return model_split(self.settings.pp_split, num_blocks, self.topology.pp_degree, self.capacities)

    def with_memory(self, usable_bytes: int) -> RankPlan:
        """``pp_split='auto'``: this plan with every pipeline stage's usable memory, gathered from every rank
        (joining the job first when it was not joined: every rank plans, so every rank takes part). A stage
        held by two CFG groups counts the smaller of its two ranks."""
        if self.settings.pp_split != "auto" or self.topology.pp_degree <= 1:
            return self
        plan = self
        if plan.runtime is None:
            plan = dataclasses.replace(plan, runtime=init_parallel(self.settings, device=self.device),
                                       owns_runtime=True)
        reports = plan.runtime.gather_memory(usable_bytes)
        topo = self.topology
        stages = tuple(min(reports[topo.rank_of(c, k)] for c in range(topo.cfg_degree))
                       for k in range(topo.pp_degree))
        return dataclasses.replace(plan, capacities=stages)

    def place(self, device: torch.device) -> torch.device:
        return self.device

    def stages(self, stages: Sequence[Stage]) -> tuple[Stage, ...]:
        """The stages this rank runs: all of them on rank 0, the flow stages' shards elsewhere; the warmup is
        checked against the cascade's samplers first."""
        check_warmup(self.settings, stages)
        return tuple(follower_stages(stages)) if self.follower else tuple(stages)

    def state(self) -> tuple[tuple[str, ...], type]:
        """What this rank's runs provide, and their state type."""
        return (FOLLOWER_PROVIDED, FollowerState) if self.follower else (PROVIDED, RunState)

    def shards(self, stages: Sequence[Stage], stage: int | None = None
               ) -> dict[str, Callable[[Iterable[str]], set[str]]]:
        """Flow model → the tensor names this rank's shard (or pipeline stage ``stage``'s) holds, for the plan
        (pp > 1; else whole models)."""
        if self.topology.pp_degree <= 1:
            return {}
        stage = self.topology.stage if stage is None else stage
        return {s.flow_model: shard_selector(s.flow_model, self.topology, self.split, stage)
                for s in flow_stages(stages)}

    def sized(self, config: CascadeConfig, stages: Sequence[Stage], models: Sequence[str],
              machine: Machine) -> Sized:
        """The other models' sizes first: ``pp_split`` auto gathers every rank's memory for flow blocks (usable, less
        the other models its largest flow stage holds), then a pipeline rank counts its shard of each flow model.
        Ranks on one machine share it."""
        flows = {s.flow_model for s in flow_stages(stages)}
        source = config.source or None
        sizes, notes = planned_sizes(config.weights, models=[m for m in models if m not in flows], config_file=source)
        machine, shared = machine_share(machine, self.topology)
        beside = max((sum(sizes.get(m, 0) for m in s.needs if m not in flows) for s in flow_stages(stages)),
                     default=0)
        rank = self.with_memory(max(0, usable(machine.device_available) - beside))
        flow_sizes, flow_notes = planned_sizes(config.weights, models=[m for m in models if m in flows],
                                               select=rank.shards(stages), config_file=source)
        rank, split_notes = plan_splits(rank, stages, lambda select: planned_sizes(
            config.weights, models=list(select), select=select)[0])
        return Sized(rank, machine, {**sizes, **flow_sizes},
                     [*notes, *flow_notes, describe_parallel(rank.settings, rank.topology), *split_notes],
                     [shared] if shared else [])

    def check_weights(self, weights: ResolvedWeights, stages: Sequence[Stage]) -> None:
        """Every pipeline rank needs a block of every flow: N <= blocks."""
        check_blocks(self.settings, weights, [s.flow_model for s in flow_stages(stages)])

    def join(self) -> JoinedRank:
        """This rank in its job: the runtime (joined here unless the caller or the plan did; data mode: none, each
        rank runs its images alone and ``pipelines.data_parallel`` holds the job together)."""
        if self.independent:
            return JoinedRank(self, None, False)
        if self.runtime is not None:
            return JoinedRank(self, self.runtime, self.owns_runtime)
        return JoinedRank(self, init_parallel(self.settings, device=self.device), True)

    def describe(self) -> str:
        return describe_parallel(self.settings, self.topology)


class JoinedRank(Rank):
    """A planned ``RankPlan`` joined to its job: the runtime (None in data mode), rank 0's ``Leader`` once the
    executor's hooks are made, and the data group's share of the images."""

    def __init__(self, plan: RankPlan, runtime: ParallelRuntime | None, owned: bool):
        self.plan, self.runtime, self._owned = plan, runtime, owned
        self._leader: Leader | None = None

    @property
    def follower(self) -> bool:
        return self.plan.follower

    @property
    def number(self) -> int:
        return self.plan.number

    def state(self) -> tuple[tuple[str, ...], type]:
        return self.plan.state()

    def loaders(self, loaders: Mapping[str, Callable[[], nn.Module]], weights: ResolvedWeights,
                stages: Sequence[Stage]) -> dict[str, Callable[[], nn.Module]]:
        """The flow models as this rank's shards."""
        if self.runtime is None:
            return dict(loaders)
        return shard_loaders(loaders, weights, [s.flow_model for s in flow_stages(stages)], self.runtime,
                             split=self.plan.split)

    def hooks(self, stages: Sequence[Stage]) -> list[Hook]:
        """Rank 0's ``Leader`` (none on a follower, whose executor ``follow`` makes, and none in data mode)."""
        if self.runtime is None or self.follower:
            return []
        self._leader = Leader(self.runtime, stages, self.plan.splits)
        return [self._leader]

    def check_batch(self, order: str, work_dir: Any) -> None:
        if self.runtime is None:
            return
        if order == "stage":
            raise ValueError("under torchrun the other ranks follow rank 0 image by image: a parallel batch runs in "
                             "image order")
        if work_dir is not None and self.plan.share is None:
            raise ValueError("under torchrun a work directory is for data groups (the groups claim images in it): "
                             "plan with a data group's rank (pipelines.launch), or run without work_dir")

    def drive(self, executor: Executor, items: Sequence[Item], order: str, work: Any) -> Iterator[Item]:
        """A data group's images (claimed in ``work``, or i mod K); every image without one."""
        if self.plan.share is not None:
            return self.plan.share.feed(items, executor, order, work)
        return executor.drive(items, order)

    def report(self, item: Item, rows: Sequence[Any]) -> dict[str, Any] | None:
        """Every rank's report of ``item``: run.json's ``parallel`` entry (rank 0)."""
        return self._leader.gather(item, rows) if self._leader is not None else None

    @property
    def stopped(self) -> str | None:
        """Why this parallel job can run no more images (an error after its followers joined an image)."""
        return self._leader.stopped if self._leader is not None else None

    def follow(self, runner: Any, relay: Any) -> int:
        """On ranks != 0: rank 0's images through this rank's executor (``follow``)."""
        if not self.follower:
            return super().follow(runner, relay)
        from .batch import Meter

        meter = Meter(relay, lambda: runner.registry, device=self.runtime.device,
                      meta={"rank": self.runtime.topology.rank})
        executor = Executor(runner, lambda item, k: FollowerState(parallel=self.runtime), hooks=[meter],
                            store=Skipping())
        return follow(self.runtime, executor, meter)

    def abort(self, err: BaseException) -> None:
        """The other ranks stop too, rather than wait."""
        if self._leader is not None:
            self._leader.abort(err)
        elif self.runtime is not None:
            self.runtime.fail(err)

    def close(self, release: Callable[[], None] = lambda: None) -> None:
        """Rank 0 tells the followers the job is over, ``release()`` lets the models go, and the job's process groups
        are torn down when this rank made them."""
        try:
            if self._leader is not None:
                self._leader.close()
        finally:
            try:
                release()
            finally:
                if self._owned:
                    self.runtime.close()

    def fail_and_close(self, err: BaseException) -> None:
        """A pipeline that could not be built after joining: the other ranks stop too."""
        if self._owned:
            self.runtime.fail(err)
            self.runtime.close()

    def describe(self) -> str:
        return self.plan.describe()


def rank_of(parallel: Rank | ParallelSettings | ParallelRuntime | None, device: torch.device) -> Rank:
    """The library's ``parallel=`` as this process's rank: a rank (``pipelines.launch`` builds one per process
    role) as it is; settings under torchrun, or a runtime from ``init_parallel``, as this rank's plan; one process
    (``Rank()``) for None or mode ``none``: today's path exactly."""
    if isinstance(parallel, Rank):
        return parallel
    if parallel is None or (isinstance(parallel, ParallelSettings) and parallel.mode == "none"):
        return Rank()
    if isinstance(parallel, ParallelRuntime):
        return RankPlan(parallel.settings, parallel.topology, parallel.device, parallel)
    topology = Topology.from_env(parallel)
    return RankPlan(parallel, topology, rank_device(device, topology))


# -- checks, before anything loads -----------------------------------------------------------------
def check_warmup(settings: ParallelSettings, stages: Sequence[Stage]) -> None:
    """W ≤ the sampler steps of every flow stage (from the config, before any file is read)."""
    for stage in flow_stages(stages):
        steps = _sampler(stage).steps
        if settings.warmup > steps:
            raise ParallelConfigError(f"warmup={settings.warmup} is more than stage {stage.name}'s {steps} sampler "
                                      f"steps; use warmup={steps} or less (warmup={steps} runs that stage "
                                      f"synchronously: exact)")


def check_blocks(settings: ParallelSettings, weights: ResolvedWeights, flow_models: Sequence[str]) -> None:
    """N ≤ the blocks of every flow model (from each checkpoint's json, before any weight is read)."""
    for name in flow_models:
        blocks = read_spec(weights.checkpoints[name].with_suffix(".json")).get("args", {}).get("num_blocks")
        if isinstance(blocks, int) and settings.pp_degree > blocks:
            raise _too_few_blocks(settings.pp_degree, blocks, name)


def _too_few_blocks(pp: int, blocks: int, name: str) -> ParallelConfigError:
    return ParallelConfigError(f"pp={pp} is more than the {blocks} blocks of {name}; every pipeline rank needs "
                               f"at least one block: use pp={blocks} or less")


def shard_selector(name: str, topology: Topology, split: Callable[[int], tuple[int, ...]] | None = None,
                   stage: int | None = None) -> Callable[[Iterable[str]], set[str]]:
    """For the plan: the tensor names of flow model ``name`` (from its header) this rank's shard (or pipeline
    stage ``stage``'s) holds; ``split``: block count → every rank's blocks (default near-equal)."""
    stage = topology.stage if stage is None else stage

    def select(names: Iterable[str]) -> set[str]:
        names = list(names)
        blocks = len({n.split(".")[1] for n in names if n.startswith("blocks.")})
        if topology.pp_degree > blocks:
            raise _too_few_blocks(topology.pp_degree, blocks, name)
        return shard_tensor_names(names, stage, topology.pp_degree, split(blocks) if split else None)
    return select


def model_blocks(weights: ResolvedWeights, name: str) -> int | None:
    """A flow checkpoint's block count, from its json."""
    blocks = read_spec(weights.checkpoints[name].with_suffix(".json")).get("args", {}).get("num_blocks")
    return blocks if isinstance(blocks, int) else None


def shard_loaders(loaders: Mapping[str, Callable[[], nn.Module]], weights: ResolvedWeights,
                  flow_models: Sequence[str], runtime: ParallelRuntime,
                  split: Callable[[int], tuple[int, ...]] | None = None) -> dict[str, Callable[[], nn.Module]]:
    """``loaders`` with each flow model replaced by this rank's shard of it (``load_flow_shard``, ``split``:
    block count → every rank's blocks) when the blocks are split (pp > 1); under CFG-parallel alone every rank
    holds whole models."""
    out = dict(loaders)
    topo = runtime.topology
    if topo.pp_degree > 1:
        for name in flow_models:
            blocks = model_blocks(weights, name)
            out[name] = functools.partial(load_flow_shard, weights.checkpoints[name], topo.stage, topo.pp_degree,
                                          device=runtime.device,
                                          split=split(blocks) if split is not None and blocks else None)
    return out


def rank_device(device: torch.device, topology: Topology) -> torch.device:
    """A rank's device: ``cuda`` without an index becomes ``cuda:<local rank>`` (one GPU per process)."""
    return devices.rank_device(device, topology.local_rank)


def machine_share(machine: Machine, topology: Topology) -> tuple[Machine, str | None]:
    """This rank's share of ``machine`` when ``topology.local_world_size`` ranks run on it: they share its
    host memory (and, on unified memory, the device's pool, which is the same), so each plans with 1/n of
    what is available. Each rank of a discrete-GPU machine has a GPU of its own. Returns the share and a
    sentence for the plan's reasons (None for a rank alone on its machine)."""
    n = topology.local_world_size
    if n <= 1:
        return machine, None
    device = machine.device_available // n if machine.unified else machine.device_available
    share = dataclasses.replace(machine, device_available=device, host_available=machine.host_available // n)
    pool = "memory" if machine.unified else "host memory"
    return share, f"{n} ranks of this job run on this machine and share its {pool}: each plans with 1/{n} of it"


def describe_parallel(settings: ParallelSettings, topology: Topology) -> str:
    """One line for the plan: the job's shape and this rank's part in it."""
    if settings.mode == "data":
        return (f"parallel data: rank {topology.data_group} of {topology.data_groups} runs its share of the images "
                f"through every stage (group {topology.data_group + 1} of {settings.data_groups})")
    role = "runs every stage" if topology.rank == 0 else "joins the flow stages"
    if topology.data_groups > 1:
        role += (f" of data group {topology.data_group + 1} of {topology.data_groups} (torchrun rank "
                 f"{topology.global_rank}; each group runs its share of the images)")
    shard = (f", holds pipeline stage {topology.stage + 1} of {topology.pp_degree} of each flow model (counted "
             f"below as its shard)") if topology.pp_degree > 1 else ""
    knobs = (f", M = {settings.patches} patches after W = {settings.warmup} synchronous steps"
             if topology.pp_degree > 1 else "")
    return f"parallel {settings.mode}: rank {topology.rank} of {topology.world_size} {role}{shard}{knobs}"


# -- per image -------------------------------------------------------------------------------------
def rank_report(runtime: ParallelRuntime, rows: Sequence[Any]) -> dict[str, Any]:
    """This rank's part of run.json: where it ran and its peak memory per stage window."""
    peaks = [r.peak_process for r in rows if r.peak_process is not None]
    device_peaks = [r.peak_device for r in rows if r.peak_device is not None]
    return {"rank": runtime.topology.rank, "torchrun_rank": runtime.topology.global_rank,
            "host": socket.gethostname(), "device": str(runtime.device),
            "pipeline_stage": runtime.topology.stage, "cfg_group": runtime.topology.cfg_index,
            "peak_process_bytes": max(peaks, default=None), "peak_device_bytes": max(device_peaks, default=None),
            "stages": [{"stage": r.stage, "peak_process_bytes": r.peak_process, "peak_device_bytes": r.peak_device}
                       for r in rows]}


def job_record(runtime: ParallelRuntime, ranks: list[dict[str, Any]],
               splits: Mapping[str, Sequence[int]] | None = None) -> dict[str, Any]:
    """run.json's ``parallel`` entry: the settings, the job's shape, each flow model's blocks per pipeline rank
    (``pp_split``, ``blocks``) and every rank's report (with its own blocks per flow model)."""
    s, topo = runtime.settings, runtime.topology
    splits = {name: list(counts) for name, counts in (splits or {}).items()}
    for report in ranks:
        report["blocks"] = {name: counts[report["pipeline_stage"]] for name, counts in splits.items()}
    return {"mode": s.mode, "pp": s.pp_degree, "patches": s.patches, "warmup": s.warmup, "timeout_s": s.timeout_s,
            "pp_split": list(s.pp_split) if isinstance(s.pp_split, tuple) else s.pp_split, "blocks": splits,
            "world_size": topo.world_size, "cfg_degree": topo.cfg_degree, "backend": runtime.backend,
            "data_group": topo.data_group, "data_groups": topo.data_groups, "ranks": ranks}


class Leader(Hook):
    """Rank 0's side of the job, as a hook of its executor: frames each image for the followers, gathers every
    rank's report, ends the job. The followers are told of an image only at its first flow stage, so an image
    that fails before (unreadable, no object) never reaches them: the error is this image's alone and the job
    can go on. An error after that tells the followers and stops the job."""

    def __init__(self, runtime: ParallelRuntime, stages: Sequence[Stage],
                 splits: Mapping[str, Sequence[int]] | None = None):
        self.runtime = runtime
        self.splits = dict(splits or {})
        self.stages = list(stages)
        self.signature = flow_signature(stages)
        self.images = 0
        self.stopped: str | None = None  # why the job can run no more images
        self._image: Item | None = None  # the image being run, and whether the followers were told of it
        self._told = False

    def before(self, item: Item, k: int) -> None:
        """An image's first stage: refused once the job has stopped; its first flow stage: the followers join."""
        if self._image is not item:
            if self.stopped is not None:
                raise PeerFailedError(f"the parallel job has stopped ({self.stopped}); start a new one")
            self._image, self._told = item, False
        if getattr(self.stages[k], "flow_model", None) is not None:
            self._tell(k)

    def failed(self, item: Item, error: BaseException) -> None:
        """The followers are in this image: they stop with it, and so does the job."""
        if self._image is item and self._told:
            self.abort(error)
        self._image = None

    def _tell(self, k: int) -> None:
        """Announce the image at stage ``k``, the first this run of it samples: the flow stages before it were
        resumed from a work directory (``skip``: the followers start after them)."""
        if not self._told:
            announce(self.runtime, {"kind": "image", "index": self.images, "input": self._image.label,
                                    "flows": self.signature, "skip": len(flow_stages(self.stages[:k]))})
            self.images, self._told = self.images + 1, True

    def abort(self, err: BaseException) -> None:
        """Stop the job because of ``err``: the followers stop too."""
        if self.stopped is None:
            self.stopped = f"{type(err).__name__}: {err}"
        self.runtime.fail(err)

    def gather(self, item: Item, rows: Sequence[Any]) -> dict[str, Any]:
        """Every rank's report of ``item`` (its last step): the ``parallel`` record. A run that reached no flow
        stage (``until``) is still reported by every rank."""
        if self._image is not item:
            self._image, self._told = item, False
        self._tell(len(self.stages))
        try:
            return job_record(self.runtime, exchange(self.runtime, rank_report(self.runtime, rows)), self.splits)
        except BaseException as err:
            self.abort(err)
            raise
        finally:
            self._image = None

    def close(self) -> None:
        """Tell the followers there are no more images (once; not after a failure: they have stopped)."""
        if self.stopped is None:
            self.stopped = "rank 0 closed its pipeline"
            announce(self.runtime, {"kind": "end"})


def follow(runtime: ParallelRuntime, executor: Executor, meter: Any) -> int:
    """A follower's loop: each image rank 0 announces through ``executor`` (its flow stages from the first rank 0
    samples, then ``BetweenImages``; the executor's store is ``Skipping``), then its report from ``meter`` (the
    executor's memory hook); returns the number of images when rank 0 ends the job. Any error here is told to
    every other rank before it propagates."""
    if not isinstance(executor.store, Skipping):
        raise TypeError("a follower's executor needs the Skipping store (images resumed on rank 0 skip flow stages)")
    mine = flow_signature([s for s in executor.stages if isinstance(s, FollowerStage)])

    def announced() -> Iterator[Item]:
        for index in itertools.count():
            command = receive(runtime)
            if command.get("kind") == "end":
                return
            _check_flows(runtime.topology.rank, mine, command["flows"])
            yield Item(index, str(command.get("input")), int(command.get("skip", 0)), label=str(command.get("input")))

    images = 0
    try:
        for item in executor.by_item(announced()):
            exchange(runtime, rank_report(runtime, meter.meter_for(item).report()))
            images += 1
        return images
    except BaseException as err:
        runtime.fail(err)
        raise


def _check_flows(rank: int, mine: list[dict[str, Any]], leaders: list[dict[str, Any]]) -> None:
    if mine == leaders:
        return
    names = ([f["stage"] for f in mine], [f["stage"] for f in leaders])
    if names[0] != names[1]:
        raise ParallelConfigError(f"rank {rank} has the flow stages {names[0]} but rank 0 samples {names[1]}; every "
                                  f"rank needs the same config (and the same until and replaced stages)")
    for a, b in zip(mine, leaders, strict=True):
        if a != b:
            keys = sorted(k for k in {*a["sampler"], *b["sampler"]} if a["sampler"].get(k) != b["sampler"].get(k))
            diffs = ", ".join(f"{k} = {a['sampler'].get(k)!r} here, {b['sampler'].get(k)!r} on rank 0" for k in keys)
            raise ParallelConfigError(f"rank {rank}'s config differs from rank 0's in stage {a['stage']}: "
                                      f"{diffs or a['flow_model'] + ' vs ' + b['flow_model']}; every rank needs the "
                                      f"same config")


# -- the uneven split, for the plan ------------------------------------------------------------------
KV_BYTES = 2  # the released flows keep K/V in bf16


def stage_tokens(stage: Stage) -> int | None:
    """A flow stage's planned token count (the sparse stages' estimate; the dense grid's cube)."""
    if hasattr(stage, "estimated_tokens"):
        return int(stage.estimated_tokens())
    resolution = getattr(getattr(stage, "config", None), "noise_resolution", None)
    return int(resolution) ** 3 if resolution else None


def kv_bytes_per_block(tokens: int, branches: int = 2) -> int:
    """PipeFusion's K/V buffers of one block over ``tokens``: K and V per CFG branch, 1536 channels
    (``working_set.FLOW_HEADS`` x ``FLOW_HEAD_DIM``, every released flow), bf16. An estimate for the plan."""
    from .working_set import FLOW_HEAD_DIM, FLOW_HEADS

    return 2 * branches * tokens * FLOW_HEADS * FLOW_HEAD_DIM * KV_BYTES


def plan_splits(rank: RankPlan, stages: Sequence[Stage], sized: Callable[[Mapping[str, Any]], Mapping[str, int]]
                ) -> tuple[RankPlan, list[str]]:
    """Each flow model's blocks per pipeline rank, recorded in the plan (``splits``), and the plan's lines:
    per rank its blocks, weight bytes and K/V buffers. ``sized(select)``: bytes per flow model for a selector
    map (the plan's header reader). Nothing for pp = 1."""
    topo = rank.topology
    if topo.pp_degree <= 1:
        return rank, []
    from pixal3d.telemetry.units import format_bytes as gib

    flows = flow_stages(stages)
    blocks: dict[str, int] = {}

    def counting(name: str, k: int) -> Callable[[Iterable[str]], set[str]]:
        select = shard_selector(name, topo, rank.split, k)

        def count(names: Iterable[str]) -> set[str]:
            names = list(names)
            blocks[name] = len({n.split(".")[1] for n in names if n.startswith("blocks.")})
            return select(names)
        return count

    per_rank = [sized({s.flow_model: counting(s.flow_model, k) for s in flows}) for k in range(topo.pp_degree)]
    splits = {s.flow_model: rank.split(blocks[s.flow_model]) for s in flows if s.flow_model in blocks}
    how = {None: "near-equal", "auto": "auto, in proportion to each rank's memory for flow blocks"}.get(
        rank.settings.pp_split if not isinstance(rank.settings.pp_split, tuple) else "given",
        f"given as {describe_split(rank.settings.pp_split or ())}")
    lines = [f"pipeline split ({how})"
             + (": usable memory less each rank's other models " + " + ".join(gib(c) for c in rank.capacities)
                if rank.capacities else "")
             + "; K/V buffers estimated at the released flows' 1536 channels, bf16, both CFG branches"]
    for s in flows:
        if s.flow_model not in splits:
            continue
        counts, tokens = splits[s.flow_model], stage_tokens(s)
        parts = []
        for k, n in enumerate(counts):
            kv = f", K/V ~{gib(n * kv_bytes_per_block(tokens))}" if tokens else ""
            parts.append(f"rank {topo.rank_of(0, k)}: {n} blocks, {gib(per_rank[k].get(s.flow_model, 0))}{kv}")
        lines.append(f"{s.flow_model} ({describe_split(counts)} of {sum(counts)} blocks): " + "; ".join(parts))
    return dataclasses.replace(rank, splits=splits), lines
