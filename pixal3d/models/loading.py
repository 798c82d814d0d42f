"""Checkpoints are a contract: build on ``meta``, load strictly, keep the reference dtype placement.

A checkpoint is a pair ``<stem>.json`` (``{"name": <class>, "args": {...}}``) and
``<stem>.safetensors``. ``build_model`` turns the json into a module on the ``meta`` device whose
parameters already carry the reference dtype placement (bf16 block weights, fp32 norms, ...);
``load_model`` then reads every tensor straight onto the target device, casts it to the dtype of the
parameter it replaces and assigns it (``load_state_dict(assign=True, strict=True)``): no random
initialisation, no CPU copy on the way to the device. Any missing, unexpected or mis-shaped key is one
``CheckpointError`` naming the file and the keys.

Model classes register under the class names that checkpoint json files use::

    @register_model("SLatFlowModel", "ElasticSLatFlowModel")
    class SLatFlowModel(nn.Module):
        training_only_args = ("initialization", "use_checkpoint")  # accepted, ignored
"""
from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from pixal3d.files import atomic_path, write_json_atomic
from pixal3d.staging.safetensors_header import (
    SafetensorsHeaderError,
    read_safetensors_header,
)
from pixal3d.staging.stream import (
    REFETCH,
    FileSlice,
    WeightStream,
    file_slices,
    stream_model,
)

logger = logging.getLogger(__name__)

MODEL_CLASSES: dict[str, type[nn.Module]] = {}


class CheckpointError(RuntimeError):
    """A checkpoint does not match the network it is loaded into (or cannot be read)."""


def register_model(*names: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator: make ``build_model({"name": n, ...})`` construct this class for each ``n``."""
    def decorate(cls: type[nn.Module]) -> type[nn.Module]:
        for name in names or (cls.__name__,):
            if name in MODEL_CLASSES and MODEL_CLASSES[name] is not cls:
                raise ValueError(f"model name {name!r} registered twice "
                                 f"({MODEL_CLASSES[name].__qualname__} and {cls.__qualname__})")
            MODEL_CLASSES[name] = cls
        return cls
    return decorate


def constructor_args(cls: type[nn.Module], args: Mapping[str, Any], *, source: str = "config") -> dict[str, Any]:
    """Validate ``args`` against ``cls.__init__``: drop declared training-only ones, reject the rest."""
    params = inspect.signature(cls.__init__).parameters
    accepted = {k for k, p in params.items() if k != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    ignored = set(getattr(cls, "training_only_args", ()))
    kept, dropped, unknown = {}, [], []
    for key, value in args.items():
        if key in accepted:
            kept[key] = value
        elif key in ignored:
            dropped.append(key)
        else:
            unknown.append(key)
    if dropped:
        logger.debug("%s: ignoring training-only arguments %s of %s", source, sorted(dropped), cls.__name__)
    if unknown:
        raise CheckpointError(f"{source}: unknown argument(s) {sorted(unknown)} for {cls.__name__}; "
                              f"accepted: {sorted(accepted)}")
    missing = [k for k, p in params.items()
               if k in accepted and p.default is inspect.Parameter.empty and k not in kept]
    if missing:
        raise CheckpointError(f"{source}: missing required argument(s) {missing} for {cls.__name__}")
    return kept


def build_model(spec: Mapping[str, Any], *, device: torch.device | str = "meta", source: str = "config") -> nn.Module:
    """Construct the network described by ``{"name": ..., "args": {...}}`` on ``device`` (default meta)."""
    name = spec.get("name")
    if name not in MODEL_CLASSES:
        raise CheckpointError(f"{source}: unknown model class {name!r}; known: {sorted(MODEL_CLASSES)}")
    cls = MODEL_CLASSES[name]
    kwargs = constructor_args(cls, spec.get("args", {}), source=source)
    with torch.device(device):
        return cls(**kwargs)


def read_spec(json_path: str | Path) -> dict[str, Any]:
    """Read a checkpoint's ``{name, args}`` json with a clear error when it is missing or malformed."""
    path = Path(json_path)
    try:
        spec = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint config {path} does not exist") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"checkpoint config {path} is not valid JSON: {err}") from None
    if not isinstance(spec, dict) or "name" not in spec:
        raise CheckpointError(f"checkpoint config {path} must be an object with 'name' and 'args'")
    return spec


def _open(path: Path, device: torch.device | str):
    try:
        return safe_open(str(path), framework="pt", device=str(torch.device(device)))
    except FileNotFoundError:
        raise CheckpointError(f"weights file {path} does not exist") from None
    except Exception as err:  # safetensors raises its own error types for truncated/corrupt headers
        raise CheckpointError(f"weights file {path} is not a readable safetensors file ({err}); {REFETCH}"
                              ) from None


def _check_keys(f: Any, path: Path, model: nn.Module, expected: Mapping[str, torch.Tensor],
                names: Mapping[str, str] | None = None) -> None:
    """Every key of ``expected`` in the file with its shape, and nothing else: one ``CheckpointError`` if not.
    ``names``: the model's key -> the file's, where they differ (``stream_safetensors``'s ``module_key``)."""
    names = names if names is not None else {k: k for k in f.keys()}
    keys = set(names)
    missing = sorted(set(expected) - keys)
    unexpected = sorted(keys - set(expected))
    mismatched = []
    for key in sorted(keys & set(expected)):
        shape = tuple(f.get_slice(names[key]).get_shape())
        if shape != tuple(expected[key].shape):
            mismatched.append(f"{key}: file {list(shape)} vs model {list(expected[key].shape)}")
    if missing or unexpected or mismatched:
        lines = [f"{path} does not match {type(model).__name__}:"]
        for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched)):
            if items:
                shown = ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")
                lines.append(f"  {label}: {shown}")
        raise CheckpointError("\n".join(lines))


