"""Park an idle model in (pinned) host memory and bring it back: the ``offload`` policy's mechanism.

Only worth doing on a discrete GPU, where host RAM is a second pool and copying back over PCIe
is faster than reading from disk. On unified memory the host *is* the device: parking frees
nothing, which is why the policy refuses ``offload`` there.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .release import tensor_slots


def _move(module: nn.Module, convert: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """Apply ``convert`` to every tensor the module tree holds; return bytes of the storages moved.

    Parameters keep their identity (``param.data`` is swapped), so tied weights stay tied; a tensor
    object seen twice is converted once. Views of one storage are copied separately.
    """
    done: set[int] = set()
    moved: set[tuple[str, int]] = set()
    nbytes = 0
    for sub in module.modules():
        for table, key, tensor in list(tensor_slots(sub)):
            if id(tensor) in done:
                continue
            done.add(id(tensor))
            new = convert(tensor.detach())
            if new.device == tensor.device:
                continue
            skey = (str(tensor.device), tensor.untyped_storage().data_ptr())
            if skey not in moved:
                moved.add(skey)
                nbytes += tensor.untyped_storage().nbytes()
            if isinstance(tensor, nn.Parameter):
                tensor.data = new
            else:
                table[key] = new
    return nbytes


def model_device(module: nn.Module) -> torch.device:
    """The device of the module's first parameter or buffer (CPU for a module without tensors)."""
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")


def park(module: nn.Module, *, pin_memory: bool | None = None) -> tuple[torch.device, int]:
    """Copy the module's tensors to host memory (pinned when CUDA is available); return (origin, bytes moved).

    ``origin`` is the device to pass to ``unpark``. A module already on the CPU moves nothing.
    """
    origin = model_device(module)
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory

    def to_host(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu" or t.device.type == "meta":
            return t
        host = t.to("cpu")
        return host.pin_memory() if pin else host

    return origin, _move(module, to_host)


def unpark(module: nn.Module, device: torch.device | str) -> int:
    """Move a parked module's tensors back to ``device``; return bytes moved."""
    device = torch.device(device)

    def to_device(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "meta" or t.device == device:
            return t
        return t.to(device, non_blocking=t.is_pinned())

    nbytes = _move(module, to_device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return nbytes
