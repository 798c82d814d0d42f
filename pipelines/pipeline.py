"""Pixal3D: the library entry point — one image in, a textured mesh out, in memory.

    pipe = Pixal3D.from_config("configs/1024_cascade.yaml")   # plan, policy, weights; no model loads yet
    result = pipe.run("input.png", seed=42)                   # or a PIL image, or a uint8 array
    result.save("out.glb")

``Pixal3D.plan(config)`` decides before any weight is read what each stage needs (weights from the safetensors
headers, working sets from the stages' own estimates) and which memory policy to run; ``from_plan`` then fetches the
weights and builds the pipeline on the same stage objects (the command prints the plan in between, and ``--plan``
stops there). Models load when their stage first asks for them; the policy decides where they live between stages
and between runs. ``close()`` releases them.

Every run goes through one executor (``pixal3d.staging.executor``): ``run`` is a batch of one, ``run_batch`` takes
several inputs stage by stage (each model loaded once per batch) or one by one and can resume from a work directory
(``batch.py``, ``work_dir.py``). What an input is (an image, posed views, an image with a mesh) is its kind's
(``pipelines.inputs``). Under torchrun the process's rank (``pipelines.ranks``: built per role by ``pipelines.launch``,
or from ``parallel=ParallelSettings(...)``) is consulted at the plan, the loaders, the hooks, the sampler and the
drive: with CFG / PipeFusion rank 0 runs images and every other rank calls ``follow()``; a data group (``--parallel
data``) runs its share of the images whole.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import torch
from torch import nn

from pixal3d.config import CascadeConfig, load_config
from pixal3d.models.preprocess import ImageError
from pixal3d.pipeline_json import ResolvedWeights
from pixal3d.staging import Event, Policy, StageRunner, WeightStream, detect_machine
from pixal3d.staging.executor import Executor
from pixal3d.staging.mps_memory import apply_mps_memory_limit
from pixal3d.telemetry import MemoryMeter

from . import arguments, inputs, state_codec
from .batch import BatchItem, BatchOrder, Meter, Progress, Relay, default_order, image_alone, image_items
from .inputs import InputKind
from .loaders import planned_loaders, with_attention_route
from .parallel import rank_of
from .plan import RunPlan, check_device, default_device, plan_run
from .ranks import Rank
from .result import Result, item_result
from .stage import CascadeStage
from .state import RunState
from .work_dir import StateStore, WorkDir, item_keys, weights_digests

logger = logging.getLogger(__name__)

Loader = Callable[[], nn.Module]


class Pixal3D:
    """The cascade ready to run: stages, resolved weights, a policy, a model registry and this process's rank."""

    def __init__(self, plan: RunPlan, weights: ResolvedWeights, *, strict: bool = False, preserve_rng: bool = True,
                 wrap_loader: Callable[[str, Loader], Loader] | None = None, rank: Rank | None = None):
        self.run_plan = plan
        self.config = plan.config
        self.device = plan.device
        self.weights = weights
        self._relay = Relay()  # the registry's events go to the running span's listeners
        self._rank = rank if rank is not None else plan.role.join()
        if plan.mps_limit is not None:
            apply_mps_memory_limit(plan.mps_limit)
        copied = self.config.runtime.cpu_weights == "copied"
        self._stream = WeightStream(plan.device, copy=copied) if plan.policy is Policy.stream else None
        loaders = with_attention_route(self._rank.loaders(planned_loaders(plan, weights, self._stream), weights,
                                                          plan.stages), self.config.runtime.attention)
        if wrap_loader is not None:
            loaders = {name: wrap_loader(name, load) for name, load in loaders.items()}
        provides, state_type = self._rank.state()
        self._runner = StageRunner(plan.stages, loaders, provides=provides, state_type=state_type,
                                   policy=plan.policy, events=self._relay, strict=strict, preserve_rng=preserve_rng)
        self._hooks = self._rank.hooks(plan.stages)

    # -- construction --------------------------------------------------------------------------
    @staticmethod
    def plan(config: CascadeConfig | str | Path, *, policy: Policy | str = "auto",
             device: str | torch.device | None = None, replace: Mapping[str, CascadeStage] | None = None,
             until: str | None = None, parallel: Any = None, memory_budget: int | str | None = None,
             input_kind: str | None = None) -> RunPlan:
        """The memory plan and the resolved policy; reads only ``pipeline.json`` and safetensors headers.

        ``replace`` swaps stages by name, ``until`` ends the cascade after the named stage. Raises
        ``NotEnoughMemoryError`` when one stage's weights alone exceed the memory available.
        The samplers' ``guidance_interval`` and ``sigma_min`` come from ``pipeline.json`` unless the config
        sets them (``resolve_samplers``). Each stage is fitted to the memory it may use (NAF's ``auto``
        mode; ``StageBudget``): ``memory_budget`` (bytes, a size such as ``"8G"``, or ``"auto"``: the memory
        available now less 15 %) bounds every stage's work to it — tiles for the decode, smaller chunks for
        the flow stages — and a config that cannot fit raises ``MemoryBudgetError`` naming the stage.
        ``parallel``: this process's rank (``pipelines.ranks``), or ``ParallelSettings`` / a runtime from
        ``init_parallel`` under torchrun; checked here against torchrun's environment and the config
        (``ParallelConfigError``). Ranks != 0 plan only their part: the flow stages, on shards of the flow models.
        ``input_kind``: the kind of input the runs take (``pipelines.inputs``; default: the one the config takes).
        """
        # 1. the arguments, the budget parsed once; config, device and this rank's part of the job
        budget = arguments.check_plan_arguments(config, policy=policy, device=device, replace=replace, until=until,
                                                memory_budget=memory_budget)
        config = load_config(config) if isinstance(config, (str, Path)) else config
        kind = inputs.kind_named(config, input_kind)
        device = check_device(torch.device(device)) if device is not None else default_device()
        role = rank_of(parallel, device)
        device = role.place(device)
        # 2. this rank's part of the job planned on this machine: samplers, stages, sizes, budget, policy
        return plan_run(config, kind, device, role, detect_machine(device), budget, policy=policy, replace=replace,
                        until=until)

    @classmethod
    def from_plan(cls, plan: RunPlan, *, strict: bool = False, preserve_rng: bool = True,
                  wrap_loader: Callable[[str, Loader], Loader] | None = None) -> Pixal3D:
        """Fetch (unless offline) and verify the weights ``plan`` needs, and build the pipeline on it. Under
        torchrun the job is joined first, so that a failure on any rank from here on stops every rank.

        strict:       a model asked for outside its stage's needs raises
        preserve_rng: False only for the control test that shows why loads must not move the generators
        wrap_loader:  ``(name, loader) -> loader``, e.g. a benchmark measuring memory around each load
        """
        rank = plan.role.join()
        try:
            return cls(plan, plan.resolved_weights(), strict=strict, preserve_rng=preserve_rng, wrap_loader=wrap_loader,
                       rank=rank)
        except BaseException as err:
            rank.fail_and_close(err)  # joined here: the other ranks stop too
            raise

    @classmethod
    def from_config(cls, config: CascadeConfig | str | Path, *, policy: Policy | str = "auto",
                    device: str | torch.device | None = None, replace: Mapping[str, CascadeStage] | None = None,
                    until: str | None = None, parallel: Any = None, memory_budget: int | str | None = None,
                    input_kind: str | None = None, **options: Any) -> Pixal3D:
        """``from_plan(plan(config, ...), **options)``: a config file or object, the policy (``auto``
        chooses), the device (default: CUDA, else MPS, else CPU), stages replaced by name, a last stage,
        this process's rank under torchrun (default: one process), the kind of input."""
        plan = cls.plan(config, policy=policy, device=device, replace=replace, until=until, parallel=parallel,
                        memory_budget=memory_budget, input_kind=input_kind)
        return cls.from_plan(plan, **options)

    # -- what it is --------------------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        """The resolved memory policy."""
        return self.run_plan.policy

    @property
    def stages(self) -> tuple[CascadeStage, ...]:
        """The stages in run order."""
        return self._runner.stages

    @property
    def runner(self) -> StageRunner:
        """The staging runner (its ``registry`` shows what is loaded)."""
        return self._runner

    @property
    def job_stopped(self) -> str | None:
        """Why this parallel job can run no more images (an error after its followers joined an image), or
        None while it can, and without a job. An image that failed before its first flow stage leaves it None."""
        return self._rank.stopped

    @property
    def parallel(self) -> Any:
        """The parallel job's runtime under torchrun (None: one process, or a data group)."""
        return self._rank.runtime

    @property
    def is_follower(self) -> bool:
        """True on ranks != 0 of a parallel job: call ``follow()`` there, ``run`` on rank 0."""
        return self.run_plan.follower

    # -- running -----------------------------------------------------------------------------
    def run(self, image: Any = None, *, views: Any = None, mesh: Any = None, mesh_pose: str | None = None,
            num_views: int | None = None, seed: int | None = None, fov: float | None = None,
            events: Callable[[Event], None] | None = None, progress: bool = False,
            callback: Callable[[dict[str, Any]], None] | None = None, trace: str | Path | None = None,
            trace_meta: Mapping[str, Any] | None = None, name: str | None = None) -> Result:
        """Take one image (or, on a multi-view config, one views folder) through every stage and return the
        ``Result`` (nothing is written to disk): a batch of one (``run_batch``), whose errors are raised.

        image:     a path, a PIL image or a uint8 array (RGBA: the alpha marks the object)
        views:     the multi-view cascade's input instead (a config with ``views``): a folder with a ``transforms.json``
                   (``pixal3d.models.views``) or a ``ViewSet`` from ``read_views``; ``num_views``: its first N (all)
        mesh:      a mesh to texture from the image (``pipelines.inputs.mesh``), ``mesh_pose`` aligned or estimate
        seed:      the run's seed (default: the config's); the run owns a CPU generator seeded with it
        fov:       horizontal field of view in degrees (default: the config's, else MoGe-2, else 49.1); not with views
        events:    also receives this run's registry events (loads, releases, stage changes); progress: tqdm bars
        callback:  ``{"kind": "stage", "stage", "index", "stages", "image", "image_index", "images"}`` as each stage
                   starts, ``{"kind": "step", "stage", "step", "steps", ...}`` after each sampler step
        trace:     also write the memory trace (JSONL) there, its start record extended by ``trace_meta``; name: what
                   run.json calls the input (default: the path, or "<image>")
        """
        kind, source, opens = self._input({"image": image, "views": views, "mesh": mesh},
                                          {"fov": fov, "num_views": num_views, "mesh_pose": mesh_pose})
        kind.check(source, kind.argument)
        arguments.check_optional(name, "name", (str,), "a string")
        arguments.check_run_arguments(events=events, progress=progress, callback=callback, trace=trace)
        items = image_items([source], seed=seed, fov=fov, default_seed=self.config.seed,
                            labels=[name] if name else [kind.label(source)], names=[kind.default_name(source, 0)])
        [item] = self._execute(items, "image", opens=opens, events=events, progress=progress,
                               callback=callback, trace=trace, trace_meta=trace_meta)
        return item.result

    def run_batch(self, images: Sequence[Any] | None = None, *, views: Sequence[Any] | None = None, mesh: Any = None,
                  mesh_pose: str | None = None, num_views: int | None = None, seed: int | Sequence[int] | None = None,
                  fov: float | Sequence[float | None] | None = None, names: Sequence[str] | None = None,
                  order: BatchOrder | None = None, work_dir: str | Path | None = None, state_budget: int | None = None,
                  events: Callable[[Event], None] | None = None, progress: bool = False,
                  callback: Callable[[dict[str, Any]], None] | None = None, trace: str | Path | None = None,
                  trace_meta: Mapping[str, Any] | None = None) -> Iterator[BatchItem]:
        """Run several images, stage by stage or image by image (``pipelines.batch``), optionally resuming from a
        work directory; yields one ``BatchItem`` per image (its ``Result``, or the error that stopped it) as it
        finishes. ``seed`` and ``fov``: one, or one per image; ``names``: what outputs and records call each image
        (default: the file's stem, else image<i>; a views folder's name); ``views``/``num_views``: views folders
        instead of images, on a multi-view config (as ``run``); ``mesh``/``mesh_pose``: one mesh textured from each
        image (as ``run``); ``order``: default ``default_order(policy)``; ``state_budget``: bytes of states kept in
        memory between stages (default ``RunPlan.state_budget()``; 0: all on disk); the rest as for ``run``
        (``trace``: one file in stage order, ``<stem>.<name><suffix>`` per image in image order). A data group's rank
        (``pipelines.launch``) runs only the images its group claims (in ``work_dir``) or is given (i mod K)."""
        kind, sources, opens = self._input({"image": images, "views": views, "mesh": mesh},
                                           {"fov": fov, "num_views": num_views, "mesh_pose": mesh_pose})
        kind.check_batch(sources, kind.batch_argument)
        arguments.check_names(names)
        arguments.check_optional(work_dir, "work_dir", (str, Path), "a path")
        arguments.check_state_budget(state_budget)
        arguments.check_run_arguments(events=events, progress=progress, callback=callback, trace=trace)
        order = arguments.check_order(order or default_order(self.policy))
        self._rank.check_batch(order, work_dir)
        names = names if names is not None else [kind.default_name(s, i) for i, s in enumerate(sources)]
        items = image_items(sources, seed=seed, fov=fov, default_seed=self.config.seed, names=names,
                            labels=[kind.label(s) for s in sources])
        return self._execute(items, order, opens=opens, work_dir=work_dir, state_budget=state_budget,
                             events=events, progress=progress, callback=callback, trace=trace, trace_meta=trace_meta,
                             isolate=True)

    def _input(self, given: Mapping[str, Any], options: Mapping[str, Any]) -> tuple[InputKind, Any, dict[str, Any]]:
        """The kind of input given (``pipelines.inputs``: the one this pipeline was planned for), its value, and what
        its ``open`` takes (``inputs.open_options``: the views to use, a mesh read once for every input)."""
        kind = inputs.library_kind(self.config, arguments=given, options=options, planned=self.run_plan.kind)
        return kind, given.get(kind.argument), inputs.open_options(kind, given, options)

    def _execute(self, items: list[BatchItem], order: BatchOrder, *, opens: Mapping[str, Any],
                 work_dir: str | Path | None = None, state_budget: int | None = None,
                 events: Callable[[Event], None] | None, progress: bool,
                 callback: Callable[[dict[str, Any]], None] | None, trace: str | Path | None,
                 trace_meta: Mapping[str, Any] | None, isolate: bool = False) -> Iterator[BatchItem]:
        """``items`` through the executor in ``order``; what ``run`` and ``run_batch`` share."""
        if self.is_follower:
            raise RuntimeError(f"rank {self.run_plan.rank} follows rank 0 in this parallel job: call follow() here "
                               f"and run images on rank 0")
        stages, kind = self.stages, self.run_plan.kind
        bar = Progress([s.name for s in stages], progress=progress, callback=callback)
        meter = Meter(self._relay, lambda: self._runner.registry, device=self.device, trace=trace,
                      several=len(items) > 1, events=events, meta={"policy": self.policy.value, **(trace_meta or {})})
        work = WorkDir(work_dir) if work_dir is not None else None
        store = StateStore(stages, self.device, work=work,
                           budget=self.run_plan.state_budget() if state_budget is None else state_budget,
                           kinds=state_codec.declared_kinds(RunState))
        keyed = work_dir is not None or (order == "stage" and len(items) > 1)  # records, or states spilled
        digests = weights_digests(self.weights) if keyed else {}

        def open_item(item: BatchItem) -> None:
            """Refuse an unusable input before its first stage (its kind's check, then the stages'); key its stages."""
            try:
                item.source = kind.open(item.source, opens)
                self.run_plan.check_input(kind.checked(item.source))  # e.g. no alpha and no remover
                digest = kind.digest(item.source) if keyed else None
            except OSError as err:
                raise ImageError(f"{item.label} cannot be read ({err.strerror or err})") from None
            if keyed:  # what decides each stage's outputs
                item.keys = item_keys(stages, kind, digest, item, device=self.device, weights=self.weights,
                                      digests=digests, fields=inputs.INPUT_FIELDS)

        def start(item: BatchItem, k: int) -> RunState:
            reads_input = any(f in s.inputs for s in stages[k:] for f in kind.provides)
            return self.new_state(kind.state(item.source, reads_input=reads_input), seed=item.seed, fov=item.fov,
                                  progress=progress, callback=bar.callback_for(item))

        def alone(item: BatchItem, err: BaseException) -> bool:
            return image_alone(err, self.job_stopped)

        executor = Executor(self._runner, start, store=store, open=open_item, isolate=alone if isolate else None,
                            hooks=[bar, meter, *self._hooks],
                            finish=lambda item: self._result(item, meter.meter_for(item)))
        return self._rank.drive(executor, items, order, work)

    # -- what runs and batches share -------------------------------------------------------------
    def new_state(self, given: Mapping[str, Any], *, seed: int, fov: float | None = None, progress: bool = False,
                  callback: Callable[[dict[str, Any]], None] | None = None) -> RunState:
        """A fresh ``RunState``: the input's fields (``given``: its kind's ``state``, e.g. ``input_image``, a PIL image
        or None when no stage still to run reads it), a CPU generator seeded with ``seed``, the provided fields."""
        fields = {name: None for name in inputs.INPUT_FIELDS} | dict(given)
        weights = self.weights
        return RunState(**fields, generator=torch.Generator().manual_seed(seed), device=self.device, fov_deg=fov,
                        shape_normalization=weights.shape_normalization, tex_normalization=weights.tex_normalization,
                        progress=progress, callback=callback, parallel=self._rank.runtime)

    def _result(self, item: BatchItem, meter: MemoryMeter | None) -> Result:
        """The ``Result`` of one image (``result.item_result``), with every rank's report of it."""
        rows = meter.report() if meter is not None else []
        return item_result(item, self.run_plan, rows, parallel=self._rank.report(item, rows))

    def follow(self) -> int:
        """On ranks != 0 of a parallel job: join rank 0's flow stages, image after image, until rank 0
        closes its pipeline; returns the number of images. Any failure, here or on another rank, raises
        on every rank (``PeerFailedError`` naming the rank that failed)."""
        return self._rank.follow(self._runner, self._relay)

    def close(self) -> None:
        """Release every loaded model (a later ``run`` loads them again). In a parallel job, rank 0 tells the
        followers the job is over (their ``follow()`` returns), and the job's process groups are torn down
        when this pipeline made them; no run is possible after that."""
        self._rank.close(release=self._release)

    def _release(self) -> None:
        try:
            self._runner.close()
        finally:
            if self._stream is not None:
                self._stream.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None:  # the other ranks of a job stop too, rather than wait
            self._rank.abort(exc)
        self.close()