def _get(f: Any, path: Path, key: str) -> torch.Tensor:
    try:
        return f.get_tensor(key)
    except Exception as err:
        raise CheckpointError(f"weights file {path} is truncated or corrupt at tensor {key!r} ({err}); "
                              f"{REFETCH}") from None


def _check_loaded(model: nn.Module, path: Path, streamed: set[str] = frozenset()) -> nn.Module:
    leftover = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta and n not in streamed]
    if leftover:
        raise CheckpointError(f"{path}: tensors left on meta after loading {type(model).__name__}: {leftover[:8]} "
                              f"(a model must not hold buffers that are neither stored nor derived on the fly)")
    return model.eval().requires_grad_(False)


def load_state_into(model: nn.Module, weights_path: str | Path, *, device: torch.device | str,
                    reference: nn.Module | None = None) -> nn.Module:
    """Strictly fill a meta-built ``model`` from a safetensors file, tensors created on ``device``.

    ``reference``: when ``model`` holds only part of a network (a pipeline shard, pixal3d.parallel),
    the whole network (on meta): the file must match it key for key and shape for shape, and only the
    tensors ``model`` holds are read."""
    path = Path(weights_path)
    expected = dict((model if reference is None else reference).state_dict(keep_vars=True).items())
    wanted = dict(model.state_dict(keep_vars=True).items())
    state: dict[str, torch.Tensor] = {}
    with _open(path, device) as f:
        _check_keys(f, path, model, expected)
        for key in sorted(wanted):
            state[key] = _get(f, path, key).to(wanted[key].dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return _check_loaded(model, path)


def load_streamed(stem: str | Path, stream: WeightStream, *, pin: bool = False) -> nn.Module:
    """``load_model`` for the ``stream`` policy: the model's streamed lists (its ``stream_lists``, the flow
    transformers' blocks, the decoders' stages) stay on ``meta`` and are streamed to ``stream``'s device one block
    at a time (``stream_safetensors``); everything else loads onto the device as ``load_model`` loads it."""
    stem = Path(stem)
    spec = read_spec(stem.with_suffix(".json"))
    model = build_model(spec, device="meta", source=str(stem.with_suffix(".json")))
    lists = tuple(getattr(model, "stream_lists", ()))
    if not lists:
        raise CheckpointError(f"{type(model).__name__} names no stream_lists: it cannot be streamed")
    return stream_safetensors(model, stem.with_suffix(".safetensors"), lists, stream, pin=pin)


def stream_safetensors(model: nn.Module, path: str | Path, lists: tuple[str, ...], stream: WeightStream, *,
                       pin: bool = False, module_key: Callable[[str], str] | None = None) -> nn.Module:
    """Fill a meta-built ``model`` from the safetensors file at ``path``, the children of the ``ModuleList``s at
    ``lists`` streamed to ``stream``'s device one block at a time, read from the file into each block's buffer
    (``FileSlice``; through a memory map on MPS and on the CPU's zero-copy path; ``pin``: from pinned host copies
    made now, for CUDA when host memory has room); everything else loaded onto the device as ``load_model`` loads
    it. ``module_key``: a file's tensor name -> the model's (a checkpoint saved under older names: DINOv3's
    ``layer.N`` for transformers 5's ``model.layer.N``). The same keys and shapes are checked."""
    path = Path(path)
    expected = dict(model.state_dict(keep_vars=True).items())
    prefixes = tuple(f"{name}." for name in lists)
    state: dict[str, torch.Tensor] = {}
    sources: dict[str, torch.Tensor | FileSlice] = {}
    slices = None
    if stream.reads_files or pin:
        try:
            header = read_safetensors_header(path)
        except SafetensorsHeaderError as err:  # cut short or changed since the plan read its header
            raise CheckpointError(f"{err}; {REFETCH}") from None
        slices = file_slices(path, header.tensors, header.header_bytes)
    with _open(path, "cpu") as f:
        names = {(module_key or str)(k): k for k in f.keys()}  # the model's key -> the file's
        _check_keys(f, path, model, expected, names)
        for key in sorted(expected):
            stored = names[key]
            if key.startswith(prefixes):
                if slices is None:
                    sources[key] = _get(f, path, stored)  # memory-mapped: a block's pages are read when first used
                elif pin:
                    sources[key] = slices[stored].read().pin_memory()
                else:
                    sources[key] = slices[stored]
            else:
                tensor = _get(f, path, stored)
                value = tensor.to(stream.device, expected[key].dtype)
                state[key] = value.clone() if stream.copy and value.data_ptr() == tensor.data_ptr() else value
    model.load_state_dict(state, strict=False, assign=True)
    stream_model(model, lists, sources, stream)
    return _check_loaded(model, path, set(sources))


def in_process_memory(model: nn.Module) -> nn.Module:
    """``model`` with every tensor copied into fresh process memory (off the memory-mapped file a CPU load leaves
    it on), as a load onto a device copies it: ``runtime.cpu_weights: copied``. Tensors sharing a storage stay
    shared."""
    copies: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, tensor in table.items():
                if tensor is None or tensor.is_meta:
                    continue
                if id(tensor) not in copies:
                    copy = tensor.detach().clone()
                    copies[id(tensor)] = nn.Parameter(copy, requires_grad=tensor.requires_grad) \
                        if isinstance(tensor, nn.Parameter) else copy
                table[key] = copies[id(tensor)]
    return model


def load_model(stem: str | Path, *, device: torch.device | str = "cpu") -> nn.Module:
    """Load ``<stem>.json`` + ``<stem>.safetensors`` onto ``device`` with the reference dtype placement."""
    stem = Path(stem)
    spec = read_spec(stem.with_suffix(".json"))
    model = build_model(spec, device="meta", source=str(stem.with_suffix(".json")))
    return load_state_into(model, stem.with_suffix(".safetensors"), device=device)


def save_model(model: nn.Module, spec: Mapping[str, Any], stem: str | Path, *,
               dtype: torch.dtype | None = None) -> None:
    """Write ``<stem>.json`` and ``<stem>.safetensors`` (optionally every tensor cast to ``dtype``,
    as the published files store them: bf16 flows, fp16 decoders)."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if dtype is not None else v).detach().contiguous().cpu()
             for k, v in model.state_dict().items()}
    with atomic_path(stem.with_suffix(".safetensors")) as tmp:
        save_file(state, str(tmp))
    write_json_atomic(stem.with_suffix(".json"), dict(spec))
