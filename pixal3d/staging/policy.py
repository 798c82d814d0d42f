"""Device policy: what this machine is, how much memory the run needs, and where idle models live.

Policies (``policy=``; the command's ``--memory-policy``):

- ``resident``: load each model on first use and keep it (fastest when everything fits).
- ``staged``: release idle models to ``meta``; reload from disk when a later stage needs them.
- ``offload``: park idle models in pinned host memory (discrete GPUs only).
- ``eager``: load everything up front and keep it — the reference behaviour, for comparisons.
- ``auto``: choose from the memory plan and the machine, with the reasons as text.

A plan is built from model sizes the pipeline read from safetensors headers (no tensor is read to plan).
"""
from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import psutil
import torch

from .registry import IdlePlacement

logger = logging.getLogger(__name__)

HEADROOM = 0.15
"""Fraction of available memory the plan leaves free: "fits" means fits in the other 85% (``usable``)."""


def usable(available: int) -> int:
    """The part of ``available`` bytes a plan may fill: all of it less ``HEADROOM``."""
    return int(available * (1 - HEADROOM))


class Policy(str, enum.Enum):
    """Where idle models live; see the module docstring."""

    resident = "resident"
    staged = "staged"
    offload = "offload"
    eager = "eager"
    auto = "auto"


class PolicyError(ValueError):
    """A policy that cannot work on this machine, or a plan that cannot be read."""


@dataclass(frozen=True)
class Machine:
    """The compute device and the memory it can use, in bytes.

    ``unified`` is True when device and host share one pool (MPS, integrated CUDA, CPU-only):
    then ``device_available`` is the host's available memory.
    """

    device: str
    name: str
    unified: bool
    device_total: int
    device_available: int
    host_total: int
    host_available: int


def detect_machine(device: str | torch.device | None = None) -> Machine:
    """Describe ``device`` (default: the first CUDA device, else MPS, else CPU) and its free memory."""
    vm = psutil.virtual_memory()
    if device is None:
        if torch.cuda.is_available():
            device = "cuda"
        else:
            device = "mps" if torch.backends.mps.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        if props.is_integrated:
            return Machine(f"cuda:{index}", props.name, True, vm.total, vm.available, vm.total, vm.available)
        free, total = torch.cuda.mem_get_info(index)
        return Machine(f"cuda:{index}", props.name, False, total, free, vm.total, vm.available)
    if device.type == "mps":
        return Machine("mps", "Apple GPU", True, vm.total, vm.available, vm.total, vm.available)
    if device.type == "cpu":
        return Machine("cpu", "CPU", True, vm.total, vm.available, vm.total, vm.available)
    raise PolicyError(f"device {str(device)!r} is not supported; use cuda, mps or cpu")


@dataclass(frozen=True)
class StagePlan:
    """One stage: the models it needs, their weight bytes and the estimated working set."""

    name: str
    models: tuple[str, ...]
    weight_bytes: int
    working_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.working_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """Per-model and per-stage memory needs of a run, before any weight is read."""

    model_bytes: Mapping[str, int]
    stages: tuple[StagePlan, ...]

    @classmethod
    def build(
        cls,
        model_bytes: Mapping[str, int],
        stages: Mapping[str, Sequence[str]],
        working_bytes: Mapping[str, int] | None = None,
    ) -> MemoryPlan:
        """Combine model sizes with each stage's needs and working-set estimate (bytes, default 0)."""
        working_bytes = working_bytes or {}
        missing = sorted({m for needs in stages.values() for m in needs} - model_bytes.keys())
        if missing:
            raise PolicyError(
                f"no size known for models {missing}; give each a safetensors file or a byte count"
            )
        unknown = sorted(working_bytes.keys() - stages.keys())
        if unknown:
            raise PolicyError(
                f"working-set estimates for unknown stages {unknown}; stages are {list(stages)}"
            )
        plans = tuple(
            StagePlan(s, tuple(needs), sum(model_bytes[m] for m in needs), working_bytes.get(s, 0))
            for s, needs in stages.items()
        )
        return cls(dict(model_bytes), plans)

    @property
    def all_weights(self) -> int:
        """Bytes of every planned model at once (each counted once)."""
        used = {m for s in self.stages for m in s.models}
        return sum(self.model_bytes[m] for m in used)

    @property
    def staged_peak(self) -> int:
        """Largest single stage: its weights plus its working set."""
        return max((s.total_bytes for s in self.stages), default=0)

    @property
    def resident_peak(self) -> int:
        """All weights kept plus the largest working set."""
        return self.all_weights + max((s.working_bytes for s in self.stages), default=0)


def gib(nbytes: int) -> str:
    """Bytes as GiB with two decimals, e.g. '13.16 GiB'."""
    return f"{nbytes / 2**30:.2f} GiB"


