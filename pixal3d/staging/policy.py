"""Device policy: what this machine is, how much memory the run needs, and where idle models live.

Policies (``policy=``; the command's ``--memory-policy``):

- ``resident``: load each model on first use and keep it (fastest when everything fits).
- ``staged``: release idle models to ``meta``; reload from disk when a later stage needs them.
- ``offload``: park idle models in pinned host memory (discrete GPUs only).
- ``eager``: load everything up front and keep it — the reference behaviour, for comparisons.
- ``stream``: as ``staged``, and the models that can stream (``stream.py``) copy their blocks to the device
  one at a time, the next copy overlapping the current block's compute: a stage holds its other models, the
  streamed models' small parts and two blocks in flight.
- ``auto``: choose from the memory plan and the machine, with the reasons as text (``stream`` when a stage's
  whole models do not fit and their blocks do).

A plan is built from model sizes the pipeline read from safetensors headers (no tensor is read to plan).
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import psutil
import torch

from pixal3d.telemetry import linux

from .registry import IdlePlacement
from .stream import StreamLayout, in_flight_bytes

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
    stream = "stream"
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
    host_bound: str = ""
    """What sets ``host_total`` when it is not the machine's RAM (``"cgroup v2 limit"``), else empty."""


def host_memory() -> tuple[int, int, str]:
    """Total and available bytes of the host memory this process may use, and what bounds it: the machine's RAM,
    or on Linux its memory cgroup's limit where that is lower (a container, ``systemd-run -p MemoryMax``, cgroup
    v1 or v2): available is then the limit less what the group holds, never more than the machine has free."""
    vm = psutil.virtual_memory()
    total, available = int(vm.total), int(vm.available)
    if not sys.platform.startswith("linux"):
        return total, available, ""
    total, available, group = linux.cgroup_bounded(total, available)
    return total, available, f"cgroup v{group.version} limit" if group is not None else ""


def detect_machine(device: str | torch.device | None = None) -> Machine:
    """Describe ``device`` (default: the first CUDA device, else MPS, else CPU) and its free memory; the host's is
    what this process may use (``host_memory``: a cgroup's limit where it is lower than the RAM)."""
    host, free, bound = host_memory()
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
            return Machine(f"cuda:{index}", props.name, True, host, free, host, free, bound)
        free_device, total = torch.cuda.mem_get_info(index)
        return Machine(f"cuda:{index}", props.name, False, total, free_device, host, free, bound)
    if device.type == "mps":
        return Machine("mps", "Apple GPU", True, host, free, host, free, bound)
    if device.type == "cpu":
        return Machine("cpu", "CPU", True, host, free, host, free, bound)
    raise PolicyError(f"device {str(device)!r} is not supported; use cuda, mps or cpu")


def stage_weight_bytes(models: Iterable[str], model_bytes: Mapping[str, int],
                       streamed: Mapping[str, StreamLayout] | None = None) -> int:
    """Weight bytes a stage holds: whole models, and for the models in ``streamed`` their resident part plus the
    units in flight (``in_flight_bytes`` over all of them: they share one device's stream)."""
    streamed = streamed or {}
    models = list(models)
    layouts = [streamed[m] for m in models if m in streamed]
    whole = sum(model_bytes[m] for m in models if m not in streamed)
    return whole + sum(layout.resident_bytes for layout in layouts) + in_flight_bytes(layouts)


@dataclass(frozen=True)
class StagePlan:
    """One stage: the models it needs, their weight bytes and the estimated working set; ``streamed_bytes``: the
    bytes of blocks a pass over its streamed models copies to the device (0 when none streams)."""

    name: str
    models: tuple[str, ...]
    weight_bytes: int
    working_bytes: int
    streamed_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.working_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """Per-model and per-stage memory needs of a run, before any weight is read."""

    model_bytes: Mapping[str, int]
    stages: tuple[StagePlan, ...]
    streamed: Mapping[str, StreamLayout] = dataclasses.field(default_factory=dict)

    @classmethod
    def build(
        cls,
        model_bytes: Mapping[str, int],
        stages: Mapping[str, Sequence[str]],
        working_bytes: Mapping[str, int] | None = None,
        streamed: Mapping[str, StreamLayout] | None = None,
    ) -> MemoryPlan:
        """Combine model sizes with each stage's needs and working-set estimate (bytes, default 0). ``streamed``:
        the layout of each model whose blocks stream (the ``stream`` policy's plan): a stage counts its resident
        part and the blocks in flight instead of the whole model."""
        streamed = dict(streamed or {})
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
            StagePlan(s, tuple(needs), stage_weight_bytes(needs, model_bytes, streamed), working_bytes.get(s, 0),
                      sum(streamed[m].streamed_bytes for m in needs if m in streamed))
            for s, needs in stages.items()
        )
        return cls(dict(model_bytes), plans, streamed)

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


