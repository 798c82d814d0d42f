"""The size and dtype limits of torch 2.13's MPS kernels, as checks on one recorded op.

Every limit names its source. Lines are those of the torch 2.13.0 macOS arm64 wheel
(``torch-2.13.0-cp311-cp311-macosx_14_0_arm64.whl``): the file and line each ``TORCH_CHECK`` hands to
``c10::detail::torchCheckFail`` (or to a ``SourceLocation``) in ``libtorch_cpu.dylib``, read by
disassembling the call sites; the kernels' own integer types from the headers the wheel ships
(``torch/include/ATen/native/mps/kernels``). The one limit that is Apple's, not PyTorch's — MPSGraph's
refusal of arrays over 2**32 bytes — is cited from the PyTorch issue that shows its message, and two limits
that fail silently rather than with a check are cited from the reports that measured them: attention that
corrupts near 2**31 score elements (Comfy-Org/ComfyUI#14837, torch 2.13) and Metal's ``index_add``, which
upcasts half-precision accumulators to fp32 only in some cases (pytorch/pytorch#187109).

A limit with a numeric bound also says how close a call comes to it (``Limit.measure``): the audit reports the
closest call of each, so a bound kept with room to spare is shown, not only one that is broken.

A limit is judged on the device tensors of one call (``Call``): shapes and dtypes only, so it works on
``meta`` tensors at real sizes (``pixal3d.audit.sizes``). The byte limit is applied to every device op,
also to those MPS runs as Metal kernels (which split work into 32-bit chunks themselves): conservative.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
MPSGRAPH_ARRAY_BYTES = 2**32
ATTENTION_SCORE_ELEMENTS = 2**31  # Comfy-Org/ComfyUI#14837: silent corruption from about here

FLOATING = frozenset({torch.float32, torch.float16, torch.bfloat16})
INTEGRAL = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of one device tensor of a call; ``role`` is ``in`` (argument) or ``out`` (result)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    role: str = "in"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, t: torch.Tensor, role: str = "in") -> TensorInfo:
        return cls(tuple(int(s) for s in t.shape), t.dtype, role)


@dataclass(frozen=True)
class Call:
    """One device op as recorded: its name, its device tensors in argument order then results, and the
    positional arguments by index: ``args[i]`` a ``TensorInfo``, a tuple of them (a ``Tensor[]`` argument)
    or None; ``flags[i]`` the argument itself when it is not a tensor (bools, ints), else None."""

    op: str
    tensors: tuple[TensorInfo, ...]
    args: tuple[TensorInfo | tuple[TensorInfo, ...] | None, ...] = ()
    flags: tuple[object, ...] = ()

    def arg(self, i: int) -> TensorInfo | None:
        value = self.args[i] if i < len(self.args) else None
        return value if isinstance(value, TensorInfo) else None

    def arg_list(self, i: int) -> tuple[TensorInfo, ...]:
        value = self.args[i] if i < len(self.args) else None
        return value if isinstance(value, tuple) else ()

    def flag(self, i: int) -> object:
        return self.flags[i] if i < len(self.flags) else None

    @property
    def outputs(self) -> tuple[TensorInfo, ...]:
        return tuple(t for t in self.tensors if t.role == "out")


@dataclass(frozen=True)
class Limit:
    """One rule a call must keep on mps: ``check(call)`` returns what breaks it, or None."""

    name: str
    rule: str
    source: str
    ops: frozenset[str] | None  # the ops it applies to; None: every device op
    check: Callable[[Call], str | None]
    # what a call measures against the limit: (the amount, its description), None where it does not apply;
    # ``bound`` is the amount the limit allows (None: no numeric bound, the largest amount is shown all the same)
    measure: Callable[[Call], tuple[float, str] | None] | None = None
    bound: float | None = None

    def applies(self, op: str) -> bool:
        return self.ops is None or op in self.ops


def _largest(call: Call) -> TensorInfo | None:
    return max(call.tensors, key=lambda t: t.nbytes, default=None)


def _array_bytes(call: Call) -> str | None:
    big = _largest(call)
    if big is not None and big.nbytes > MPSGRAPH_ARRAY_BYTES:
        return f"{big.nbytes / 2**30:.2f} GiB {short(big)} > 2**32 bytes"
    return None


def _array_share(call: Call) -> tuple[float, str] | None:
    big = _largest(call)
    return None if big is None else (big.nbytes, f"{big.nbytes / 2**30:.2f} GiB {short(big)}")


def _score_elements(call: Call) -> tuple[int, str] | None:
    """Score elements one attention call holds at once: ``B·H·Lq·Lk`` of the MPS SDPA kernel (its scores), or
    the softmax's input (the composite and chunked routes: ``bmm`` → softmax → ``bmm``)."""
    if call.op == MPS_SDPA_OP:
        q, k = call.arg(0), call.arg(1)
        if q is None or k is None:
            return None
        n = k.shape[-2]
        for s in q.shape[:-1]:
            n *= s
        return n, f"scores of q {short(q)} · k {short(k)}"
    first = call.arg(0) if call.op in SOFTMAX_OPS else None
    return None if first is None else (first.numel, f"softmax over {short(first)}")


