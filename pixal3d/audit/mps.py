"""MPS readiness without a Mac: every ATen op a run sends to the device, checked against ATen's table.

Run the code under ``mps_audit()`` with its tensors on ``STANDIN`` (see ``pixal3d.audit.standin``):
the audit records each op with the dtypes of its tensors and the stage it ran in (``audit.stage``,
set by whoever drives the run), and classifies it with ``pixal3d.audit.dispatch_table``.

Which ops count ("the device path"): an op that takes a tensor on the device or creates one there,
as it would on a Mac, where the models and everything the samplers and decoders do live on
``mps``. Ops on host tensors — the noise drawn on the CPU generator before ``.to(device)``, the
fingerprints and the export's arrays after ``.cpu()`` — are counted apart and not judged.
Composite-implicit ops never reach the audit (they decompose first; their parts are recorded). A
composite-explicit op is recorded, and its kernel runs under the audit so the ops it calls are
recorded and judged as device ops too.

A row is a problem when a Mac run would fail there:

* ``no MPS kernel``: the op has no MPS kernel (``Kernel.NONE``) or is not an ATen op;
* ``float64 on the device``: a float64/complex128 device tensor (MPS has no 64-bit floats: the
  conversion itself raises);
* ``host tensor in a device op``: a non-scalar CPU tensor passed to a device op (copies and
  indexing excepted), which raises "Expected all tensors to be on the same device".

bfloat16 and complex64 device tensors are noted, not failed: MPS runs both from macOS 14 on
(``checkSupportsBFloat16`` / ``checkSupportsComplex`` in ATen's ``mps/OperationUtils.mm``).

Three composite-explicit ops pick their implementation by device inside the kernel, so running
their kernel on the CPU would show CPU-only callees (``mkldnn_convolution``, ``slow_conv3d``) that a
Mac never calls. They are not expanded; ``MPS_SELECTED`` names the ops their kernel calls on ``mps``
(ATen's ``select_conv_backend`` in ``Convolution.cpp``; ``copy_impl`` in ``Copy.cpp``, which hands
any copy touching ``mps`` to ``_copy_from``) and those are judged instead. A copy between the host
and the device converts dtypes on the host side (``copy_to_mps_`` / ``copy_from_mps_``), so only the
dtypes of an op's device tensors count: ``cpu_float64.to("mps", torch.float32)`` is fine.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .dispatch_table import (
    COMPOSITE_EXPLICIT_KEYS,
    DispatchTable,
    Kernel,
    installed_table,
)
from .standin import OpCall, standin_mode

logger = logging.getLogger(__name__)

NO_KERNEL = "no MPS kernel"
FLOAT64 = "float64 on the device"
HOST_INPUT = "host tensor in a device op"
BF16_NOTE = "bfloat16: macOS 14+"
COMPLEX_NOTE = "complex64: macOS 14+"

# composite op → what its kernel calls on mps (picked by device inside the kernel)
MPS_SELECTED: dict[str, tuple[str, ...]] = {
    "aten::_convolution": ("aten::_mps_convolution", "aten::_mps_convolution_transpose"),
    "aten::copy_": ("aten::_copy_from",),
    "aten::_to_copy": ("aten::empty_strided", "aten::_copy_from"),
}

FLOAT64_DTYPES = frozenset({torch.float64, torch.complex128})
SHORT_DTYPES = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
}


def short_dtype(dtype: torch.dtype) -> str:
    """``torch.float32`` → ``f32`` (table shorthand)."""
    return SHORT_DTYPES.get(dtype, str(dtype).removeprefix("torch."))


@dataclass
class AuditRow:
    """One (op, dtypes) pair of the device path, over every stage that used it."""

    op: str
    dtypes: tuple[str, ...]          # of its device tensors (arguments and results), sorted
    kernel: Kernel
    stages: list[str] = field(default_factory=list)
    calls: int = 0
    problems: set[str] = field(default_factory=set)
    notes: set[str] = field(default_factory=set)

    @property
    def status(self) -> str:
        """``MPS kernel`` / ``composite (explicit)`` / ... plus problems and notes, for the table."""
        extra = sorted(self.problems - {NO_KERNEL}) + sorted(self.notes)
        return "; ".join([self.kernel.value, *extra])


class MpsUnsupportedError(RuntimeError):
    """The audited code would fail on mps: names each op, its dtypes, the stages and the reason."""

    def __init__(self, rows: list[AuditRow]):
        self.rows = rows
        lines = [f"  {r.op} [{', '.join(r.dtypes)}] in {', '.join(r.stages)}: {', '.join(sorted(r.problems))}"
                 for r in rows]
        super().__init__(f"{len(rows)} device op(s) would fail on mps:\n" + "\n".join(lines) +
                         "\nReplace each with ops that have an MPS kernel (see pixal3d/audit/dispatch_table.py), "
                         "keep float64 maths on the CPU, and move host tensors to the device first.")


class MpsAudit:
    """Collects the ops of a stand-in run (``record`` is a ``StandInMode`` ``on_op``)."""

    def __init__(self, table: DispatchTable | None = None):
        self.table = table if table is not None else installed_table()
        self.stage = "-"
        self.rows: dict[tuple[str, tuple[str, ...]], AuditRow] = {}
        self.host_ops: dict[str, list[str]] = {}  # op → stages, for ops that stayed on the CPU
        self.device_calls = 0
        self.host_calls = 0
        self._keys: dict[str, Any] = {}

    def record(self, call: OpCall) -> None:
        """Account for one op (host ops only counted, device ops classified)."""
        if call.side == "meta":  # building models on meta and releasing them to it: no data, no kernel
            return
        if not call.on_device:
            self.host_calls += 1
            stages = self.host_ops.setdefault(call.op, [])
            if self.stage not in stages:
                stages.append(self.stage)
            return
        self.device_calls += 1
        dtypes = set(call.dtypes)
        key = (call.op, tuple(sorted(short_dtype(d) for d in dtypes)))
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = self._new_row(call.op, key[1], dtypes)
        if call.host_inputs:
            row.problems.add(HOST_INPUT)
        row.calls += 1
        if self.stage not in row.stages:
            row.stages.append(self.stage)

    def _new_row(self, op: str, names: tuple[str, ...], dtypes: set[torch.dtype]) -> AuditRow:
        row = AuditRow(op, names, self.table.kernel(op))
        if not row.kernel.runs_on_mps:
            row.problems.add(NO_KERNEL)
        callees = MPS_SELECTED.get(op, ())
        if callees:
            row.notes.add("on mps: " + ", ".join(c.removeprefix("aten::") for c in callees))
        if any(not self.table.kernel(c).runs_on_mps for c in callees):
            row.problems.add(NO_KERNEL)
        if dtypes & FLOAT64_DTYPES:
            row.problems.add(FLOAT64)
        if torch.bfloat16 in dtypes:
            row.notes.add(BF16_NOTE)
        if torch.complex64 in dtypes:
            row.notes.add(COMPLEX_NOTE)
        return row

    def expand_key(self, op: str) -> Any:
        """The composite dispatch key whose kernel should run under the audit (its callees recorded)."""
        if op not in self._keys:
            key = None
            if self.table.kernel(op) is Kernel.COMPOSITE_EXPLICIT and op not in MPS_SELECTED:
                key = next((getattr(torch._C.DispatchKey, k) for k in COMPOSITE_EXPLICIT_KEYS
                            if torch._C._dispatch_has_kernel_for_dispatch_key(op, k)), None)
            self._keys[op] = key
        return self._keys[op]

    def problems(self) -> list[AuditRow]:
        """Rows a Mac run would fail on, sorted by op."""
        return [r for r in self.sorted_rows() if r.problems]

    def sorted_rows(self) -> list[AuditRow]:
        return sorted(self.rows.values(), key=lambda r: (r.op, r.dtypes))

    def check(self) -> None:
        """Raise ``MpsUnsupportedError`` if any device op would fail on mps."""
        bad = self.problems()
        if bad:
            raise MpsUnsupportedError(bad)

    def summary(self) -> dict[str, Any]:
        """Counts for a report line: distinct ops, rows, calls, problems, bf16 use."""
        return {
            "device_ops": len({r.op for r in self.rows.values()}),
            "rows": len(self.rows),
            "device_calls": self.device_calls,
            "host_calls": self.host_calls,
            "host_ops": len(self.host_ops),
            "problems": [f"{r.op} [{', '.join(r.dtypes)}]: {', '.join(sorted(r.problems))}" for r in self.problems()],
            "bfloat16_ops": sorted({r.op for r in self.rows.values() if BF16_NOTE in r.notes}),
            "complex64_ops": sorted({r.op for r in self.rows.values() if COMPLEX_NOTE in r.notes}),
        }

    def to_markdown(self) -> str:
        """The device-path table (op, dtypes, stages, MPS status) and the list of host-side ops."""
        lines = ["| op | dtypes | stages | calls | MPS |", "|---|---|---|---|---|"]
        for r in self.sorted_rows():
            mark = " **✗**" if r.problems else ""
            lines.append(f"| `{r.op}` | {' '.join(r.dtypes) or '–'} | {', '.join(r.stages)} | {r.calls} | "
                         f"{r.status}{mark} |")
        lines += ["", "Host-side ops (CPU tensors by design, not judged):", ""]
        lines += [f"- `{op}` ({', '.join(stages)})" for op, stages in sorted(self.host_ops.items())]
        return "\n".join(lines) + "\n"


@contextmanager
def mps_audit(table: DispatchTable | None = None) -> Iterator[MpsAudit]:
    """``with mps_audit() as audit:`` run code on ``STANDIN``; then ``audit.check()`` / ``to_markdown()``."""
    audit = MpsAudit(table)
    with standin_mode(audit.record, audit.expand_key):
        yield audit
    logger.debug("mps audit: %d device calls, %d host calls, %d rows", audit.device_calls, audit.host_calls,
                 len(audit.rows))
