"""A stand-in accelerator on a CPU-only machine: code runs as if on a device, every op is observed.

Why: to learn which ops a run sends to ``mps`` without a Mac, the run must place its tensors as it
would on one — weights and activations on the device, the noise drawn on the CPU generator, the
export's arrays on the CPU — and an audit must see which side each op runs on. On a CPU-only run
both sides are ``cpu``, and ``x.to(device)`` is a no-op nobody can observe.

So the run is given ``STANDIN`` (``meta:1``) as its device. A tensor "on" it is a ``StandInTensor``:
a wrapper whose metadata says ``meta:1`` and whose data is an ordinary CPU tensor (``.inner``).
``StandInMode`` (a ``TorchDispatchMode``) sees every ATen op once composite-implicit ops have
decomposed, runs it on the inner CPU tensors, and wraps the results again when the op ran on the
stand-in device: an op with a stand-in input, or one that creates a tensor with ``device=STANDIN``
(factories, ``.to(device)``). ``.cpu()`` / ``.to("cpu")`` give plain CPU tensors, exactly where a
Mac run copies back to the host. Values are the CPU's.

Why ``meta:1``: the run's device must be one this torch build accepts wherever C++ handles a device
(device guards in indexing, attention, ``.to``), and ``mps`` is not compiled into a Linux build.
``meta`` is, and index 1 keeps the stand-in apart from the plain ``meta`` device that models are
built on and released to. Consequence: code asking ``device.type == "meta"``
(``pixal3d.staging.release``) takes a stand-in tensor for a released one.

Each op becomes one ``OpCall`` handed to ``on_op``. ``expand(op)`` may name a composite dispatch key
for a device op: its composite kernel then runs under the mode, so the ops it calls are observed
(as device ops) too.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Self

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

STANDIN = torch.device("meta", 1)
CPU = torch.device("cpu")

# Ops that take host tensors into a device op by design: copies across devices, and advanced
# indexing (ATen moves CPU index tensors to the indexed tensor's device).
CROSS_DEVICE_OPS = frozenset({
    "aten::_to_copy", "aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize",
    "aten::index.Tensor", "aten::index_put_", "aten::_index_put_impl_", "aten::index_put",
})


class StandInTensor(torch.Tensor):
    """A tensor on the stand-in device: metadata says ``meta:1``, ``inner`` holds the CPU data."""

    inner: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Self:
        out = torch.Tensor._make_wrapper_subclass(
            cls, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, layout=inner.layout, device=STANDIN, requires_grad=inner.requires_grad)
        out.inner = inner
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} got a stand-in device tensor outside StandInMode: stand-in tensors only "
                           f"compute inside `with standin_mode(...)`; move results to the CPU (.cpu()) first")

    def __repr__(self) -> str:  # the default repr would print through ops on the meta device
        return f"StandInTensor({self.inner!r})"

    def tolist(self) -> Any:  # Tensor.tolist refuses subclasses; a device tensor copies to the host first
        return self.cpu().tolist()

    def new_tensor(self, data: Any, *, dtype: torch.dtype | None = None, **kwargs: Any) -> torch.Tensor:
        # Tensor.new_tensor copies to self's device inside C++ (a data-less meta tensor here)
        device = kwargs.pop("device", STANDIN)
        return torch.tensor(data, dtype=dtype or self.dtype, **kwargs).to(device)

    def numpy(self, *, force: bool = False) -> Any:
        raise TypeError(f"can't convert {self.device} device type tensor to numpy (the stand-in device is not "
                        f"the host, as mps is not). Use Tensor.cpu() to copy the tensor to host memory first.")


@dataclass(frozen=True)
class OpCall:
    """One ATen op as observed: which side ran it and the dtypes of its tensors."""

    op: str                                   # "aten::add.Tensor"; the default overload bare: "aten::zeros"
    side: str                                 # "device" (a stand-in tensor in or out), "host" (CPU), "meta"
    dtypes: tuple[torch.dtype, ...]           # of its tensors on that side: arguments, then results
    host_inputs: bool = False                 # a device op also took a non-scalar CPU tensor
    expanded: bool = False                    # its composite kernel ran under the mode (callees observed)

    @property
    def on_device(self) -> bool:
        return self.side == "device"


def _leaves(args: tuple, kwargs: dict) -> list:
    """ATen arguments, one level of lists unpacked (``Tensor[]``, ``int[]`` are the only nesting)."""
    out: list = []
    for x in (*args, *kwargs.values()):
        if isinstance(x, (list, tuple)):
            out.extend(x)
        else:
            out.append(x)
    return out


def _map_args(fn: Callable[[Any], Any], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def one(x: Any) -> Any:
        return type(x)(fn(v) for v in x) if isinstance(x, (list, tuple)) else fn(x)

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _results(out: Any) -> list:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _unwrap(x: Any) -> Any:
    if isinstance(x, StandInTensor):
        return x.inner
    if isinstance(x, torch.device) and x == STANDIN:
        return CPU
    return x


def _side(tensors: list) -> str:
    return "meta" if tensors and all(x.device.type == "meta" for x in tensors) else "host"


class StandInMode(TorchDispatchMode):
    """Runs every op on the CPU, keeps stand-in placement, reports each op to ``on_op``.

    on_op:  called with one ``OpCall`` per op (a composite op after the ops its kernel called)
    expand: op name → ``torch._C.DispatchKey`` of a composite kernel to run under the mode for a
            device op (its callees are then observed), or None to run the op as it is
    """

    def __init__(self, on_op: Callable[[OpCall], None], expand: Callable[[str], Any] | None = None):
        super().__init__()
        self.on_op = on_op
        self.expand = expand
        self._expanding: list[str] = []  # composite ops whose kernels are running under the mode
        self._host_ids: set[int] = set()  # host tensors handed to the device op being expanded

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name()
        if self._expanding:  # inside a device op's composite kernel: CPU tensors, every op a device op
            return self._callee(func, name, args, kwargs)
        leaves = _leaves(args, kwargs)
        _refuse_dataless(name, leaves)
        devices = [x for x in leaves if isinstance(x, torch.device)]
        to_standin = any(d == STANDIN for d in devices)
        on_device = to_standin or any(isinstance(x, StandInTensor) for x in leaves)
        if not on_device:
            out = func(*args, **kwargs)
            tensors = [x for x in (*leaves, *_results(out)) if isinstance(x, torch.Tensor)]
            self.on_op(OpCall(name, _side(tensors), tuple(x.dtype for x in tensors)))
            return out
        inner_args, inner_kwargs = _map_args(_unwrap, args, kwargs)
        key = self._expand_key(name)
        if key is None:
            out = func(*inner_args, **inner_kwargs)
        else:
            self._host_ids = {id(x) for x in leaves if isinstance(x, torch.Tensor) and not isinstance(x, StandInTensor)}
            try:
                out = self._run_composite(func, name, key, inner_args, inner_kwargs)
            finally:
                self._host_ids = set()
        if func._schema.is_mutable:
            _check_metadata(name, leaves)
        wrap = to_standin if devices else True  # an explicit device decides; else the stand-in inputs do
        result = _rewrap(out, leaves, wrap)
        host = name not in CROSS_DEVICE_OPS and any(
            isinstance(x, torch.Tensor) and not isinstance(x, StandInTensor) and x.device.type == "cpu" and x.dim() > 0
            for x in leaves)
        dtypes = tuple(x.dtype for x in (*leaves, *_results(result)) if isinstance(x, StandInTensor))
        self.on_op(OpCall(name, "device", dtypes, host, key is not None))
        return result

    def _callee(self, func, name: str, args: tuple, kwargs: dict) -> Any:
        """An op a device op's composite kernel calls (on the inner CPU tensors): a device op too, its
        tensors device tensors except the host tensors the outer op was given."""
        args, kwargs = _numbers_as_tensors(func, args, kwargs)
        key = self._expand_key(name)
        out = func(*args, **kwargs) if key is None else self._run_composite(func, name, key, args, kwargs)
        dtypes = tuple(x.dtype for x in (*_leaves(args, kwargs), *_results(out))
                       if isinstance(x, torch.Tensor) and id(x) not in self._host_ids)
        self.on_op(OpCall(name, "device", dtypes, expanded=key is not None))
        return out

    def _expand_key(self, name: str) -> Any:
        if self.expand is None or name in self._expanding:  # a kernel calling its own op runs it plainly
            return None
        return self.expand(name)

    def _run_composite(self, func, name: str, key: Any, args: tuple, kwargs: dict) -> Any:
        """Run ``func``'s composite kernel on CPU tensors with this mode active, so its callees are seen."""
        self._expanding.append(name)
        try:
            with self:
                return func._op_dk(key, *args, **kwargs)
        finally:
            self._expanding.pop()