def _attention_scores(call: Call) -> str | None:
    found = _score_elements(call)
    if found is not None and found[0] >= ATTENTION_SCORE_ELEMENTS:
        return f"{found[0]:,} score elements >= 2**31 ({found[1]})"
    return None


def _attention_share(call: Call) -> tuple[float, str] | None:
    found = _score_elements(call)
    return None if found is None else (found[0], f"{found[0]:,} elements: {found[1]}")


def _index_add(call: Call) -> str | None:
    """index_add accumulates in its destination's dtype; Metal's kernel upcasts fp16/bf16 only in some cases."""
    dest = call.arg(0)
    if dest is not None and dest.dtype in (torch.float16, torch.bfloat16):
        return f"index_add into {short(dest)} accumulates in half precision"
    return None


def _index_add_rows(call: Call) -> tuple[float, str] | None:
    """Rows added per destination slot: how many adds one accumulator takes (no bound: shown, not judged)."""
    dest, source = call.arg(0), call.arg(3)
    if dest is None or source is None or not dest.shape or not source.shape:
        return None
    per_slot = source.shape[0] / max(1, dest.shape[0])
    return per_slot, f"{per_slot:,.0f} rows per slot ({short(source)} into {short(dest)})"


def _dims(call: Call) -> str | None:
    for t in call.tensors:
        if any(s > INT32_MAX for s in t.shape):
            return f"dimension of {short(t)} > INT32_MAX"
    return None


def _float64(call: Call) -> str | None:
    bad = [t for t in call.tensors if t.dtype in (torch.float64, torch.complex128)]
    return f"{short(bad[0])} on the device" if bad else None


def _nonzero(call: Call) -> str | None:
    first = call.arg(0)
    if first is not None and first.numel > INT32_MAX:
        return f"nonzero over {first.numel:,} elements > INT_MAX"
    return None


def _masked_fill(call: Call) -> str | None:
    first = call.arg(0)
    if first is not None and first.numel > 2**32:
        return f"masked_fill over {first.numel:,} elements > 2**32"
    return None


def _index_kernel(call: Call) -> str | None:
    """index / index_put: int64 indices (a bool mask becomes int64 by nonzero first), at most 16 of them,
    a 32-bit thread count."""
    indices = call.arg_list(1)
    if len(indices) > 16:
        return f"{len(indices)} index tensors > 16"
    for t in indices:
        if t.dtype not in (torch.int64, torch.bool):
            return f"index tensor {short(t)} is not int64"
    span = max((t.numel for t in call.tensors), default=0)
    if span > UINT32_MAX:
        return f"index kernel over {span:,} elements > 2**32 (32-bit thread count)"
    return None


