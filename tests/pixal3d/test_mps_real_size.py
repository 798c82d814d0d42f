"""The MPS audit at real sizes (pixal3d/audit/sizes.py, limits.py): meta runs recorded op by op, judged
against torch 2.13's MPS limits; each check with a control over the limit, and attention judged by what mps
dispatches to (its own kernel for contiguous q/k/v, the fp32 math path otherwise)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pixal3d.audit.limits import MPS_LIMITS, Call, TensorInfo, violations
from pixal3d.audit.sizes import (
    MPS_SDPA_OP,
    MpsLimitError,
    SizeAudit,
    SizeOracle,
    real_size_audit,
)
from pixal3d.models.loading import build_model
from pixal3d.nn.attention import attention, set_attention_route
from pixal3d.nn.sparse_tensor import SparseTensor

MANIFEST = Path(__file__).resolve().parents[2] / "assets" / "checkpoints.json"


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_control_an_op_over_2_to_the_32_bytes_is_flagged_and_one_at_the_limit_is_not():
    with real_size_audit() as audit:
        audit.case = "toy"
        meta(2**30) * 2          # 2**32 bytes exactly: MPSGraph refuses only more
    assert audit.problems() == []
    with real_size_audit() as audit:
        audit.case = "toy"
        meta(2**30 + 1) * 2
    [row] = [r for r in audit.problems() if r.op == "aten::mul.Tensor"]
    assert set(row.violations) == {"array bytes"} and "toy" in row.violations["array bytes"]
    with pytest.raises(MpsLimitError, match="mul.Tensor"):
        audit.check()


def test_the_silent_limits_flag_half_accumulators_and_attention_near_2_to_the_31_scores():
    """Limits that fail silently rather than with a check: an index_add into fp16/bf16 (Metal upcasts only in
    some cases) and one attention call at 2**31 score elements; fp32 accumulators and smaller score chunks pass."""
    def broken(op, tensors, args=()):
        return set(violations(Call(op, tuple(tensors), tuple(args))))

    rows, slots, index = TensorInfo((20_000,), torch.bfloat16), TensorInfo((1,), torch.bfloat16), TensorInfo(
        (20_000,), torch.int64)
    assert broken("aten::index_add_", [slots, index, rows], [slots, None, index, rows]) == {"index_add accumulator"}
    fp32 = TensorInfo((1,), torch.float32), TensorInfo((20_000,), torch.float32)
    assert broken("aten::index_add_", [fp32[0], index, fp32[1]], [fp32[0], None, index, fp32[1]]) == set()
    scores = TensorInfo((1, 16, 2**13, 2**14), torch.float16)  # 2**31 elements, 4 GiB: the silent limit first
    assert broken("aten::_softmax", [scores], [scores]) == {"attention scores"}
    under = TensorInfo((1, 16, 2**13, 2**14 - 1), torch.float16)
    assert broken("aten::_softmax", [under], [under]) == set()


def test_the_audit_reports_the_call_closest_to_each_limit():
    with real_size_audit() as audit:
        audit.case = "toy"
        torch.softmax(meta(2, 4, 64, 128), dim=-1)
        torch.softmax(meta(1, 4, 16, 128), dim=-1)  # smaller: not the closest
        meta(3).index_add_(0, torch.zeros(900, dtype=torch.long, device="meta"), meta(900))
    amount, what, op, case = audit.closest["attention scores"]
    assert amount == 2 * 4 * 64 * 128 and op == "aten::_softmax" and case == "toy"
    assert audit.closest["index_add accumulator"][0] == 300 and "300 rows per slot" in audit.closest[
        "index_add accumulator"][1]
    table = audit.closest_markdown()
    assert f"| attention scores | {2 * 4 * 64 * 128:,} elements: softmax over f32[2, 4, 64, 128] | " in table
    assert "| index_add accumulator | 300 rows per slot" in table and "no bound: the most seen" in table


def test_the_op_specific_limits_flag_what_torch_2_13_refuses():
    def broken(op, tensors, args=(), flags=()):
        return set(violations(Call(op, tuple(tensors), tuple(args), tuple(flags))))

    big = TensorInfo((2**31,), torch.bool)
    assert broken("aten::nonzero", [big], [big]) == {"nonzero size", "int32 dims"}
    assert broken("aten::nonzero", [TensorInfo((2**31 - 1,), torch.bool)], [TensorInfo((2**31 - 1,), torch.bool)]) == set()
    out = TensorInfo((2, 2**16, 2**16 + 1), torch.float16, "out")  # 2**33 entries, 8.6 GB fp16
    assert broken("aten::bmm", [out]) == {"matmul size", "array bytes"}
    x, w = TensorInfo((1, 8, 4, 4, 4), torch.float16), TensorInfo((70_000, 8, 3, 3, 3), torch.float16)
    assert broken("aten::convolution", [x, w], [x, w], [None, None, None, None, None, None, False]) == {"convolution"}
    w_ok = TensorInfo((64, 8, 3, 3, 3), torch.float16)
    assert broken("aten::convolution", [x, w_ok], [x, w_ok], [None] * 6 + [False]) == set()
    index32 = TensorInfo((10,), torch.int32)
    src = TensorInfo((100, 4), torch.float32)
    assert broken("aten::index.Tensor", [src, index32], [src, (index32,)]) == {"index kernel"}
    assert broken("aten::index.Tensor", [src, TensorInfo((10,), torch.int64)],
                  [src, (TensorInfo((10,), torch.int64),)]) == set()
    half = TensorInfo((4, 4), torch.float16)
    assert broken("aten::_softmax", [half], [half], [None, -1, True]) == {"softmax"}
    assert broken("aten::add.Tensor", [TensorInfo((2,), torch.float64)]) == {"float64"}
    assert {limit.name for limit in MPS_LIMITS} >= {"array bytes", "int32 dims", "sort length", "index kernel"}


def test_data_dependent_ops_get_the_oracles_counts_on_meta():
    with real_size_audit(SizeAudit(oracle=SizeOracle(nonzero_fraction=0.25, unique_fraction=0.5))) as audit:
        mask = meta(100, 8, dtype=torch.bool)
        assert mask.nonzero().shape == (200, 2)
        assert meta(100, 3)[mask[:, 0]].shape == (25, 3)
        rows, inverse = torch.unique(meta(40, 4, dtype=torch.int32), dim=0, return_inverse=True)
        assert rows.shape == (20, 4) and inverse.shape == (40,)
        assert bool(mask.any()) is False and meta(3).tolist() == [0.0, 0.0, 0.0]
    assert {r.op for r in audit.rows.values()} >= {"aten::nonzero", "aten::unique_dim", "aten::index.Tensor"}


def test_contiguous_sdpa_is_judged_as_the_mps_kernel_that_materialises_its_scores():
    """What mps dispatches to: contiguous q/k/v → _scaled_dot_product_attention_math_for_mps, whose [B, H, Lq, Lk]
    scores at 20k bf16 tokens (9.6 GB) exceed 2**32 bytes; the heads the models pass (views, not contiguous)
    take the math path, which upcasts to fp32 — and the fp32 route calls no SDPA at all."""
    q = meta(1, 12, 20_000, 128, dtype=torch.bfloat16)
    with real_size_audit() as audit:
        F.scaled_dot_product_attention(q, q, q)
    [row] = audit.problems()
    assert row.op == MPS_SDPA_OP and row.largest.shape == (1, 12, 20_000, 20_000)
    heads = meta(1, 20_000, 12, 128, dtype=torch.bfloat16)  # [B, L, H, D] as the projections give them
    with real_size_audit() as audit:
        attention(heads, heads, heads, route="sdpa")
    ops = {(r.op, r.dtypes) for r in audit.rows.values()}
    assert MPS_SDPA_OP not in {op for op, _ in ops}
    assert ("aten::_to_copy", ("bf16", "f32")) in ops and ("aten::bmm", ("f32",)) in ops  # the fp32 math path
    assert audit.problems() == []
    with real_size_audit() as audit:
        attention(heads, heads, heads, route="fp32_chunked")
    assert audit.problems() == [] and not any("scaled_dot_product" in r.op for r in audit.rows.values())


def test_a_published_width_flow_block_at_the_1536_token_budget_is_within_every_limit():
    """The HR flow's width (1536 channels, 12 heads × 128, bf16, mlp 5.33) on 49,151 tokens, one block."""
    spec = json.loads(MANIFEST.read_text())["models"]["shape_slat_flow_model_1024"]
    model = set_attention_route(build_model({"name": spec["class"], "args": {**spec["args"], "num_blocks": 1}}).eval(),
                                "fp32_chunked")
    n = 49_151
    x = SparseTensor(meta(n, 32), meta(n, 4, dtype=torch.int32))
    x.cache["layout"] = [slice(0, n)]
    with torch.no_grad(), real_size_audit() as audit:
        model(x, meta(1), {"global": meta(1, 4101, 1024), "proj": meta(n, 2048)})
    assert audit.problems() == []
    largest = audit.sorted_rows()[0].largest
    assert largest.shape == (n, 8192) and largest.dtype == torch.bfloat16  # the MLP's hidden features
    softmax = max((r for r in audit.rows.values() if r.op == "aten::_softmax"), key=lambda r: r.largest.nbytes)
    assert softmax.largest.dtype == torch.float32 and softmax.largest.numel <= 1 << 26


def test_moge2_at_its_released_width_and_3600_tokens_is_within_every_limit_in_float16_as_on_mps(monkeypatch):
    """The real-size camera case (scripts/mps_real_size.py): MoGe-2 ViT-L's forward on 1126 px with autocast's
    casts; its convolutions and linears run in float16, its norms in float32 — the stand-in autocast at work
    (without it every row would be float32)."""
    from scripts.mps_real_size import camera_case

    with torch.no_grad(), real_size_audit() as audit:
        camera_case()
    assert audit.problems() == []
    ops = {(r.op, r.dtypes) for r in audit.rows.values()}
    assert ("aten::convolution", ("f16",)) in ops and ("aten::addmm", ("f16",)) in ops
    assert any(op == "aten::native_layer_norm" and "f32" in dtypes for op, dtypes in ops)
    import contextlib

    from pixal3d.audit import autocast

    monkeypatch.setattr(autocast, "standin_autocast", contextlib.nullcontext)
    with torch.no_grad(), real_size_audit() as control:
        camera_case()
    assert all(r.dtypes == ("f32",) for r in control.rows.values() if r.op in ("aten::convolution", "aten::addmm"))
