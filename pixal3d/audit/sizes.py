"""The audit at real sizes: every device op of published-size models at the reference's counts, run on
``meta`` tensors (shapes and dtypes, no data, no compute), its largest tensor judged against the MPS
limits of ``pixal3d.audit.limits``.

How: the models are built on ``meta`` and called with ``meta`` inputs of the real sizes inside
``real_size_audit()``. A ``TorchDispatchMode`` sees every ATen op once composite-implicit ops have
decomposed; an op with a ``meta`` tensor is a device op (the ``meta`` tensors stand for the Mac's ``mps``
ones), and is recorded with its tensors and checked. Ops on host (CPU) tensors run as they are.

Data-dependent ops cannot run on ``meta``; ``SizeOracle`` stands in for their data with the counts the
reference implies, stated up front: ``nonzero`` keeps ``nonzero_fraction`` of its elements (the decoders'
subdivision keeps ``growth / 8`` of the children: 4.6 voxels per voxel per level), ``unique`` keeps
``unique_fraction`` of its rows, a scalar read (``.item()``) is 0, a copy to the host is zeros. So the
sizes downstream of those ops are the reference's typical ones, not one image's.

Attention: a ``scaled_dot_product_attention`` call is recorded as what torch 2.13 runs for it on mps
(``SdpaDispatch``): PyTorch hands contiguous q/k/v without grad or dropout to its MPS kernel
(``_scaled_dot_product_attention_math_for_mps``, which materialises the ``[B, H, Lq, Lk]`` scores in the
query dtype — torch 2.13's own meta function for it allocates exactly that), and anything else to the
composite math path, whose ops the dispatch mode then records one by one (on mps as on the CPU).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .limits import MPS_LIMITS, MPS_SDPA_OP, Call, Limit, TensorInfo, short, violations
from .mps import short_dtype

logger = logging.getLogger(__name__)


class MpsLimitError(RuntimeError):
    """An op at real size would break an MPS limit: names each op, its largest tensor, the limit, the source."""

    def __init__(self, rows: list[SizeRow]):
        self.rows = rows
        lines = [f"  {r.op} [{', '.join(r.dtypes)}] in {', '.join(r.cases)}: " +
                 "; ".join(f"{name}: {what}" for name, what in sorted(r.violations.items())) for r in rows]
        super().__init__(f"{len(rows)} device op(s) would exceed an MPS limit at real size:\n" + "\n".join(lines) +
                         "\nSplit the op (chunk rows, tile the decode) so that each call stays within the limit "
                         "(pixal3d/audit/limits.py names the source of each).")


@dataclass(frozen=True)
class SizeOracle:
    """The counts that stand in for data on ``meta`` (module doc)."""

    nonzero_fraction: float = 4.6 / 8
    unique_fraction: float = 1.0


@dataclass
class SizeRow:
    """One (op, dtypes) pair of the device path at real size: its largest tensor over every call."""

    op: str
    dtypes: tuple[str, ...]
    largest: TensorInfo
    most_elements: int
    largest_dim: int
    largest_case: str = "-"  # the case its largest tensor came from
    calls: int = 0
    cases: list[str] = field(default_factory=list)
    violations: dict[str, str] = field(default_factory=dict)


class SizeAudit:
    """Collects the device ops of real-size runs (``record`` is called by ``SizeMode``)."""

    def __init__(self, limits: Sequence[Limit] = MPS_LIMITS, oracle: SizeOracle = SizeOracle()):
        self.limits = tuple(limits)
        self.oracle = oracle
        self.case = "-"
        self.rows: dict[tuple[str, tuple[str, ...]], SizeRow] = {}
        self.case_largest: dict[str, tuple[str, TensorInfo]] = {}  # case -> (op, its largest tensor)
        self.closest: dict[str, tuple[float, str, str, str]] = {}  # limit -> (amount, what, op, case) of its closest call
        self.calls = 0

    def record(self, call: Call) -> None:
        """Account for one device op: its largest tensor and any limit it breaks."""
        if not call.tensors:
            return
        self.calls += 1
        key = (call.op, tuple(sorted({short_dtype(t.dtype) for t in call.tensors})))
        largest = max(call.tensors, key=lambda t: t.nbytes)
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = SizeRow(call.op, key[1], largest, 0, 0, self.case)
        if largest.nbytes > row.largest.nbytes:
            row.largest, row.largest_case = largest, self.case
        if largest.nbytes > self.case_largest.get(self.case, ("", TensorInfo((0,), torch.uint8)))[1].nbytes:
            self.case_largest[self.case] = (call.op, largest)
        row.most_elements = max(row.most_elements, max(t.numel for t in call.tensors))
        row.largest_dim = max(row.largest_dim, max((max(t.shape, default=0) for t in call.tensors), default=0))
        row.calls += 1
        if self.case not in row.cases:
            row.cases.append(self.case)
        for name, what in violations(call, self.limits).items():
            row.violations.setdefault(name, f"{what} ({self.case})")
        for limit in self.limits:
            measured = limit.measure(call) if limit.measure is not None and limit.applies(call.op) else None
            if measured is not None and measured[0] > self.closest.get(limit.name, (-1.0,))[0]:
                self.closest[limit.name] = (*measured, call.op, self.case)

    def sorted_rows(self) -> list[SizeRow]:
        return sorted(self.rows.values(), key=lambda r: (-r.largest.nbytes, r.op, r.dtypes))

    def problems(self) -> list[SizeRow]:
        """Rows that break a limit, largest first."""
        return [r for r in self.sorted_rows() if r.violations]

    def check(self) -> None:
        """Raise ``MpsLimitError`` if any recorded op breaks a limit."""
        bad = self.problems()
        if bad:
            raise MpsLimitError(bad)

    def to_markdown(self) -> str:
        """The real-size table: per (op, dtypes) its largest tensor (bytes, shape, dtype, the case it came from),
        its most elements and largest dimension over every call, calls, cases, and the verdict with its source."""
        sources = {limit.name: limit.source for limit in self.limits}
        lines = ["| op | dtypes | largest tensor | bytes | in | most elements | largest dim | calls (cases) | verdict |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for r in self.sorted_rows():
            verdict = "; ".join(f"**over: {name}** — {what} [{sources[name]}]"
                                for name, what in sorted(r.violations.items())) or "within"
            lines.append(f"| `{r.op}` | {' '.join(r.dtypes)} | {short(r.largest)} | {_size(r.largest.nbytes)} | "
                         f"{r.largest_case} | {r.most_elements:,} | {r.largest_dim:,} | {r.calls:,} ({len(r.cases)}) | "
                         f"{verdict} |")
        return "\n".join(lines) + "\n"

    def closest_markdown(self) -> str:
        """Per limit with a measure, the call that came closest to it (the most it measured, and its share of the
        limit's bound where it has one), the op and the case."""
        lines = ["| limit | closest call | share of the bound | op | case |", "|---|---|---|---|---|"]
        for limit in self.limits:
            if limit.name in self.closest:
                amount, what, op, case = self.closest[limit.name]
                shown = f"{100 * amount / limit.bound:.2f} %" if limit.bound else "no bound: the most seen"
                lines.append(f"| {limit.name} | {what} | {shown} | `{op}` | {case} |")
        return "\n".join(lines) + "\n"

    def cases_markdown(self) -> str:
        """One line per case: its largest tensor and the op that made it."""
        return "\n".join(f"- {case}: {short(t)}, {_size(t.nbytes)} (`{op}`)"
                         for case, (op, t) in self.case_largest.items()) + "\n"


def limits_markdown(limits: Sequence[Limit] = MPS_LIMITS) -> str:
    """The limits each row is judged against, with their sources."""
    lines = ["| limit | rule | applies to | source (torch 2.13) |", "|---|---|---|---|"]
    for limit in limits:
        ops = ", ".join(f"`{o.removeprefix('aten::')}`" for o in sorted(limit.ops)) if limit.ops else "every device op"
        lines.append(f"| {limit.name} | {limit.rule} | {ops} | {limit.source} |")
    return "\n".join(lines) + "\n"


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n:,} B"


