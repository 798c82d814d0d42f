"""RunPlan: what a run will need and where its idle models will live, decided before any weight is read, and
the steps ``Pixal3D.plan`` (``pipeline.py``) takes to make it (``plan_run``): the samplers, the stages, each stage
fitted to its memory, the policy, the refusal when one stage cannot fit."""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pixal3d.config import DEFAULT_SIGMA_MIN, CascadeConfig, UsageError
from pixal3d.devices import DeviceError, check_device, default_device  # noqa: F401 -- re-exported
from pixal3d.devices import kind as device_kind
from pixal3d.memory_budget import (
    GIB,
    PROCESS_BYTES,
    MemoryBudgetError,
    budget_error,
    format_bytes,
    models_and_work,
)
from pixal3d.nn.attention import describe_route, device_array_bytes, resolve_route
from pixal3d.pipeline_json import (
    STANDING_MODELS,
    ResolvedWeights,
    planned_pipeline_json,
    planned_sizes,
    planned_tensor_bytes,
    resolve_samplers,
    resolve_weights,
)
from pixal3d.staging import (
    Machine,
    MemoryPlan,
    Policy,
    PolicyError,
    StreamLayout,
    check_stages,
    format_plan,
    measure_copy_bandwidth,
)
from pixal3d.staging.mps_memory import MpsMemoryLimit, check_mps_memory_limit
from pixal3d.staging.policy import (
    gib,
    resolve_policy,
    stage_weight_bytes,
    stream_choice,
    usable,
)

from . import state_codec
from .build import SHAPE_ONLY, build_stages
from .errors import NotEnoughMemoryError
from .inputs import IMAGE, InputKind
from .loaders import STREAM_UNITS
from .ranks import Rank
from .stage import CascadeStage, StageBudget


@dataclass(frozen=True)
class RunPlan:
    """What a run will need and where its idle models will live, decided before any weight is read."""

    config: CascadeConfig
    stages: tuple[CascadeStage, ...]
    device: torch.device
    memory: MemoryPlan
    machine: Machine
    policy: Policy
    reasons: tuple[str, ...]
    notes: tuple[str, ...] = ()
    mps_limit: MpsMemoryLimit | None = None  # the MPS allocator's limit, on mps only
    role: Rank = dataclasses.field(default_factory=Rank)  # this process's part in a job (``pipelines.ranks``)
    memory_budget: int | None = None         # bytes every stage's work was bounded to (memory_budget)
    stream_pinned: bool = False              # stream policy on CUDA: blocks copied from pinned host copies
    kind: InputKind = IMAGE                  # the kind of input the stages take (``pipelines.inputs``)

    def resolved_weights(self) -> ResolvedWeights:
        """The weights this plan's models need, fetched (unless offline) and verified; a rank checks its part."""
        names = self.model_names()
        weights = resolve_weights(self.config.weights, models=names, need_moge="moge" in names,
                                  config_file=self.config.source or None)
        self.role.check_weights(weights, self.stages)
        return weights

    def choices(self) -> dict[str, Any]:
        """What fitting the stages to memory decided, per stage (NAF mode, decode tiles, chunk sizes)."""
        return {s.name: s.choices() for s in self.stages if getattr(s, "choices", None) and s.choices()}

    @property
    def shape_only(self) -> bool:
        """Whether the run ends with the untextured export (``until=SHAPE_ONLY``: no texture stages)."""
        return any(s.name == SHAPE_ONLY for s in self.stages)

    @property
    def rank(self) -> int:
        """This process's rank in the parallel job (0 without one); ranks != 0 follow rank 0."""
        return self.role.number

    @property
    def follower(self) -> bool:
        """Whether this process only joins rank 0's flow stages (``Pixal3D.follow``)."""
        return self.role.follower

    def state_budget(self) -> int:
        """Bytes a batch may keep in image states between stages: the usable memory the plan saw (less its
        headroom; within the memory budget, less the interpreter, when there is one) minus what the policy
        needs for models and the largest working set."""
        memory = self.memory
        staged = self.policy in (Policy.staged, Policy.offload, Policy.stream)
        need = memory.staged_peak if staged else memory.resident_peak
        room = usable(self.machine.device_available)
        if self.memory_budget is not None:
            room = min(room, models_and_work(self.memory_budget))
        return max(0, room - need)

    def table(self) -> str:
        """The plan as text: per-stage weights and working sets, the machine, the policy and its reasons."""
        return format_plan(self.memory, self.machine, self.policy, [*self.reasons, *self.notes])

    def model_names(self) -> list[str]:
        """Every model some stage needs, in first-use order."""
        return list(dict.fromkeys(m for s in self.stages for m in s.needs))

    def check_input(self, image: Any) -> None:
        """Raise ``ImageError`` now, before any weight is read, if a stage of this plan cannot take ``image``
        (a path, PIL image or array): e.g. an opaque photo when no background remover is configured."""
        for stage in self.stages:
            stage.check_input(image)