def choose_policy(plan: MemoryPlan, machine: Machine, *, limit: int | None = None) -> tuple[Policy, list[str]]:
    """The ``auto`` choice (DESIGN.md's table) and the reasons for it, as sentences. ``limit``: bytes the
    models and the work may use at most (a memory budget less the interpreter), below the machine's own."""
    pool, host = usable(machine.device_available), usable(machine.host_available)  # what may be filled
    room = f"{gib(pool)} usable ({gib(machine.device_available)} available less {HEADROOM:.0%} headroom)"
    if limit is not None and limit < pool:
        room = f"{gib(limit)} usable (the memory budget; {gib(machine.device_available)} available)"
        pool, host = limit, min(host, limit)
    everything = f"all models resident need {gib(plan.resident_peak)}"
    largest = f"the largest stage needs {gib(plan.staged_peak)}"
    if machine.unified:
        where = f"unified memory ({machine.device}): models and work share one pool, {room}"
        if plan.resident_peak <= pool:
            return Policy.resident, [where, f"{everything}, which fits: keep every model loaded"]
        reasons = [
            where,
            f"{everything}, which does not fit",
            "release idle models to meta and reload them from disk",
        ]
        if plan.staged_peak > pool:
            reasons.append(f"warning: {largest}, more than usable memory; expect swapping or out-of-memory")
        return Policy.staged, reasons
    where = f"discrete GPU {machine.name} ({machine.device}): {room}"
    if plan.resident_peak <= pool:
        return Policy.resident, [where, f"{everything}, which fits on the GPU: keep every model there"]
    reasons = [where, f"{everything}, which does not fit on the GPU"]
    if plan.staged_peak <= pool and plan.all_weights <= host:
        return Policy.offload, reasons + [
            f"{largest}, which fits on the GPU",
            f"host memory has {gib(machine.host_available)} available for {gib(plan.all_weights)} of pinned "
            f"copies: park idle models there instead of reloading them from disk",
        ]
    if plan.all_weights > host:
        reasons.append(
            f"host memory ({gib(machine.host_available)} available) cannot hold pinned copies of "
            f"{gib(plan.all_weights)}"
        )
    reasons.append("release idle models to meta and reload them from disk")
    if plan.staged_peak > pool:
        reasons.append(f"warning: {largest}, more than usable GPU memory; expect out-of-memory")
    return Policy.staged, reasons


def resolve_policy(requested: Policy | str, plan: MemoryPlan, machine: Machine, *,
                   limit: int | None = None) -> tuple[Policy, list[str]]:
    """Turn the requested policy into the one to run: ``auto`` chooses (within ``limit`` bytes when given: see
    ``choose_policy``); ``offload`` is checked."""
    try:
        policy = Policy(requested)
    except ValueError:
        choices = [p.value for p in Policy]
        raise PolicyError(f"unknown policy {requested!r}; choose one of {choices}") from None
    if policy is Policy.auto:
        return choose_policy(plan, machine, limit=limit)
    if policy is Policy.offload and machine.unified:
        raise PolicyError(
            f"policy 'offload' parks idle models in host memory, but {machine.device} uses unified "
            f"memory: host and device are one pool, so offloading frees nothing and adds a copy. "
            f"Use policy=staged (or auto) on this machine."
        )
    reasons = [f"requested explicitly (policy={policy.value})"]
    need = plan.staged_peak if policy in (Policy.staged, Policy.offload) else plan.resident_peak
    if need > usable(machine.device_available):
        reasons.append(
            f"warning: {policy.value} needs {gib(need)}, {machine.device} has "
            f"{gib(machine.device_available)} available; expect swapping or out-of-memory"
        )
    elif limit is not None and need > limit:
        reasons.append(f"warning: {policy.value} needs {gib(need)}, more than the memory budget leaves "
                       f"({gib(limit)}): the process will outgrow the budget")
    return policy, reasons


def _describe(machine: Machine) -> str:
    if machine.unified:
        return (
            f"machine: {machine.name} ({machine.device}, unified memory): "
            f"{gib(machine.host_available)} available of {gib(machine.host_total)}"
        )
    return (
        f"machine: {machine.name} ({machine.device}, discrete memory): GPU {gib(machine.device_available)} "
        f"available of {gib(machine.device_total)}; host {gib(machine.host_available)} available of "
        f"{gib(machine.host_total)}"
    )


def format_plan(plan: MemoryPlan, machine: Machine, policy: Policy, reasons: Iterable[str]) -> str:
    """The plan as a text table, then the machine, the chosen policy and its reasons (for ``--plan``)."""
    rows = [("stage", "models", "weights", "working set", "total")]
    for s in plan.stages:
        models = ", ".join(s.models) or "-"
        rows.append((s.name, models, gib(s.weight_bytes), gib(s.working_bytes), gib(s.total_bytes)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = []
    for i, row in enumerate(rows):
        cells = [c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += [
        "",
        f"all weights at once: {gib(plan.all_weights)}; resident peak: {gib(plan.resident_peak)}; "
        f"largest stage: {gib(plan.staged_peak)}",
        _describe(machine),
        f"policy: {policy.value}",
    ]
    lines += [f"  - {r}" for r in reasons]
    return "\n".join(lines)


@dataclass(frozen=True)
class Placement:
    """What a resolved policy means for the registry: where idle models live, and whether every model
    loads before the first stage."""

    idle: IdlePlacement
    preload: bool = False


PLACEMENTS: Mapping[Policy, Placement] = {
    Policy.eager: Placement("keep", preload=True),
    Policy.resident: Placement("keep"),
    Policy.staged: Placement("release"),
    Policy.offload: Placement("park"),
}


def placement(policy: Policy | str) -> Placement:
    """The registry behaviour of a resolved policy (``auto`` must be resolved first)."""
    try:
        policy = Policy(policy)
    except ValueError:
        raise PolicyError(f"unknown policy {policy!r}; choose one of {[p.value for p in Policy]}") from None
    if policy is Policy.auto:
        raise PolicyError("policy 'auto' must be resolved first: call resolve_policy(plan, machine)")
    return PLACEMENTS[policy]