def _index_select(call: Call) -> str | None:
    index = call.arg(2)
    if index is not None and index.dtype not in (torch.int32, torch.int64):
        return f"index_select index {short(index)} is not int32/int64"
    return None


def _bmm(call: Call) -> str | None:
    for out in call.outputs:
        if any(s > 2**32 for s in out.shape):
            return f"matmul output dimension of {short(out)} > 2**32"
        if out.numel > 2**32:
            return f"batch matmul of {out.numel:,} entries > 2**32 needs macOS 15 (tiled path)"
    return None


def _conv(call: Call) -> str | None:
    inp, weight = call.arg(0), call.arg(1)
    if inp is None or weight is None:
        return None
    if inp.dtype not in FLOATING:
        return f"convolution of {short(inp)} (floating types only)"
    transposed = bool(call.flag(6))
    out_channels = weight.shape[1] if transposed else weight.shape[0]
    if out_channels > 65536:
        return f"{out_channels} output channels > 65536"
    if transposed and len(inp.shape) == 5 and inp.dtype in (torch.float16, torch.bfloat16):
        return "3-D transposed convolution in half precision"
    return None


def _softmax(call: Call) -> str | None:
    first = call.arg(0)
    if first is not None and first.dtype not in FLOATING:
        return f"softmax of {short(first)} (floating types only)"
    if call.flag(2) is True and first is not None and first.dtype != torch.float32:
        return "softmax with half to float conversion"
    return None


def _sort(call: Call) -> str | None:
    first = call.arg(0)
    if first is not None and first.shape and max(first.shape) > INT32_MAX:
        return f"sort along {max(first.shape):,} elements > INT32_MAX"
    return None


def _searchsorted(call: Call) -> str | None:
    boundaries = call.arg(0)
    if boundaries is not None and len(boundaries.shape) != 1:
        return f"searchsorted boundaries {short(boundaries)} are not 1-D"
    return None


def _linear(call: Call) -> str | None:
    bad = [t for t in call.tensors if t.role == "in" and t.dtype not in FLOATING]
    return f"linear of {short(bad[0])} (floating types only)" if bad else None


def _group_norm(call: Call) -> str | None:
    first, groups = call.arg(0), call.flag(6)
    if first is not None and isinstance(groups, int) and first.shape and first.shape[0] * groups >= 2**32:
        return "N times num_groups >= 2**32"
    return None