def check_inputs(config: CascadeConfig, images: Iterable[Any], *, kind: InputKind | None = None,
                 replace: Mapping[str, CascadeStage] | None = None, until: str | None = None) -> None:
    """``RunPlan.check_input`` for every image before there is a plan: builds the stages (cheap, no file is
    read) so a batch or the command refuses an unusable input before any weight is generated or read."""
    stages = build_stages(config, kind=kind, replace=replace, until=until)
    for image in images:
        for stage in stages:
            stage.check_input(image)


def parse_device(text: str, flag: str = "--device") -> torch.device:
    """A front end's ``--device`` as a torch device that exists on this machine (``UsageError`` naming ``flag``)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise UsageError(f"{flag} {text!r} is not a torch device; use cpu, cuda, cuda:1 or mps") from None
    try:
        return check_device(device)
    except DeviceError as err:
        raise UsageError(f"{flag}: {err}") from None


def with_sampler_of(stage: Any, config: CascadeConfig) -> Any:
    """``stage`` with what its sampler leaves unset (``guidance_interval``, a default ``sigma_min``) taken from
    the resolved ``config``'s section: a stage passed in ``replace`` was built before pipeline.json was read."""
    own = getattr(getattr(stage, "config", None), "sampler", None)
    resolved = getattr(getattr(config, stage.section or "", None), "sampler", None) if hasattr(stage, "section") else None
    if own is None or resolved is None:
        return stage
    changes = {}
    if own.guidance_interval is None:
        changes["guidance_interval"] = resolved.guidance_interval
    if own.sigma_min == DEFAULT_SIGMA_MIN and resolved.sigma_min != DEFAULT_SIGMA_MIN:
        changes["sigma_min"] = resolved.sigma_min
    if not changes:
        return stage
    stage = copy.copy(stage)
    stage.config = dataclasses.replace(stage.config, sampler=dataclasses.replace(own, **changes))
    return stage


def fit_stages(stages: Sequence[Any], sizes: Mapping[str, int], budget: int | None,
               machine: Machine, layouts: Mapping[str, StreamLayout] | None = None) -> tuple[Any, ...]:
    """Each stage as it should run within the memory it may use (``CascadeStage.fitted``): an explicit
    ``budget`` bounds every stage to it, and one that cannot fit even then raises ``MemoryBudgetError``
    naming the stage, its need and the budget; without one, each stage may use the machine's usable memory
    (its NAF mode is chosen against that, nothing is refused). ``layouts``: the models whose blocks stream (the
    ``stream`` policy): a stage counts their resident parts and the blocks in flight, not the whole models."""
    total = budget if budget is not None else usable(machine.device_available)
    fitted = []
    for stage in stages:
        weights = stage_weight_bytes(stage.needs, {m: sizes.get(m, 0) for m in stage.needs}, layouts)
        if hasattr(stage, "fitted"):
            stage = stage.fitted(StageBudget(total, weights, budget is not None,
                                             array_bytes=device_array_bytes(machine.device), device=machine.device,
                                             model_bytes=sum(sizes.get(m, 0) for m in stage.needs)))
        need = weights + int(stage.working_set())
        if budget is not None and need > models_and_work(budget):
            raise budget_error(stage.name, need, budget, f"weights {format_bytes(weights)} and a working set of "
                                                          f"{format_bytes(stage.working_set())}")
        fitted.append(stage)
    return tuple(fitted)