def _is_meta(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


def _flat(values: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for x in values:
        out.extend(x) if isinstance(x, (list, tuple)) else out.append(x)
    return out


def _call(name: str, args: tuple, kwargs: dict, out: Any) -> Call:
    """The ``Call`` of one op: its meta tensors (arguments, then results) and positional arguments."""
    def info(x: Any) -> Any:
        if _is_meta(x):
            return TensorInfo.of(x)
        if isinstance(x, (list, tuple)) and any(_is_meta(v) for v in x):
            return tuple(TensorInfo.of(v) for v in x if _is_meta(v))
        return None

    results = out if isinstance(out, (list, tuple)) else [out]
    tensors = [TensorInfo.of(x) for x in _flat([*args, *kwargs.values()]) if _is_meta(x)]
    tensors += [TensorInfo.of(x, "out") for x in _flat(results) if _is_meta(x)]
    flags = tuple(None if isinstance(a, (torch.Tensor, list, tuple)) else a for a in args)
    return Call(name, tuple(tensors), tuple(info(a) for a in args), flags)


class SizeMode(TorchDispatchMode):
    """Runs device ops on ``meta`` with ``SizeOracle`` answers for the data-dependent ones; reports each."""

    def __init__(self, audit: SizeAudit):
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = _flat([*args, *kwargs.values()])
        if not any(_is_meta(x) for x in leaves) and not _to_meta(kwargs):
            return func(*args, **kwargs)
        name = func.name()
        out = self._data_dependent(name, args, kwargs)
        if out is NotImplemented:
            out = func(*args, **kwargs)
        self.audit.record(_call(name, args, kwargs, out))
        return out

    def _data_dependent(self, name: str, args: tuple, kwargs: dict) -> Any:
        """The oracle's stand-in result for an op that needs data, or NotImplemented."""
        oracle = self.audit.oracle
        first = args[0] if args else None
        if name in ("aten::nonzero", "aten::argwhere"):
            count = round(first.numel() * oracle.nonzero_fraction)
            return torch.empty(count, first.dim(), dtype=torch.int64, device="meta")
        if name == "aten::masked_select":
            return first.new_empty(round(first.numel() * oracle.nonzero_fraction))
        if name == "aten::_local_scalar_dense":
            return False if first.dtype == torch.bool else 0
        if name == "aten::unique_dim":
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            rows = max(1, round(first.shape[dim] * oracle.unique_fraction))
            shape = list(first.shape)
            shape[dim] = rows
            return (first.new_empty(shape), torch.empty(first.shape[dim], dtype=torch.int64, device="meta"),
                    torch.empty(rows, dtype=torch.int64, device="meta"))
        if name == "aten::_unique2":
            rows = max(1, round(first.numel() * oracle.unique_fraction))
            return (first.new_empty(rows), torch.empty(first.shape, dtype=torch.int64, device="meta"),
                    torch.empty(rows, dtype=torch.int64, device="meta"))
        if name in ("aten::index.Tensor", "aten::index_put_", "aten::_index_put_impl_", "aten::index_put"):
            indices = args[1]
            if any(_is_meta(i) and i.dtype == torch.bool for i in indices if i is not None):
                func = {"aten::index.Tensor": torch.ops.aten.index.Tensor, "aten::index_put_": torch.ops.aten.index_put_,
                        "aten::index_put": torch.ops.aten.index_put,
                        "aten::_index_put_impl_": torch.ops.aten._index_put_impl_}[name]
                return func(first, self._long_indices(indices), *args[2:], **kwargs)
        if name == "aten::bincount":
            return torch.empty(1, dtype=torch.int64, device="meta")
        if name in ("aten::_to_copy", "aten::copy_") and _to_host(name, args, kwargs):
            return _host_zeros(name, args, kwargs)
        return NotImplemented

    def _long_indices(self, indices: Sequence[Any]) -> list[Any]:
        """Bool masks as the int64 indices ``nonzero`` would give (the oracle's count), one per mask dim."""
        out: list[Any] = []
        for index in indices:
            if _is_meta(index) and index.dtype == torch.bool:
                count = round(index.numel() * self.audit.oracle.nonzero_fraction)
                out.extend(torch.empty(count, dtype=torch.int64, device="meta") for _ in range(index.dim()))
            else:
                out.append(index)
        return out


def _to_meta(kwargs: dict) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "meta"


def _to_host(name: str, args: tuple, kwargs: dict) -> bool:
    if name == "aten::_to_copy":
        device = kwargs.get("device")
        return _is_meta(args[0]) and device is not None and torch.device(device).type == "cpu"
    return isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu" and _is_meta(args[1])


def _host_zeros(name: str, args: tuple, kwargs: dict) -> torch.Tensor:
    """A copy to the host has no data to copy: zeros (``copy_`` fills its CPU destination with them)."""
    if name == "aten::copy_":
        return args[0].zero_()
    src = args[0]
    return torch.zeros(src.shape, dtype=kwargs.get("dtype") or src.dtype)


class SdpaDispatch(TorchFunctionMode):
    """Records ``scaled_dot_product_attention`` as torch 2.13 dispatches it on mps (module doc)."""

    def __init__(self, audit: SizeAudit):
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        if not (_is_meta(q) and all(t.is_contiguous() for t in (q, k, v)) and not grad and not dropout):
            return func(*args, **kwargs)  # the composite math path: its ops are recorded one by one
        out = q.new_empty(*q.shape[:-1], v.shape[-1])  # what the MPS kernel allocates for its result
        scores = TensorInfo((*q.shape[:-1], k.shape[-2]), q.dtype, "out")  # [B, H, Lq, Lk] (sdpa_general_mps)
        self.audit.record(Call(MPS_SDPA_OP, (TensorInfo.of(q), TensorInfo.of(k), TensorInfo.of(v),
                                             TensorInfo.of(out, "out"), scores)))
        return out


@contextmanager
def real_size_audit(audit: SizeAudit | None = None) -> Iterator[SizeAudit]:
    """``with real_size_audit() as audit:`` run meta models at real sizes; then ``audit.check()``."""
    audit = audit if audit is not None else SizeAudit()
    with SdpaDispatch(audit), SizeMode(audit):
        yield audit
    logger.debug("real-size audit: %d device calls, %d rows", audit.calls, len(audit.rows))