def _pool(machine: Machine, limit: int | None) -> tuple[int, int, str]:
    """What may be filled on the device and in host memory, and those words for the reasons."""
    pool, host = usable(machine.device_available), usable(machine.host_available)
    room = f"{gib(pool)} usable ({gib(machine.device_available)} available less {HEADROOM:.0%} headroom)"
    if limit is not None and limit < pool:
        room = f"{gib(limit)} usable (the memory budget; {gib(machine.device_available)} available)"
        pool, host = limit, min(host, limit)
    return pool, host, room


def _where(machine: Machine, room: str) -> str:
    if machine.unified:
        return f"unified memory ({machine.device}): models and work share one pool, {room}"
    return f"discrete GPU {machine.name} ({machine.device}): {room}"


def stream_choice(streamed: MemoryPlan, machine: Machine, *, limit: int | None = None,
                  because: str) -> tuple[Policy, list[str]]:
    """``stream``, and why: ``because`` says why whole models do not do (a sentence)."""
    pool, _, room = _pool(machine, limit)
    streaming = (f"stream the flow and decoder blocks to the device two at a time: the largest stage then needs "
                 f"{gib(streamed.staged_peak)} (its other models, the streamed models' small parts, two blocks in "
                 f"flight and its work)")
    reasons = [_where(machine, room), because, streaming]
    if streamed.staged_peak > pool:
        reasons.append(f"warning: even so, {gib(streamed.staged_peak)} is more than the {gib(pool)} usable; "
                       f"expect swapping or out-of-memory")
    return Policy.stream, reasons


def choose_policy(plan: MemoryPlan, machine: Machine, *, limit: int | None = None,
                  streamed: MemoryPlan | None = None) -> tuple[Policy, list[str]]:
    """The ``auto`` choice (DESIGN.md's table) and the reasons for it, as sentences. ``limit``: bytes the
    models and the work may use at most (a memory budget less the interpreter), below the machine's own.
    ``streamed``: the plan with the streamable models' blocks streamed; chosen when the largest stage does not
    fit with whole models."""
    pool, host, room = _pool(machine, limit)
    where = _where(machine, room)
    everything = f"all models resident need {gib(plan.resident_peak)}"
    largest = f"the largest stage needs {gib(plan.staged_peak)}"
    if streamed is not None and plan.staged_peak > pool and plan.resident_peak > pool:
        return stream_choice(streamed, machine, limit=limit, because=f"with whole models {largest}, which does "
                                                                      f"not fit")
    if machine.unified:
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
                   limit: int | None = None, streamed: MemoryPlan | None = None) -> tuple[Policy, list[str]]:
    """Turn the requested policy into the one to run: ``auto`` chooses (within ``limit`` bytes when given; with
    ``streamed``, the plan of the ``stream`` policy: see ``choose_policy``); ``offload`` is checked; ``stream``
    needs ``streamed``."""
    try:
        policy = Policy(requested)
    except ValueError:
        choices = [p.value for p in Policy]
        raise PolicyError(f"unknown policy {requested!r}; choose one of {choices}") from None
    if policy is Policy.auto:
        return choose_policy(plan, machine, limit=limit, streamed=streamed)
    if policy is Policy.offload and machine.unified:
        raise PolicyError(
            f"policy 'offload' parks idle models in host memory, but {machine.device} uses unified "
            f"memory: host and device are one pool, so offloading frees nothing and adds a copy. "
            f"Use policy=staged (or auto) on this machine."
        )
    if policy is Policy.stream:
        if streamed is None:
            raise PolicyError("policy 'stream' needs models that can stream their blocks, and this plan has none")
        plan = streamed
    reasons = [f"requested explicitly (policy={policy.value})"]
    need = plan.staged_peak if policy in (Policy.staged, Policy.offload, Policy.stream) else plan.resident_peak
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
    """The plan as a text table, then the machine, the chosen policy and its reasons (for ``--plan``). A plan
    whose blocks stream marks the streamed models (``~``) and adds the blocks each pass copies."""
    streams = bool(plan.streamed)
    header = ["stage", "models", "weights", "working set", "total"] + (["streamed per pass"] if streams else [])
    rows = [tuple(header)]
    for s in plan.stages:
        models = ", ".join(f"{m}~" if m in plan.streamed else m for m in s.models) or "-"
        row = [s.name, models, gib(s.weight_bytes), gib(s.working_bytes), gib(s.total_bytes)]
        if streams:
            row.append(gib(s.streamed_bytes) if s.streamed_bytes else "-")
        rows.append(tuple(row))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for i, row in enumerate(rows):
        cells = [c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    if streams:
        lines.append("~: streamed (its small parts resident, two blocks on the device at a time)")
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
    Policy.stream: Placement("release"),  # the streamed models' blocks come and go inside their stage
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