INDEX_OPS = frozenset({"aten::index.Tensor", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_"})
BMM_OPS = frozenset({"aten::bmm", "aten::baddbmm", "aten::bmm.out"})
CONV_OPS = frozenset({"aten::convolution", "aten::_convolution", "aten::_mps_convolution"})
SOFTMAX_OPS = frozenset({"aten::_softmax", "aten::_safe_softmax", "aten::_log_softmax"})
SORT_OPS = frozenset({"aten::sort", "aten::sort.stable", "aten::argsort", "aten::argsort.stable"})
LINEAR_OPS = frozenset({"aten::linear", "aten::addmm", "aten::mm"})
INDEX_ADD_OPS = frozenset({"aten::index_add_", "aten::index_add", "aten::index_add.out"})
MPS_SDPA_OP = "aten::_scaled_dot_product_attention_math_for_mps"

MPS_LIMITS: tuple[Limit, ...] = (
    Limit("array bytes", "no tensor over 2**32 bytes (MPSGraph: \"total bytes of NDArray > 2**32\")",
          "MPSGraph (Apple), pytorch/pytorch#149261", None, _array_bytes, _array_share, MPSGRAPH_ARRAY_BYTES),
    Limit("attention scores", "fewer than 2**31 score elements in one attention call (heads × queries × keys): "
          "MPS attention corrupts silently from about there", "Comfy-Org/ComfyUI#14837 (torch 2.13)",
          SOFTMAX_OPS | {MPS_SDPA_OP}, _attention_scores, _attention_share, ATTENTION_SCORE_ELEMENTS),
    Limit("index_add accumulator", "index_add into fp32 only: Metal's index_add upcasts fp16/bf16 to fp32 in some "
          "cases only", "pytorch/pytorch#187109", INDEX_ADD_OPS, _index_add, _index_add_rows),
    Limit("int32 dims", "every dimension <= INT32_MAX (\"MPSGraph does not support tensor dims larger than INT_MAX\")",
          "mps/OperationUtils.mm:411 (check_mps_shape)", None, _dims),
    Limit("float64", "no float64/complex128 device tensor (\"Cannot convert a float64 Tensor to MPS\")",
          "mps/OperationUtils.mm:72 (getMPSDataType); OperationUtils.h:761", None, _float64),
    Limit("nonzero size", "nonzero over at most INT_MAX elements", "mps/operations/Indexing.mm:353",
          frozenset({"aten::nonzero", "aten::argwhere"}), _nonzero),
    Limit("masked_fill size", "masked_fill over at most 2**32 elements", "mps/operations/Indexing.mm:893",
          frozenset({"aten::masked_fill_.Scalar", "aten::masked_fill_.Tensor", "aten::masked_fill.Scalar"}),
          _masked_fill),
    Limit("index kernel", "int64 index tensors (Indexing.mm:168), at most 16 (Indexing.mm:113), a 32-bit thread "
          "count (uint32_t numThreads = iter.numel(), Indexing.mm:70)", "mps/operations/Indexing.mm:70,113,168",
          INDEX_OPS, _index_kernel),
    Limit("index_select dtype", "int32 or int64 index", "mps/operations/Indexing.mm:666",
          frozenset({"aten::index_select"}), _index_select),
    Limit("matmul size", "batch-matmul output dims <= 2**32 (LinearAlgebra.mm:1115); over 2**32 entries only "
          "tiled, macOS 15+ (LinearAlgebra.mm:1100)", "mps/operations/LinearAlgebra.mm:1100,1115", BMM_OPS, _bmm),
    Limit("convolution", "floating types (Convolution.mm:170), at most 65536 output channels (Convolution.mm:200), "
          "no fp16/bf16 3-D transposed convolution (Convolution.mm:743)", "mps/operations/Convolution.mm:170,200,743",
          CONV_OPS, _conv),
    Limit("softmax", "floating types, no half-to-float conversion", "mps/operations/SoftMax.mm:41,42",
          SOFTMAX_OPS, _softmax),
    Limit("sort length", "sort rows of at most INT32_MAX elements (the kernels take `constant int& size` / "
          "`constant int3& dims`)", "mps/kernels/SortMerge.h:359, SortRadix.h:120 (2.13 headers)", SORT_OPS, _sort),
    Limit("searchsorted", "1-D boundaries", "mps/operations/Bucketization.mm:154",
          frozenset({"aten::searchsorted.Tensor"}), _searchsorted),
    Limit("linear dtype", "floating input, weight and bias", "mps/operations/Linear.mm:87,89,96", LINEAR_OPS,
          _linear),
    Limit("group_norm size", "N times num_groups < 2**32", "mps/operations/GroupNorm.mm:64",
          frozenset({"aten::native_group_norm"}), _group_norm),
)


def violations(call: Call, limits: Sequence[Limit] = MPS_LIMITS) -> dict[str, str]:
    """Limit name -> what ``call`` breaks, for every limit that applies to it."""
    out = {}
    for limit in limits:
        if limit.applies(call.op):
            broken = limit.check(call)
            if broken is not None:
                out[limit.name] = broken
    return out


def short(t: TensorInfo) -> str:
    """``bf16[20000, 12, 128]``."""
    from .mps import short_dtype

    return f"{short_dtype(t.dtype)}[{', '.join(str(s) for s in t.shape)}]"
