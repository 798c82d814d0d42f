"""RunPlan: what a run will need and where its idle models will live, decided before any weight is read, and
the steps ``Pixal3D.plan`` (``pipeline.py``) takes to make it: the device, the samplers, each stage fitted
to its memory, the refusal when one stage cannot fit."""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pixal3d.config import DEFAULT_SIGMA_MIN, CascadeConfig
from pixal3d.memory_budget import budget_error, format_bytes, models_and_work
from pixal3d.nn.attention import device_array_bytes
from pixal3d.staging import Machine, MemoryPlan, Policy, format_plan
from pixal3d.staging.mps_memory import MpsMemoryLimit
from pixal3d.staging.policy import gib, usable

from .build import build_stages
from .errors import DeviceError, NotEnoughMemoryError
from .job import UsageError
from .parallel import RankPlan
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
    parallel: RankPlan | None = None         # this rank's part of the job under torchrun, else None
    memory_budget: int | None = None         # bytes every stage's work was bounded to (memory_budget)

    def choices(self) -> dict[str, Any]:
        """What fitting the stages to memory decided, per stage (NAF mode, decode tiles, chunk sizes)."""
        return {s.name: s.choices() for s in self.stages if getattr(s, "choices", None) and s.choices()}

    @property
    def rank(self) -> int:
        """This process's rank in the parallel job (0 without one); ranks != 0 follow rank 0."""
        return self.parallel.topology.rank if self.parallel is not None else 0

    @property
    def follower(self) -> bool:
        """Whether this process only joins rank 0's flow stages (``Pixal3D.follow``)."""
        return self.parallel is not None and self.parallel.follower

    def state_budget(self) -> int:
        """Bytes a batch may keep in image states between stages: the usable memory the plan saw (less its
        headroom; within the memory budget, less the interpreter, when there is one) minus what the policy
        needs for models and the largest working set."""
        memory = self.memory
        need = memory.staged_peak if self.policy in (Policy.staged, Policy.offload) else memory.resident_peak
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


def check_inputs(config: CascadeConfig, images: Iterable[Any], *, replace: Mapping[str, CascadeStage] | None = None,
                 until: str | None = None) -> None:
    """``RunPlan.check_input`` for every image before there is a plan: builds the stages (cheap, no file is
    read) so a batch or the command refuses an unusable input before any weight is generated or read."""
    stages = build_stages(config, replace=replace, until=until)
    for image in images:
        for stage in stages:
            stage.check_input(image)


def check_device(device: torch.device) -> torch.device:
    """``device`` if it exists here, else a ``DeviceError`` naming it and what exists."""
    if device.type not in ("cpu", "cuda", "mps"):
        raise DeviceError(f"device {device}: only cpu, cuda and mps are supported")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {device} asks for CUDA, which this torch build or machine does not have; "
                              f"use cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceError(f"device {device} does not exist: this machine has {count} CUDA device(s), "
                              f"cuda:0 to cuda:{count - 1}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"device {device} asks for Apple MPS, which is not available here; use cpu")
    if device.type in ("cpu", "mps") and device.index not in (None, 0):
        raise DeviceError(f"device {device} does not exist: there is one {device.type} device, "
                          f"'{device.type}' (or {device.type}:0)")
    return device


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


def default_device() -> torch.device:
    """cuda if available, else mps, else cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


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
               machine: Machine) -> tuple[Any, ...]:
    """Each stage as it should run within the memory it may use (``CascadeStage.fitted``): an explicit
    ``budget`` bounds every stage to it, and one that cannot fit even then raises ``MemoryBudgetError``
    naming the stage, its need and the budget; without one, each stage may use the machine's usable memory
    (its NAF mode is chosen against that, nothing is refused)."""
    total = budget if budget is not None else usable(machine.device_available)
    fitted = []
    for stage in stages:
        weights = sum(sizes.get(m, 0) for m in stage.needs)
        if hasattr(stage, "fitted"):
            stage = stage.fitted(StageBudget(total, weights, budget is not None,
                                             array_bytes=device_array_bytes(machine.device)))
        need = weights + int(stage.working_set())
        if budget is not None and need > models_and_work(budget):
            raise budget_error(stage.name, need, budget, f"weights {format_bytes(weights)} and a working set of "
                                                          f"{format_bytes(stage.working_set())}")
        fitted.append(stage)
    return tuple(fitted)


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
        reasons.append(f"warning: the memory budget {format_bytes(budget)} is more than this machine's "
                       f"{format_bytes(machine.device_total)} of {machine.device} memory, so it bounds nothing; "
                       f"give memory_budget a size below it, or auto")
    elif budget is not None:
        reasons.append(f"memory budget {format_bytes(budget)}: every stage's work is bounded to it")
    modes: dict[str, list[str]] = {}
    for stage in stages:
        choices = stage.choices() if hasattr(stage, "choices") else {}
        if "naf_mode" in choices:
            modes.setdefault(choices["naf_mode"], []).append(stage.name)
        if "tiles" in choices:
            tiles = choices["tiles"]
            reasons.append(f"{stage.name}: in spatial tiles from decoder level {tiles['start_level']}, at most "
                           f"{tiles['tile_voxels']:,} voxels each (exact)")
        if "chunks" in choices:
            reasons.append(f"{stage.name}: attention and NAF in smaller chunks to stay within the budget")
    if "full" in modes:
        reasons.append(f"NAF full (the reference's values) for {', '.join(modes['full'])}")
    if "frugal" in modes:
        reasons.append(f"NAF frugal (less memory, ~1e-7 from the reference) for {', '.join(modes['frugal'])}: "
                       f"its full map does not fit")
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