def smallest_budget(stages: Sequence[Any], sizes: Mapping[str, int], machine: Machine,
                    layouts: Mapping[str, StreamLayout] | None = None, *,
                    step: int = GIB // 100) -> tuple[int, str]:
    """The smallest memory budget (to ``step`` bytes) every stage fits within, and the stage that sets it (the one
    refused just below it): ``fit_stages`` bisected, nothing read."""
    def fits(budget: int) -> str | None:
        try:
            fit_stages(stages, sizes, budget, machine, layouts)
        except MemoryBudgetError as err:
            return err.stage or "?"
        return None

    low, high = PROCESS_BYTES, 2 * GIB
    while fits(high) is not None:
        low, high = high, high * 2
        if high > 2**50:
            raise MemoryBudgetError("no memory budget fits this cascade (above 1 PiB)")
    while high - low > step:
        middle = (low + high) // 2
        if fits(middle) is None:
            high = middle
        else:
            low = middle
    on_grid = high // step * step  # the smallest multiple of step that fits: high's or the one above it
    if on_grid <= low or fits(on_grid) is not None:
        on_grid += step
    return on_grid, fits(low) or ""


def skipped_by(stage: str) -> str:
    """What a stage that sets the smallest budget is skipped by, for the line that names it: the camera stage
    (MoGe-2) runs only to estimate the field of view, so giving one skips it."""
    return "; give fov=DEGREES to skip the camera stage" if stage == "camera" else ""


@dataclass(frozen=True)
class PolicyFit:
    """What fitting the stages and choosing the policy gave: the stages as they will run, the memory plan of
    the chosen policy (``streamed`` for ``stream``), the policy and its reasons."""

    stages: tuple[Any, ...]
    memory: MemoryPlan
    policy: Policy
    reasons: list[str]


def fit_policy(requested: Policy | str, stages: Sequence[Any], sizes: Mapping[str, int], budget: int | None,
               machine: Machine, layouts: Mapping[str, StreamLayout]) -> PolicyFit:
    """Fit the stages (``fit_stages``) and choose the policy: with whole models, then — when some models can
    stream (``layouts``) and the request is ``auto`` or ``stream`` — with their blocks streamed; ``auto`` takes
    ``stream`` when a budget refuses whole models or their largest stage does not fit. A budget nothing meets
    raises ``MemoryBudgetError`` naming the stage and the smallest budget that would do."""
    requested = Policy(requested)
    limit = None if budget is None else models_and_work(budget)
    needs = {s.name: tuple(s.needs) for s in stages}
    can_stream = bool(layouts) and requested in (Policy.auto, Policy.stream)

    def plan(streamed: Mapping[str, StreamLayout] | None) -> tuple[tuple[Any, ...], MemoryPlan]:
        try:
            fitted = fit_stages(stages, sizes, budget, machine, streamed)
        except MemoryBudgetError as err:
            if budget is None:
                raise
            smallest, setter = smallest_budget(stages, sizes, machine, layouts if can_stream else None)
            raise MemoryBudgetError(f"{err}; the smallest budget this cascade plans within is {gib(smallest)} "
                                    f"(memory_budget={smallest / GIB:.2f}G){skipped_by(setter)}", stage=err.stage,
                                    need=err.need, smallest=smallest) from None
        return fitted, MemoryPlan.build(sizes, needs, {s.name: int(s.working_set()) for s in fitted},
                                        streamed=streamed)

    whole = refused = None
    if requested is not Policy.stream:
        try:
            whole = plan(None)
        except MemoryBudgetError as err:
            if not can_stream:
                raise
            refused = err
    streamed = plan(layouts) if can_stream else None
    if whole is None:
        if streamed is None:
            raise PolicyError("policy 'stream' needs models that can stream their blocks (the flows, the decoders), "
                              "and this plan has none: use staged")
        if requested is Policy.stream:
            policy, reasons = resolve_policy(requested, streamed[1], machine, limit=limit, streamed=streamed[1])
        else:
            policy, reasons = stream_choice(streamed[1], machine, limit=limit,
                                            because=f"with whole models, stage {refused.stage!r} does not fit the "
                                                    f"memory budget")
        return PolicyFit(streamed[0], streamed[1], policy, reasons)
    policy, reasons = resolve_policy(requested, whole[1], machine, limit=limit,
                                     streamed=streamed[1] if streamed is not None else None)
    chosen = streamed if policy is Policy.stream else whole
    return PolicyFit(chosen[0], chosen[1], policy, reasons)


def stream_layouts(config: CascadeConfig, models: Sequence[str], policy: Policy | str) -> dict[str, StreamLayout]:
    """The blocks of every model in ``models`` that can stream (``STREAM_UNITS``), from their headers (nothing
    downloaded), when ``policy`` may stream (``auto``, ``stream``); else none."""
    if Policy(policy) not in (Policy.auto, Policy.stream):
        return {}
    names = [m for m in models if m in STREAM_UNITS]
    tensors = planned_tensor_bytes(config.weights, models=names, config_file=config.source or None)
    return {m: StreamLayout.from_tensors(t, STREAM_UNITS[m]) for m, t in tensors.items()}


def stream_pinned(memory: MemoryPlan, machine: Machine) -> bool:
    """Whether a discrete GPU's host memory holds pinned copies of the streamed models one stage uses at a time
    (then their blocks are copied from those, at the link's full speed, rather than from the mapped files)."""
    if machine.unified or not memory.streamed:
        return False
    per_stage = max((sum(memory.model_bytes[m] for m in s.models if m in memory.streamed) for s in memory.stages),
                    default=0)
    return per_stage <= usable(machine.host_available)


def describe_stream(memory: MemoryPlan, stages: Sequence[Any], bandwidth: float) -> list[str]:
    """The ``stream`` policy's cost per stage, in words: the bytes of blocks one pass copies (a forward of a flow,
    up to two per sampler step with guidance; one decode, its tiled levels again per tile) and their time at
    ``bandwidth`` bytes per second (the host-to-device copy measured on this device)."""
    lines = []
    by_name = {s.name: s for s in stages}
    for row in memory.stages:
        if not row.streamed_bytes:
            continue
        stage = by_name.get(row.name)
        seconds = row.streamed_bytes / bandwidth
        copied = f"{format_bytes(row.streamed_bytes)} of blocks copied per"
        at = f"{seconds:.2f} s at {bandwidth / 1e9:.1f} GB/s"
        sampler = getattr(getattr(stage, "config", None), "sampler", None)
        if sampler is not None:
            guided = sampler.guidance_strength != 1.0
            forwards = sampler.steps * (2 if guided else 1)
            lines.append(f"{row.name}: {copied} forward, {at}; up to {forwards} forwards ({sampler.steps} steps"
                         f"{', 2 per guided step' if guided else ''}): {format_bytes(forwards * row.streamed_bytes)}, "
                         f"{forwards * seconds:.1f} s")
        else:
            tiles = " (the tiled levels' blocks again per tile)" if getattr(stage, "tile_plan", None) else ""
            lines.append(f"{row.name}: {copied} pass{tiles}, {at}")
    if lines:
        lines.insert(0, f"streamed: {bandwidth / 1e9:.1f} GB/s is this device's host-to-device copy, measured now "
                        f"(a block read from a disk the page cache does not hold goes at the disk's speed)")
    return lines


def with_attention_route_of(stages: Sequence[Any], route: str) -> tuple[Any, ...]:
    """The stages, those that run attention (``attention_route``) copied with the resolved ``route``, so that
    their working sets count its memory."""
    out = []
    for stage in stages:
        if getattr(stage, "attention_route", route) != route:
            stage = copy.copy(stage)
            stage.attention_route = route
        out.append(stage)
    return tuple(out)


def describe_fit(stages: Sequence[Any], budget: int | None, machine: Machine | None = None) -> list[str]:
    """The plan's reasons for what fitting decided (NAF mode per stage, decode tiles, chunks); a budget above the
    ``machine``'s memory is a warning first: it bounds nothing there (``1000T`` on a 24 GiB machine)."""
    reasons = []
    if budget is not None and machine is not None and budget > machine.device_total:
        whose = (f"this process's {format_bytes(machine.device_total)} ({machine.host_bound}, lower than the "
                 f"machine's RAM)" if machine.unified and machine.host_bound else
                 f"this machine's {format_bytes(machine.device_total)} of {machine.device} memory")
        reasons.append(f"warning: the memory budget {format_bytes(budget)} is more than {whose}, so it bounds "
                       f"nothing; give memory_budget a size below it, or auto")
    elif budget is not None:
        reasons.append(f"memory budget {format_bytes(budget)}: every stage's work is bounded to it")
    modes: dict[str, list[str]] = {}
    for stage in stages:
        choices = stage.choices() if hasattr(stage, "choices") else {}
        if "naf_mode" in choices:
            modes.setdefault(choices["naf_mode"], []).append(stage.name)
        if "tiles" in choices:
            tiles = choices["tiles"]
            where = (f"from decoder level {tiles['start_level']}" if "start_level" in tiles else
                     f"over its first {tiles['levels']} encoder levels")
            reasons.append(f"{stage.name}: in spatial tiles {where}, at most {tiles['tile_voxels']:,} voxels each "
                           f"(exact)")
        if "chunks" in choices:
            reasons.append(f"{stage.name}: attention and NAF in smaller chunks to stay within the budget")
        if choices.get("workers") == 1:
            reasons.append(f"{stage.name}: the remesh's slabs one at a time, not on forked workers (their memory does "
                           f"not fit; the same mesh, ~1.6x the remesh's time)")
        if "conv_band_rows" in choices:
            reasons.append(f"{stage.name}: MoGe-2's conv neck and heads in bands of {choices['conv_band_rows']} rows "
                           f"(exact)")
    if "full" in modes:
        reasons.append(f"NAF full (the reference's values) for {', '.join(modes['full'])}")
    if "frugal" in modes:
        reasons.append(f"NAF frugal (less memory, ~1e-7 from the reference) for {', '.join(modes['frugal'])}: "
                       f"its full mode does not fit")
    return reasons


def check_memory(plan: MemoryPlan, available: int, device: str) -> None:
    """Refuse a run when even one stage's weights, loaded alone, exceed the available memory.

    Only weights are compared (they are exact, from file headers); the working-set estimates are
    too rough to refuse a run on, so the policy's reasons carry them as a warning instead.
    """
    largest = max(plan.stages, key=lambda s: s.weight_bytes, default=None)
    if largest is not None and largest.weight_bytes > available:
        raise NotEnoughMemoryError(
            f"not enough memory for any policy: stage {largest.name} alone needs {gib(largest.weight_bytes)} of "
            f"weights even when models are loaded one stage at a time, but {device} has {gib(available)} "
            f"available; close other programs or run on a machine with more memory")


# -- the steps of Pixal3D.plan ----------------------------------------------------------------------
def plan_run(config: CascadeConfig, kind: InputKind, device: torch.device, role: Rank, machine: Machine,
             budget: int | str | None, *, policy: Policy | str, replace: Mapping[str, CascadeStage] | None,
             until: str | None) -> RunPlan:
    """The plan of ``role``'s part of a job on ``config`` on ``machine`` (``detect_machine``; the arguments checked
    by ``Pixal3D.plan``, ``budget`` as ``check_plan_arguments`` parsed it), from ``pipeline.json`` and safetensors
    headers only."""
    # 1. the samplers' settings the config leaves to pipeline.json; 2. the stages, this rank's part of them
    config = planned_config(config)
    stages = planned_stages(config, kind, role, replace=replace, until=until)
    # 3. the machine as this rank has it, every model's bytes from safetensors headers (a rank's shards)
    models = list(dict.fromkeys(m for s in stages for m in s.needs))  # cascade order: errors name the first
    sized = role.sized(config, stages, models, machine)
    role, machine, sizes = sized.rank, sized.machine, sized.sizes
    # 4. the budget; the blocks of the models that can stream, from their headers, where the policy may stream
    budget = plan_budget(budget, machine)
    layouts = stream_layouts(config, models, policy) if role.streams else {}
    # 5. every stage fitted to the budget (or the machine's usable memory) and the attention route; the policy
    #    chosen within it: whole models, or their blocks streamed when whole models do not fit
    routed = with_attention_route_of(stages, resolve_route(config.runtime.attention, device))
    fit = fit_policy(policy, routed, sizes, budget, machine, layouts)
    # 6. refused when one stage's weights alone do not fit; what the budget and the stream cost, in words
    check_memory(fit.memory, machine.device_available, str(device))
    reasons, pinned = plan_reasons(fit, sized.reasons, routed, sizes, budget, machine, device,
                                   config.runtime.attention)
    # 7. on MPS, an allocator limit that fails instead of swapping, refused or lowered before any load
    mps_limit, mps_lines = plan_mps_limit(device)
    return RunPlan(config, fit.stages, device, fit.memory, machine, fit.policy, (*reasons, *mps_lines),
                   tuple(sized.notes), mps_limit, role, budget, pinned, kind)


def planned_config(config: CascadeConfig) -> CascadeConfig:
    """The config with what its samplers leave unset taken from ``pipeline.json`` (``resolve_samplers``); when the
    file is neither on disk nor reachable, one error naming it and every other missing file."""
    pipeline = planned_pipeline_json(config.weights)
    if pipeline is None:
        planned_sizes(config.weights, models=STANDING_MODELS, config_file=config.source or None)
    return resolve_samplers(config, pipeline)


def planned_stages(config: CascadeConfig, kind: InputKind, role: Rank, *,
                   replace: Mapping[str, CascadeStage] | None, until: str | None) -> tuple[CascadeStage, ...]:
    """The cascade's stages for ``kind`` of input, each with its sampler's resolved settings, this rank's part of
    them, their declarations checked before anything is read (``check_stages``)."""
    stages = tuple(with_sampler_of(s, config) for s in build_stages(config, kind=kind, replace=replace, until=until))
    stages = role.stages(stages)
    provides, state_type = role.state()
    check_stages(stages, provides=provides, state_type=state_type, storable=state_codec.storable(state_type))
    return stages


def plan_budget(memory_budget: int | str | None, machine: Machine) -> int | None:
    """The budget in bytes (``auto``: the machine's usable memory now), from the value ``check_plan_arguments``
    parsed: a size is parsed once per job, by the front end or at the library's door."""
    if memory_budget is None:
        return None
    return usable(machine.device_available) if memory_budget == "auto" else int(memory_budget)


def plan_reasons(fit: PolicyFit, sized_reasons: Sequence[str], routed: Sequence[Any], sizes: Mapping[str, int],
                 budget: int | None, machine: Machine, device: torch.device, attention: str) -> tuple[list[str], bool]:
    """The plan's reasons after the policy's (the machine shared, what fitting decided, the smallest budget, the
    stream's cost, the attention route) and whether streamed blocks copy from pinned host memory."""
    reasons = [*fit.reasons, *sized_reasons, *describe_fit(fit.stages, budget, machine)]
    if budget is not None:
        smallest, setter = smallest_budget(routed, sizes, machine, fit.memory.streamed or None)
        reasons.append(f"the smallest memory budget this cascade plans within ({fit.policy.value}): "
                       f"{gib(smallest)}, set by stage {setter!r}{skipped_by(setter)}")
    pinned = False
    if fit.policy is Policy.stream:
        reasons += describe_stream(fit.memory, fit.stages, measure_copy_bandwidth(device))
        pinned = stream_pinned(fit.memory, machine)
    reasons.append(describe_route(attention, device))
    return reasons, pinned


def plan_mps_limit(device: torch.device) -> tuple[MpsMemoryLimit | None, list[str]]:
    """On MPS, the allocator's limit, one that fails instead of swapping, refused or lowered before any load (the
    run lowers PyTorch's default: ``Pixal3D``), and the plan's lines about it; elsewhere none."""
    if not device_kind(device).memory_limit:
        return None, []
    limit = check_mps_memory_limit()
    lines = [limit.describe()]
    if limit.lets_swap:
        lines.append(f"the run lowers the MPS limit to {limit.safe_ratios()[0]:g} x Metal's recommended working set, "
                     f"so that outgrowing memory fails instead of swapping")
    return limit, lines
