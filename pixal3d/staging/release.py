"""Release a module's weights to the ``meta`` device so the memory really goes back.

After ``release`` the module object is still valid (its structure, names and shapes are intact)
but holds no data: every parameter, buffer and plain tensor attribute lives on ``meta``. Calling
it raises ``ReleasedModuleError``; the only way back is a fresh load through the registry.
"""
from __future__ import annotations

import gc
import inspect
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .stream import release_streams

logger = logging.getLogger(__name__)

_MARK = "_staging_released"


class ReleasedModuleError(RuntimeError):
    """A released module was called: its weights are gone."""

    def __init__(self, name: str | None, stage: str | None, method: str = "forward") -> None:
        self.name = name
        self.stage = stage
        label = f"Model {name!r}" if name else "This module"
        where = f" when the run entered stage {stage!r}" if stage else ""
        super().__init__(
            f"{label} was released{where} (its weights were moved to the meta device), so "
            f"{method}() cannot run. Get it back from the StagedModels registry "
            f"(models[{name or '<name>'!r}] reloads it) instead of keeping a reference to the "
            f"released module, or list it in the stage's needs so it is not released."
        )


@dataclass(frozen=True)
class ReleaseInfo:
    """Who released a module: the model name and the stage being entered."""

    name: str | None
    stage: str | None


def is_released(module: nn.Module) -> bool:
    """True if ``release`` has moved this module's weights to meta."""
    return getattr(module, _MARK, None) is not None


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


def tensor_slots(module: nn.Module) -> Iterator[tuple[dict, str, torch.Tensor]]:
    """Every (table, key, tensor) this module itself holds: parameters, buffers, tensor attributes."""
    for table in (module._parameters, module._buffers):
        for key, tensor in table.items():
            if tensor is not None:
                yield table, key, tensor
    attrs = vars(module)
    for key, value in attrs.items():
        if isinstance(value, torch.Tensor):
            yield attrs, key, value


def module_nbytes(module: nn.Module) -> int:
    """Bytes of the distinct non-meta storages behind the module's tensors (shared storage counted once)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for sub in module.modules():
        for _, _, tensor in tensor_slots(sub):
            if tensor.device.type == "meta":
                continue
            key = _storage_key(tensor)
            if key not in seen:
                seen.add(key)
                total += tensor.untyped_storage().nbytes()
    return total


def empty_device_cache() -> None:
    """Return cached blocks of the CUDA / MPS allocators to the driver, where a backend is in use."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if torch.backends.mps.is_available():
        torch.mps.empty_cache()


def _raiser(info: ReleaseInfo, method: str):
    def released(*args, **kwargs):
        raise ReleasedModuleError(info.name, info.stage, method)

    released.__name__ = method
    return released


def _guarded_methods(module: nn.Module) -> list[str]:
    """Public methods the module's own classes define (up to nn.Module), plus ``forward``."""
    names = {"forward"}
    for klass in type(module).__mro__:
        if klass is nn.Module or not issubclass(klass, nn.Module):
            break
        for key, value in vars(klass).items():
            if not key.startswith("_") and inspect.isfunction(value) and key != "extra_repr":
                names.add(key)
    return sorted(names)


def release(
    module: nn.Module,
    *,
    name: str | None = None,
    stage: str | None = None,
    keep: Iterable[nn.Module] = (),
    empty_cache: bool = True,
    collect: bool = True,
) -> int:
    """Move every parameter, buffer and tensor attribute of ``module`` to ``meta``; return bytes freed.

    Storage shared between tensors (tied weights, views) is counted once. Submodules that belong to
    a module in ``keep``, and any tensor whose storage a ``keep`` module also uses, are left alone.
    The module's ``forward`` and its own public methods then raise ``ReleasedModuleError``. Runs
    ``gc.collect()`` (when ``collect``; a caller releasing several modules at once collects once
    itself, since one full collection costs ~0.5 s in a process with transformers imported) and
    empties the CUDA/MPS caching allocator (when ``empty_cache``). Releasing twice frees 0 bytes the
    second time.
    """
    keep = [k for k in keep if k is not module]
    release_streams(module)  # a streamed model's blocks in flight go with it
    kept_modules = {id(sub) for k in keep for sub in k.modules()}
    kept_storage = {
        _storage_key(t)
        for k in keep
        for sub in k.modules()
        for _, _, t in tensor_slots(sub)
        if t.device.type != "meta" and t.untyped_storage().nbytes() > 0  # empty ones share data_ptr 0
    }
    info = ReleaseInfo(name, stage)
    freed: set[tuple[str, int]] = set()
    nbytes = 0
    kept = 0
    for sub in module.modules():
        if id(sub) in kept_modules:
            continue
        for table, key, tensor in list(tensor_slots(sub)):
            if tensor.device.type == "meta":
                continue
            skey = _storage_key(tensor)
            if skey in kept_storage:
                kept += 1
                continue
            if skey not in freed:
                freed.add(skey)
                nbytes += tensor.untyped_storage().nbytes()
            meta = tensor.detach().to("meta")
            if isinstance(tensor, nn.Parameter):
                meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
            table[key] = meta
        if not is_released(sub):
            methods = _guarded_methods(sub) if sub is module else ["forward"]
            for method in methods:
                object.__setattr__(sub, method, _raiser(info, method))
            object.__setattr__(sub, _MARK, info)
    if collect:
        gc.collect()
    if empty_cache:
        empty_device_cache()
    logger.debug("released %s at stage %s: %d bytes freed, %d tensors kept", name, stage, nbytes, kept)
    return nbytes
