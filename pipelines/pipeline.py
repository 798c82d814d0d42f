"""Pixal3D: the library entry point — one image in, a textured mesh out, in memory.

    pipe = Pixal3D.from_config("configs/1024_cascade.yaml")   # plan, policy, weights; no model loads yet
    result = pipe.run("input.png", seed=42)                   # or a PIL image, or a uint8 array
    result.save("out.glb")

``Pixal3D.plan(config)`` decides before any weight is read what each stage needs (weights from the
safetensors headers, working sets from the stages' own estimates) and which memory policy to run;
``from_plan`` then fetches the weights and builds the pipeline on the same stage objects (the command
prints the plan in between, and ``--plan`` stops there). Models load when their stage first asks for
them; the policy decides where they live between stages and between runs. ``close()`` releases them.

Every run goes through one executor (``pixal3d.staging.executor``): ``run`` is a batch of one, ``run_batch``
takes several images stage by stage (each model loaded once per batch) or image by image and can resume from
a work directory (``batch.py``, ``work_dir.py``). Under torchrun, ``parallel=ParallelSettings(...)`` (or a
runtime from ``init_parallel``) spreads the flow stages over the job's ranks (``parallel.py``): rank 0 runs
images, every other rank calls ``follow()``. With ``ParallelSettings(mode="data")`` every rank is a pipeline of
its own and ``run_batch(share=DataJob)`` runs only this rank's share of the images (``data_parallel.py``).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import torch
from torch import nn

import pixal3d
from pixal3d.config import CascadeConfig, load_config
from pixal3d.devices import kind
from pixal3d.memory_budget import parse_budget
from pixal3d.models.preprocess import ImageError, as_image, probe_image
from pixal3d.models.views import ViewSet, read_views, view_name
from pixal3d.nn.attention import describe_route, resolve_route
from pixal3d.parallel import ParallelRuntime, ParallelSettings
from pixal3d.pipeline_json import (
    PIPELINE_MODELS,
    ResolvedWeights,
    planned_pipeline_json,
    planned_sizes,
    resolve_samplers,
    resolve_weights,
)
from pixal3d.staging import Event, Policy, StageRunner, WeightStream, check_stages, detect_machine, measure_copy_bandwidth
from pixal3d.staging.executor import Executor
from pixal3d.staging.mps_memory import apply_mps_memory_limit, check_mps_memory_limit
from pixal3d.staging.policy import gib, usable
from pixal3d.telemetry import MemoryMeter

from . import arguments, state_codec
from .batch import IMAGE_KINDS, BatchItem, BatchOrder, Meter, Progress, Relay, default_order, image_items
from .build import build_stages
from .data_parallel import DataJob
from .errors import classify
from .loaders import model_loaders, with_attention_route
from .parallel import (FollowerState, Leader, Skipping, check_blocks, describe_parallel, flow_stages, follow,
                       machine_share, plan_splits, rank_plan, shard_loaders)
from .plan import (RunPlan, check_device, check_memory, default_device, describe_fit, describe_stream, fit_policy,
                   smallest_budget, stream_layouts, stream_pinned, with_attention_route_of, with_sampler_of)
from .preprocess import rembg_loader
from .result import Result
from .stage import CascadeStage
from .state import PROVIDED, RunState
from .work_dir import StateStore, WorkDir, input_digest, stage_keys, weights_digests

logger = logging.getLogger(__name__)

Loader = Callable[[], nn.Module]


class Pixal3D:
    """The cascade ready to run: stages, resolved weights, a policy and a model registry."""

    def __init__(self, plan: RunPlan, weights: ResolvedWeights, *, strict: bool = False, preserve_rng: bool = True,
                 wrap_loader: Callable[[str, Loader], Loader] | None = None, runtime: ParallelRuntime | None = None,
                 owns_runtime: bool = False):
        self.run_plan = plan
        self.config = plan.config
        self.device = plan.device
        self.weights = weights
        self._relay = Relay()  # the registry's events go to the running span's listeners
        self._runtime, self._owns_runtime = runtime, owns_runtime
        if plan.parallel is not None and not plan.parallel.independent and runtime is None:
            raise ValueError("a parallel plan needs the job's runtime: build the pipeline with Pixal3D.from_plan")
        if plan.mps_limit is not None:
            apply_mps_memory_limit(plan.mps_limit)
        remover = rembg_loader(self.config.weights.rembg) if self.config.weights.rembg is not None else None
        copied = self.config.runtime.cpu_weights == "copied"
        self._stream = WeightStream(plan.device, copy=copied) if plan.policy is Policy.stream else None
        loaders = model_loaders(weights, plan.device, moge="moge" in plan.model_names(), remover=remover,
                                stream=self._stream, streamed=tuple(plan.memory.streamed), pin=plan.stream_pinned,
                                copied=copied)
        if runtime is not None:  # flow models load as this rank's shards
            loaders = shard_loaders(loaders, weights, [s.flow_model for s in flow_stages(plan.stages)], runtime,
                                    split=plan.parallel.split)
        loaders = with_attention_route(loaders, self.config.runtime.attention)
        if wrap_loader is not None:
            loaders = {name: wrap_loader(name, load) for name, load in loaders.items()}
        provides, state_type = plan.parallel.state() if runtime is not None else (PROVIDED, RunState)
        self._runner = StageRunner(plan.stages, loaders, provides=provides, state_type=state_type,
                                   policy=plan.policy, events=self._relay, strict=strict, preserve_rng=preserve_rng)
        self._leader = (Leader(runtime, plan.stages, plan.parallel.splits) if runtime is not None and not plan.follower
                        else None)

    # -- construction --------------------------------------------------------------------------
    @staticmethod
    def plan(config: CascadeConfig | str | Path, *, policy: Policy | str = "auto",
             device: str | torch.device | None = None, replace: Mapping[str, CascadeStage] | None = None,
             until: str | None = None, parallel: ParallelSettings | ParallelRuntime | None = None,
             memory_budget: int | str | None = None) -> RunPlan:
        """The memory plan and the resolved policy; reads only ``pipeline.json`` and safetensors headers.

        ``replace`` swaps stages by name, ``until`` ends the cascade after the named stage. Raises
        ``NotEnoughMemoryError`` when one stage's weights alone exceed the memory available.
        The samplers' ``guidance_interval`` and ``sigma_min`` come from ``pipeline.json`` unless the config
        sets them (``resolve_samplers``). Each stage is fitted to the memory it may use (NAF's ``auto``
        mode; ``StageBudget``): ``memory_budget`` (bytes, a size such as ``"8G"``, or ``"auto"``: the memory
        available now less 15 %) bounds every stage's work to it — tiles for the decode, smaller chunks for
        the flow stages — and a config that cannot fit raises ``MemoryBudgetError`` naming the stage.
        ``parallel``: ``ParallelSettings`` (or a runtime from ``init_parallel``) under torchrun; checked here
        against torchrun's environment and the config (``ParallelConfigError``). Ranks != 0 plan only their
        part: the flow stages, on shards of the flow models (the plan counts each rank's shard).
        """
        # 1. config and device; this rank's part of a parallel job (its device: cuda:<local rank>)
        arguments.check_plan_arguments(config, policy=policy, device=device, replace=replace, until=until,
                                       memory_budget=memory_budget)
        config = load_config(config) if isinstance(config, (str, Path)) else config
        device = check_device(torch.device(device)) if device is not None else default_device()
        rank = rank_plan(parallel, device)
        device = rank.device if rank is not None else device
        # 2. the samplers' settings the config leaves to pipeline.json
        pipeline = planned_pipeline_json(config.weights)
        if pipeline is None:  # not on disk, not reachable: one error naming it and every other missing file
            planned_sizes(config.weights, models=(*PIPELINE_MODELS, "dinov3", "naf"), config_file=config.source or None)
        config = resolve_samplers(config, pipeline)
        # 3. stages, this rank's part of them, their declarations checked before anything is read
        stages = tuple(with_sampler_of(s, config) for s in build_stages(config, replace=replace, until=until))
        stages = rank.stages(stages) if rank is not None else stages
        provides, state_type = rank.state() if rank is not None else (PROVIDED, RunState)
        check_stages(stages, provides=provides, state_type=state_type, storable=state_codec.storable(state_type))
        # 4. the machine (ranks on one machine share it); weight sizes from safetensors headers, the other models
        #    first: pp_split auto gathers every rank's memory for flow blocks (usable, less the other models its
        #    largest flow stage holds), then a pipeline rank counts its shard of each flow model
        machine, shared = detect_machine(device), None
        needs = {s.name: tuple(s.needs) for s in stages}
        models = list(dict.fromkeys(m for ms in needs.values() for m in ms))  # cascade order: errors name the first
        flows = {s.flow_model for s in flow_stages(stages)} if rank is not None else set()
        sizes, notes = planned_sizes(config.weights, models=[m for m in models if m not in flows],
                                     config_file=config.source or None)
        split_notes: list[str] = []
        if rank is not None:
            machine, shared = machine_share(machine, rank.topology)
            beside = max((sum(sizes.get(m, 0) for m in s.needs if m not in flows) for s in flow_stages(stages)),
                         default=0)
            rank = rank.with_memory(max(0, usable(machine.device_available) - beside))
            flow_sizes, flow_notes = planned_sizes(config.weights, models=[m for m in models if m in flows],
                                                   select=rank.shards(stages), config_file=config.source or None)
            sizes, notes = {**sizes, **flow_sizes}, [*notes, *flow_notes]
            rank, split_notes = plan_splits(rank, stages, lambda select: planned_sizes(
                config.weights, models=list(select), select=select)[0])
        # 5. the budget; the blocks of the models that can stream, from their headers, where the policy may stream
        budget = None if memory_budget is None else (
            usable(machine.device_available) if memory_budget == "auto" else parse_budget(memory_budget))
        layouts = stream_layouts(config, models, policy) if rank is None else {}
        # 6. every stage fitted to the budget (or to the machine's usable memory) and to the attention route, and the
        #    policy chosen within it: whole models, or their blocks streamed when whole models do not fit
        routed = with_attention_route_of(stages, resolve_route(config.runtime.attention, device))
        fit = fit_policy(policy, routed, sizes, budget, machine, layouts)
        stages, memory, chosen, reasons = fit.stages, fit.memory, fit.policy, fit.reasons
        # 7. refused when one stage's weights alone do not fit; what the budget and the stream cost, in words
        check_memory(memory, machine.device_available, str(device))
        reasons += [shared] if shared else []
        reasons += describe_fit(stages, budget, machine)
        if budget is not None:
            smallest, setter = smallest_budget(routed, sizes, machine, memory.streamed or None)
            reasons.append(f"the smallest memory budget this cascade plans within ({chosen.value}): "
                           f"{gib(smallest)}, set by stage {setter!r}")
        pinned = False
        if chosen is Policy.stream:
            reasons += describe_stream(memory, stages, measure_copy_bandwidth(device))
            pinned = stream_pinned(memory, machine)
        reasons.append(describe_route(config.runtime.attention, device))
        # 8. on MPS, an allocator limit that fails instead of swapping, refused or lowered before any load
        mps_limit = None
        if kind(device).memory_limit:
            mps_limit = check_mps_memory_limit()
            reasons.append(mps_limit.describe())
            if mps_limit.lets_swap:  # PyTorch's default: the run lowers it (from_plan), as said here
                reasons.append(f"the run lowers the MPS limit to {mps_limit.safe_ratios()[0]:g} x Metal's "
                               f"recommended working set, so that outgrowing memory fails instead of swapping")
        return RunPlan(config, stages, device, memory, machine, chosen, tuple(reasons),
                       (*notes, *([describe_parallel(rank.settings, rank.topology)] if rank else []), *split_notes),
                       mps_limit, rank, budget, pinned)

    @classmethod
    def from_plan(cls, plan: RunPlan, *, strict: bool = False, preserve_rng: bool = True,
                  wrap_loader: Callable[[str, Loader], Loader] | None = None) -> Pixal3D:
        """Fetch (unless offline) and verify the weights ``plan`` needs, and build the pipeline on it. Under
        torchrun the job is joined first, so that a failure on any rank from here on stops every rank.

        strict:       a model asked for outside its stage's needs raises
        preserve_rng: False only for the control test that shows why loads must not move the generators
        wrap_loader:  ``(name, loader) -> loader``, e.g. a benchmark measuring memory around each load
        """
        runtime, owned = plan.parallel.join() if plan.parallel is not None else (None, False)
        try:
            return cls(plan, cls._weights(plan), strict=strict, preserve_rng=preserve_rng, wrap_loader=wrap_loader,
                       runtime=runtime, owns_runtime=owned)
        except BaseException as err:
            if owned:  # joined here: the other ranks stop too
                runtime.fail(err)
                runtime.close()
            raise

    @staticmethod
    def _weights(plan: RunPlan) -> ResolvedWeights:
        names = plan.model_names()
        weights = resolve_weights(plan.config.weights, models=names, need_moge="moge" in names,
                                  config_file=plan.config.source or None)
        if plan.parallel is not None:  # every pipeline rank needs a block of every flow: N <= blocks
            check_blocks(plan.parallel.settings, weights, [s.flow_model for s in flow_stages(plan.stages)])
        return weights

    @classmethod
    def from_config(cls, config: CascadeConfig | str | Path, *, policy: Policy | str = "auto",
                    device: str | torch.device | None = None, replace: Mapping[str, CascadeStage] | None = None,
                    until: str | None = None, parallel: ParallelSettings | ParallelRuntime | None = None,
                    memory_budget: int | str | None = None,
                    **options: Any) -> Pixal3D:
        """``from_plan(plan(config, ...), **options)``: a config file or object, the policy (``auto``
        chooses), the device (default: CUDA, else MPS, else CPU), stages replaced by name, a last stage,
        the parallel settings under torchrun (default: none, one process)."""
        plan = cls.plan(config, policy=policy, device=device, replace=replace, until=until, parallel=parallel,
                        memory_budget=memory_budget)
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
        return self._leader.stopped if self._leader is not None else None

    @property
    def parallel(self) -> ParallelRuntime | None:
        """The parallel job's runtime under torchrun (None: one process)."""
        return self._runtime

    @property
    def is_follower(self) -> bool:
        """True on ranks != 0 of a parallel job: call ``follow()`` there, ``run`` on rank 0."""
        return self.run_plan.follower

    # -- running -----------------------------------------------------------------------------
    def run(self, image: Any = None, *, views: Any = None, num_views: int | None = None, seed: int | None = None,
            fov: float | None = None, events: Callable[[Event], None] | None = None, progress: bool = False,
            callback: Callable[[dict[str, Any]], None] | None = None, trace: str | Path | None = None,
            trace_meta: Mapping[str, Any] | None = None, name: str | None = None) -> Result:
        """Take one image (or, on a multi-view config, one views folder) through every stage and return the
        ``Result`` (nothing is written to disk): a batch of one (``run_batch``), whose errors are raised.

        image:     a path, a PIL image or a uint8 array (RGBA: the alpha marks the object)
        views:     the multi-view cascade's input instead (a config with ``views``): a folder with a
                   ``transforms.json`` (``pixal3d.models.views``) or a ``ViewSet`` from ``read_views``
        num_views: use the first N views of the folder (default: all)
        seed:      the run's seed (default: the config's); the run owns a CPU generator seeded with it
        fov:       horizontal field of view in degrees (default: the config's, else MoGe-2, else 49.1); not with views
        events:    also receives this run's registry events (loads, releases, stage changes)
        progress:  tqdm bars for stages, sampler steps and export steps
        callback:  ``{"kind": "stage", "stage", "index", "stages", "image", "image_index", "images"}`` as each
                   stage starts and ``{"kind": "step", "stage", "step", "steps", ...}`` after each sampler step
        trace:     also write the memory trace (JSONL) there, its start record extended by ``trace_meta``
        name:      what run.json calls the input (default: the path, or "<image>")
        """
        arguments.check_input_kind(self.config, image=image, views=views, num_views=num_views, fov=fov)
        if views is not None:
            arguments.check_views(views)
        else:
            arguments.check_image(image)
        arguments.check_optional(name, "name", (str,), "a string")
        arguments.check_run_arguments(events=events, progress=progress, callback=callback, trace=trace)
        source = views if views is not None else image
        items = image_items([source], seed=seed, fov=fov, default_seed=self.config.seed,
                            labels=[name] if name else None, names=[view_name(source)] if views is not None else None)
        [item] = self._execute(items, "image", num_views=num_views, events=events, progress=progress,
                               callback=callback, trace=trace, trace_meta=trace_meta)
        return item.result

    def run_batch(self, images: Sequence[Any] | None = None, *, views: Sequence[Any] | None = None,
                  num_views: int | None = None, seed: int | Sequence[int] | None = None,
                  fov: float | Sequence[float | None] | None = None, names: Sequence[str] | None = None,
                  order: BatchOrder | None = None,
                  work_dir: str | Path | None = None, state_budget: int | None = None,
                  events: Callable[[Event], None] | None = None, progress: bool = False,
                  callback: Callable[[dict[str, Any]], None] | None = None, trace: str | Path | None = None,
                  trace_meta: Mapping[str, Any] | None = None, share: DataJob | None = None) -> Iterator[BatchItem]:
        """Run several images, stage by stage or image by image (``pipelines.batch``), optionally resuming from a
        work directory; yields one ``BatchItem`` per image (its ``Result``, or the error that stopped it) as it
        finishes. ``seed`` and ``fov``: one, or one per image; ``names``: what outputs and records call each image
        (default: the file's stem, else image<i>; a views folder's name); ``views``/``num_views``: views folders
        instead of images, on a multi-view config (as ``run``); ``order``: default ``default_order(policy)``;
        ``state_budget``: bytes of states kept in memory between stages (default ``RunPlan.state_budget()``; 0: all on
        disk); the rest as for ``run`` (``trace``: one file in stage order, ``<stem>.<name><suffix>`` per image in
        image order).
        ``share``: this rank's part of a ``--parallel data`` job (``data_parallel.DataJob``): only the images this
        group claims (in ``work_dir``) or is given (i mod K) run here and are yielded."""
        arguments.check_input_kind(self.config, image=images, views=views, num_views=num_views, fov=fov)
        if views is not None:
            arguments.check_sequence(views, "views")
            for index, folder in enumerate(views):
                arguments.check_views(folder, f"views[{index}]")
        else:
            arguments.check_images(images)
        arguments.check_names(names)
        arguments.check_optional(work_dir, "work_dir", (str, Path), "a path")
        arguments.check_state_budget(state_budget)
        arguments.check_run_arguments(events=events, progress=progress, callback=callback, trace=trace)
        order = order or default_order(self.policy)
        if order not in ("image", "stage"):
            raise ValueError(f"batch order {order!r} is neither 'image' nor 'stage'")
        if self._runtime is not None and order == "stage":
            raise ValueError("under torchrun the other ranks follow rank 0 image by image: a parallel batch runs in "
                             "image order")
        if self._runtime is not None and work_dir is not None and share is None:
            raise ValueError("under torchrun a work directory is for data groups (the groups claim images in it): "
                             "pass share=DataJob, or run without work_dir")
        sources = list(views) if views is not None else images
        if views is not None and names is None:
            names = [view_name(folder) for folder in sources]
        items = image_items(sources, seed=seed, fov=fov, default_seed=self.config.seed, names=names)
        return self._execute(items, order, num_views=num_views, work_dir=work_dir, state_budget=state_budget,
                             events=events, progress=progress, callback=callback, trace=trace, trace_meta=trace_meta,
                             isolate=True, share=share)

    def _execute(self, items: list[BatchItem], order: BatchOrder, *, num_views: int | None = None,
                 work_dir: str | Path | None = None,
                 state_budget: int | None = None, events: Callable[[Event], None] | None, progress: bool,
                 callback: Callable[[dict[str, Any]], None] | None, trace: str | Path | None,
                 trace_meta: Mapping[str, Any] | None, isolate: bool = False, share: DataJob | None = None
                 ) -> Iterator[BatchItem]:
        """``items`` through the executor in ``order``; what ``run`` and ``run_batch`` share."""
        if self.is_follower:
            raise RuntimeError(f"rank {self.run_plan.rank} follows rank 0 in this parallel job: call follow() here "
                               f"and run images on rank 0")
        stages = self.stages
        bar = Progress([s.name for s in stages], progress=progress, callback=callback)
        meter = Meter(self._relay, lambda: self._runner.registry, device=self.device, trace=trace,
                      several=len(items) > 1, events=events, meta={"policy": self.policy.value, **(trace_meta or {})})
        work = WorkDir(work_dir) if work_dir is not None else None
        store = StateStore(stages, self.device, work=work,
                           budget=self.run_plan.state_budget() if state_budget is None else state_budget,
                           kinds=state_codec.declared_kinds(RunState))
        keyed = work_dir is not None or (order == "stage" and len(items) > 1)  # records, or states spilled
        digests = weights_digests(self.weights) if keyed else {}

        views = self.config.views is not None

        def open_item(item: BatchItem) -> None:
            """Refuse an unusable input before its first stage; key its stages (for the store)."""
            try:
                if views:  # a views folder: transforms.json and every frame checked, once (read_views)
                    if not isinstance(item.source, ViewSet) or num_views is not None:
                        item.source = read_views(getattr(item.source, "folder", item.source), num_views)
                elif isinstance(item.source, (str, Path)):
                    probe_image(item.source)  # not an image, or too small: from its header
                self.run_plan.check_input(item.source)  # e.g. no alpha and no remover
                digest = (item.source.digest() if views else input_digest(item.source)) if keyed else None
                provided = {"input_image": None if views else digest, "input_views": digest if views else None,
                            "generator": item.seed, "fov_deg": item.fov, "device": str(self.device),
                            "shape_normalization": repr(self.weights.shape_normalization),
                            "tex_normalization": repr(self.weights.tex_normalization)}
            except OSError as err:
                raise ImageError(f"{item.label} cannot be read ({err.strerror or err})") from None
            if keyed:  # what decides each stage's outputs
                item.keys = stage_keys(stages, provided, digests, {"torch": torch.__version__,
                                                                    "pixal3d": pixal3d.__version__})

        def start(item: BatchItem, k: int) -> RunState:
            if views:
                return self.new_state(None, views=item.source, seed=item.seed, progress=progress,
                                      callback=bar.callback_for(item))
            reads_input = any("input_image" in s.inputs for s in stages[k:])
            return self.new_state(as_image(item.source) if reads_input else None, seed=item.seed, fov=item.fov,
                                  progress=progress, callback=bar.callback_for(item))

        def alone(item: BatchItem, err: BaseException) -> bool:
            """Whether ``err`` is this image's alone (``IMAGE_KINDS``, and no parallel job stopped by it)."""
            failure = classify(err, started=True)
            return failure is not None and failure.kind in IMAGE_KINDS and self.job_stopped is None

        executor = Executor(self._runner, start, store=store, open=open_item, isolate=alone if isolate else None,
                            hooks=[bar, meter, *([self._leader] if self._leader is not None else [])],
                            finish=lambda item: self._result(item, meter.meter_for(item)))
        if share is not None:  # a data group: the images it claims or is given
            return share.feed(items, executor, order, work)
        return executor.drive(items, order)

    # -- what runs and batches share -------------------------------------------------------------
    def new_state(self, image: Any, *, views: ViewSet | None = None, seed: int, fov: float | None = None,
                  progress: bool = False, callback: Callable[[dict[str, Any]], None] | None = None) -> RunState:
        """A fresh ``RunState`` for ``image`` (a PIL image, or None when the preprocess stage will not run) or
        ``views`` (the multi-view cascade's checked folder): the provided fields, a CPU generator seeded with
        ``seed``."""
        return RunState(
            input_image=image, input_views=views, generator=torch.Generator().manual_seed(seed), device=self.device,
            fov_deg=fov,
            shape_normalization=self.weights.shape_normalization, tex_normalization=self.weights.tex_normalization,
            progress=progress, callback=callback, parallel=self._runtime)

    def _result(self, item: BatchItem, meter: MemoryMeter | None) -> Result:
        """The ``Result`` of one image: its state, its stage records (peaks filled in from ``meter``'s windows of
        the same stage names when the record has none) and the meter's rows."""
        rows = meter.report() if meter is not None else []
        peaks = {row.stage: row for row in rows}
        for record in item.records:
            if record.stage in peaks and record.peak_process_bytes is None:
                record.peak_process_bytes = peaks[record.stage].peak_process
                record.peak_device_bytes = peaks[record.stage].peak_device
        parallel = self._leader.gather(item, rows) if self._leader is not None else None  # every rank's peaks
        return Result(input=item.label, seed=item.seed, config=self.config, device=self.device, policy=self.policy,
                      policy_reasons=self.run_plan.reasons, state=item.state, stages=item.records,
                      memory=[row.to_dict() for row in rows], parallel=parallel, choices=self.run_plan.choices(),
                      memory_budget=self.run_plan.memory_budget)

    def follow(self) -> int:
        """On ranks != 0 of a parallel job: join rank 0's flow stages, image after image, until rank 0
        closes its pipeline; returns the number of images. Any failure, here or on another rank, raises
        on every rank (``PeerFailedError`` naming the rank that failed)."""
        if not self.is_follower:
            raise RuntimeError("rank 0 leads the parallel job (or there is none): call run(image) for each image "
                               "and close() at the end; follow() is for the other ranks")
        meter = Meter(self._relay, lambda: self._runner.registry, device=self._runtime.device,
                      meta={"rank": self._runtime.topology.rank})
        executor = Executor(self._runner, lambda item, k: FollowerState(parallel=self._runtime), hooks=[meter],
                            store=Skipping())
        return follow(self._runtime, executor, meter)

    def close(self) -> None:
        """Release every loaded model (a later ``run`` loads them again). In a parallel job, rank 0 tells the
        followers the job is over (their ``follow()`` returns), and the job's process groups are torn down
        when this pipeline made them; no run is possible after that."""
        try:
            if self._leader is not None:
                self._leader.close()
        finally:
            self._runner.close()
            if self._stream is not None:
                self._stream.close()
            if self._owns_runtime:
                self._runtime.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None and self._runtime is not None:  # the other ranks stop too, rather than wait
            if self._leader is not None:
                self._leader.abort(exc)
            else:
                self._runtime.fail(exc)
        self.close()
