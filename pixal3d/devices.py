"""What the code needs to know about a kind of device, in one place: the kinds a run may use (CPU, CUDA, MPS), which
one a process takes by default, whether one exists here, and the facts a run decides by — each a field of ``Kind``,
so that a new kind of device (or a new fact about one) is a row here, not a ``device.type == ...`` branch in the
attention, the camera, the plan and the parallel runtime. (``pixal3d.staging`` keeps its own few: it imports nothing
from the rest of the package, so that another pipeline can use it.)

    kind("mps").fp32_attention      # True: MPS's half-precision softmax loses accuracy over long keys
    check_device(torch.device("cuda:3"))   # DeviceError: this machine has 1 CUDA device(s), cuda:0 to cuda:0
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .audit.limits import MPSGRAPH_ARRAY_BYTES


class DeviceError(ValueError):
    """The device asked for does not exist on this machine (or this torch build)."""


@dataclass(frozen=True)
class Kind:
    """One kind of device (``torch.device.type``) and what a run decides by it.

    available:      whether this machine and torch build have one
    missing:        what to say when it is asked for and not available
    indexed:        there may be several (``cuda:0``, ``cuda:1``); the others have one, ``<kind>`` or ``<kind>:0``
    backend:        torch.distributed's backend between ranks on it (``nccl`` for CUDA, ``gloo`` otherwise)
    fused_attention: SDPA's fused kernels stream long key sequences: no query chunks needed (CUDA)
    fp32_attention: the ``auto`` attention route is ``fp32_chunked`` (MPS: its half-precision softmax loses accuracy)
    array_bytes:    the largest single tensor it takes (MPSGraph: ``2**32`` bytes), None: no such limit
    half_default:   a model whose precision is ``auto`` runs under float16 autocast (not on the CPU, whose float16
                    kernels are emulated)
    memory_limit:   an allocator limit that can let memory swap, checked and lowered by the plan (MPS)
    wire_tensors:   its backend carries tensors on this device (NCCL: CUDA tensors); else they travel through host
                    memory (gloo carries CPU tensors only)
    threaded_waits: its backend's works are waited for in a thread, with the job's timeout (gloo's); NCCL's are
                    waited for on the stream
    live_context:   whether this process holds a live context of it, which a forked child cannot use (CUDA's)
    host_heap:      its tensors live in the process's heap (the CPU), whose freed pages glibc keeps until
                    ``release_freed_heap`` gives them back
    banded_convs:   its convolutions were checked to give a row's bits over row bands (the CPU's): MoGe-2's conv
                    neck and heads may run banded under a budget there; elsewhere (kernels chosen by size) whole
    """

    name: str
    available: Callable[[], bool]
    missing: str = ""
    indexed: bool = False
    backend: str = "gloo"
    fused_attention: bool = False
    fp32_attention: bool = False
    array_bytes: int | None = None
    half_default: bool = True
    memory_limit: bool = False
    wire_tensors: bool = False
    threaded_waits: bool = True
    live_context: Callable[[], bool] = lambda: False
    host_heap: bool = False
    banded_convs: bool = False


KINDS: dict[str, Kind] = {
    "cuda": Kind("cuda", lambda: torch.cuda.is_available(), "asks for CUDA, which this torch build or machine does "
                 "not have; use cpu", indexed=True, backend="nccl", fused_attention=True, wire_tensors=True,
                 threaded_waits=False, live_context=lambda: torch.cuda.is_available() and torch.cuda.is_initialized()),
    "mps": Kind("mps", lambda: torch.backends.mps.is_available(), "asks for Apple MPS, which is not available here; "
                "use cpu", fp32_attention=True, array_bytes=MPSGRAPH_ARRAY_BYTES, memory_limit=True),
    "cpu": Kind("cpu", lambda: True, half_default=False, host_heap=True, banded_convs=True),
}
"""The kinds of device a run may use, in the order a process prefers them (``default_device``)."""
OTHER = Kind("other", lambda: False)
"""Any other device type (``meta``, the audit's stand-in): what the code assumes of a device it does not know."""


def forks_safely() -> bool:
    """Whether this process can fork a child that uses torch: no kind of device holds a live context here."""
    return not any(k.live_context() for k in KINDS.values())


def kind(device: torch.device | str) -> Kind:
    """The ``Kind`` of ``device`` (``OTHER`` for a type a run does not use, such as ``meta``)."""
    return KINDS.get(torch.device(device).type, OTHER)


def default_device(kinds: Sequence[str] = tuple(KINDS), local_rank: int | None = None) -> torch.device:
    """The first kind of ``kinds`` this machine has (default: CUDA, else MPS, else the CPU); CUDA as
    ``cuda:<local_rank>`` when a rank's is asked for."""
    for name in kinds:
        if KINDS[name].available():
            return torch.device(name, local_rank) if name == "cuda" and local_rank is not None else torch.device(name)
    return torch.device("cpu")


def check_device(device: torch.device) -> torch.device:
    """``device`` if it exists here, else a ``DeviceError`` naming it and what exists."""
    found = KINDS.get(device.type)
    if found is None:
        raise DeviceError(f"device {device}: only {', '.join(sorted(KINDS))} are supported")
    if not found.available():
        raise DeviceError(f"device {device} {found.missing}")
    if found.indexed:
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceError(f"device {device} does not exist: this machine has {count} CUDA device(s), "
                              f"cuda:0 to cuda:{count - 1}")
    elif device.index not in (None, 0):
        raise DeviceError(f"device {device} does not exist: there is one {device.type} device, "
                          f"'{device.type}' (or {device.type}:0)")
    return device


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """A rank's device under torchrun: an indexed kind without an index (``cuda``) becomes ``cuda:<local rank>``
    (one GPU per process); the others are shared by the machine's ranks as they are."""
    if kind(device).indexed and device.index is None:
        return torch.device(device.type, local_rank)
    return device