def _rewrap(out: Any, leaves: list, wrap: bool) -> Any:
    """Results computed on inner tensors, in the caller's terms: an in-place result is the caller's
    own argument; a new CPU tensor becomes a stand-in tensor when ``wrap``."""
    originals = {id(x.inner): x for x in leaves if isinstance(x, StandInTensor)}
    originals.update({id(x): x for x in leaves if isinstance(x, torch.Tensor) and not isinstance(x, StandInTensor)})

    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) in originals:
            return originals[id(x)]
        return StandInTensor(x) if wrap and x.device.type == "cpu" else x

    return type(out)(one(x) for x in out) if isinstance(out, (list, tuple)) else one(out)


def _numbers_as_tensors(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A composite kernel's scalar, wrapped into a tensor in C++, reaches Python as a number; give a
    ``Tensor`` parameter its 0-dim tensor back (default float dtype for a float, as a wrapped number)."""
    def fix(value: Any, param: Any) -> Any:
        if isinstance(param.type, torch._C.TensorType) and isinstance(value, (bool, int, float, complex)):
            return torch.tensor(value, dtype=torch.get_default_dtype() if isinstance(value, float) else None)
        return value

    params = func._schema.arguments
    args = tuple(fix(a, p) for a, p in zip(args, params)) + tuple(args[len(params):])
    by_name = {p.name: p for p in params}
    return args, {k: (fix(v, by_name[k]) if k in by_name else v) for k, v in kwargs.items()}


def _refuse_dataless(name: str, leaves: list) -> None:
    """A plain tensor on ``meta:1`` was made behind the mode's back (it has no data): say how."""
    for x in leaves:
        if isinstance(x, torch.Tensor) and not isinstance(x, StandInTensor) and x.device == STANDIN:
            raise RuntimeError(f"{name} got a tensor on the stand-in device {STANDIN} that holds no data: it was "
                               f"made by a constructor that copies to the device inside C++ (as "
                               f"torch.tensor(..., device=...) does); create it on the CPU and move it with .to()")


def _check_metadata(name: str, leaves: list) -> None:
    """A wrapper's shape is fixed when it is made: an op that resizes a stand-in tensor in place is refused."""
    for x in leaves:
        if isinstance(x, StandInTensor) and (x.shape != x.inner.shape or x.stride() != x.inner.stride()):
            raise NotImplementedError(f"{name} changed the shape or strides of a stand-in tensor in place "
                                      f"({tuple(x.shape)} -> {tuple(x.inner.shape)}); the stand-in device cannot "
                                      f"follow that: write the result to a new tensor instead")


def to_standin(module: nn.Module) -> nn.Module:
    """``module.to(STANDIN)`` (inside ``standin_mode``): its weights now live on the stand-in device."""
    return module.to(STANDIN)


def _standin_aware(constructor: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``torch.tensor``-like ``constructor`` that builds on the CPU, then copies to the stand-in device.

    ``torch.tensor(data, device=d)`` copies to ``d`` inside C++ with no op the mode could see, so for
    ``d == STANDIN`` it would make a data-less meta tensor; going through ``.to`` makes it the copy it
    is on a Mac (host data → device)."""

    def build(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device is not None and torch.device(device) == STANDIN:
            return constructor(data, *args, **kwargs).to(STANDIN)
        return constructor(data, *args, device=device, **kwargs)

    build.__wrapped__ = constructor
    return build


@contextmanager
def _standin_constructors() -> Iterator[None]:
    """``torch.tensor`` and ``torch.as_tensor`` learn the stand-in device for the scope (restored after)."""
    saved = torch.tensor, torch.as_tensor
    torch.tensor, torch.as_tensor = _standin_aware(saved[0]), _standin_aware(saved[1])
    try:
        yield
    finally:
        torch.tensor, torch.as_tensor = saved


@contextmanager
def standin_mode(on_op: Callable[[OpCall], None], expand: Callable[[str], Any] | None = None) -> Iterator[StandInMode]:
    """``with standin_mode(on_op): ...`` — the scope in which stand-in tensors compute."""
    mode = StandInMode(on_op, expand)
    with _standin_constructors(), mode:
        yield mode
