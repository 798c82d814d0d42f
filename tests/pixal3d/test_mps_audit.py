"""MPS readiness without a Mac: the ATen dispatch-table rules, the stand-in device, and the audit of the
tiny cascade (every device op has an MPS kernel), each with a control that shows the check can fail."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pixal3d.audit import (
    STANDIN,
    DispatchTable,
    Kernel,
    MpsUnsupportedError,
    StandInTensor,
    mps_audit,
    to_standin,
)
from pixal3d.audit.dispatch_table import (
    installed_table,
    native_functions_path,
    parse_entries,
)
from pixal3d.audit.mps import FLOAT64, HOST_INPUT, MPS_SELECTED, NO_KERNEL
from pixal3d.audit.standin import standin_mode
from pixal3d.pipeline_json import resolve_weights
from scripts.mps_audit import audit_tiny_cascade
from tests.support.cascade_fixtures import tiny, tiny_cache  # noqa: F401

# -- the dispatch table ----------------------------------------------------------------------------


def test_the_installed_torch_ships_native_functions_yaml():
    assert native_functions_path().is_file()
    assert len(installed_table().entries) > 2000


@pytest.mark.parametrize(("op", "kernel"), [
    ("aten::segment_reduce", Kernel.NONE),                        # CPU, CUDA only
    ("aten::add.Tensor", Kernel.MPS),                             # structured: MPS is on add.out
    ("aten::index_add_", Kernel.MPS),
    ("aten::repeat_interleave.Tensor", Kernel.MPS),
    ("aten::zeros", Kernel.COMPOSITE_EXPLICIT),
    ("aten::repeat_interleave.self_Tensor", Kernel.COMPOSITE_IMPLICIT),
    ("prims::add", Kernel.UNKNOWN),
])
def test_installed_table_classifies_known_ops(op, kernel):
    assert installed_table().kernel(op) is kernel


def test_table_rules_on_injected_entries():
    table = DispatchTable(parse_entries([
        {"func": "a(Tensor self) -> Tensor", "dispatch": {"CPU, CUDA, MPS": "k"}},
        {"func": "b(Tensor self) -> Tensor", "dispatch": {"CPU, CUDA": "k", "SparseMPS": "s"}},
        {"func": "c.out(Tensor self, *, Tensor(a!) out) -> Tensor(a!)", "dispatch": {"MPS": "k"}},
        {"func": "c(Tensor self) -> Tensor", "structured_delegate": "c.out", "dispatch": {"SparseCPU": "s"}},
        {"func": "d(Tensor self) -> Tensor"},
        {"func": "e(Tensor self) -> Tensor", "dispatch": {"CompositeExplicitAutograd": "k"}, "autogen": "e.out"},
    ]))
    assert table.kernel("aten::a") is Kernel.MPS
    assert table.kernel("aten::b") is Kernel.NONE  # SparseMPS serves sparse tensors only
    assert table.kernel("aten::c") is Kernel.MPS
    assert table.kernel("aten::d") is Kernel.COMPOSITE_IMPLICIT
    assert table.kernel("aten::e") is Kernel.COMPOSITE_EXPLICIT
    assert table.kernel("aten::e.out") is Kernel.COMPOSITE_EXPLICIT


def test_the_mps_implementations_of_device_selecting_composites_have_mps_kernels():
    for callee in [c for callees in MPS_SELECTED.values() for c in callees] + [
            "aten::_scaled_dot_product_attention_math_for_mps"]:  # SDPA's own mps path (see the audit docstring)
        assert installed_table().kernel(callee) is Kernel.MPS, callee

# -- the stand-in device ---------------------------------------------------------------------------


def test_standin_tensors_compute_the_cpu_values_and_copy_back_to_plain_cpu_tensors():
    torch.manual_seed(0)
    layer, x = nn.Linear(5, 3), torch.randn(4, 5)
    expected = layer(x)
    with standin_mode(lambda call: None):
        on_device = layer.to(STANDIN)
        y = on_device(x.to(STANDIN))
        assert isinstance(y, StandInTensor) and y.device == STANDIN
        assert isinstance(on_device.weight, StandInTensor)
        back = y.cpu()
        made = torch.tensor([1.0, 2.0], device=STANDIN)
        ones = torch.ones(3, device=y.device)
        z = y.add_(1)
    assert type(back) is torch.Tensor and back.device.type == "cpu"
    assert torch.equal(back, expected)
    assert isinstance(made, StandInTensor) and torch.equal(made.inner, torch.tensor([1.0, 2.0]))
    assert isinstance(ones, StandInTensor)
    assert z is y  # in place returns the caller's tensor


def test_standin_tensor_refuses_numpy_like_an_mps_tensor():
    with standin_mode(lambda call: None):
        x = torch.zeros(2, device=STANDIN)
        with pytest.raises(TypeError, match="Use Tensor.cpu"):
            x.numpy()


def test_standin_mode_reports_the_side_of_each_op():
    calls = []
    with standin_mode(calls.append):
        host = torch.ones(3) * 2
        (host.to(STANDIN) + 1).cpu()
        torch.empty(2, device="meta") + 1
    sides = {c.op: c.side for c in calls}
    assert sides["aten::mul.Tensor"] == "host"
    assert sides["aten::add.Tensor"] in ("device", "meta")
    assert any(c.op == "aten::add.Tensor" and c.side == "device" for c in calls)
    assert any(c.op == "aten::add.Tensor" and c.side == "meta" for c in calls)

# -- the audit: controls ---------------------------------------------------------------------------


def test_control_segment_reduce_on_the_device_is_flagged():
    with mps_audit() as audit:
        audit.stage = "toy"
        data = torch.randn(6, 1).to(STANDIN)
        torch.segment_reduce(data, "mean", lengths=torch.tensor([2, 4], device=STANDIN))
    [row] = [r for r in audit.problems()]
    assert row.op == "aten::segment_reduce" and row.problems == {NO_KERNEL} and row.stages == ["toy"]
    with pytest.raises(MpsUnsupportedError, match="segment_reduce"):
        audit.check()


def test_control_float64_on_the_device_is_flagged_but_a_host_conversion_is_not():
    with mps_audit() as audit:
        torch.ones(3, dtype=torch.float64).to(STANDIN, torch.float32)  # converts on the host: fine on mps
        torch.ones(3).to(STANDIN).cpu().double()                       # widened on the host: fine
    assert audit.problems() == []
    with mps_audit() as audit:
        torch.ones(3).to(STANDIN).double()
    assert {FLOAT64} == set().union(*(r.problems for r in audit.problems()))


def test_control_a_host_tensor_in_a_device_op_is_flagged():
    with mps_audit() as audit:
        torch.ones(3).to(STANDIN) + torch.ones(3)
        torch.ones(3).to(STANDIN) + torch.tensor(1.0)  # a 0-dim CPU tensor is a scalar: allowed on mps
    [row] = audit.problems()
    assert row.op == "aten::add.Tensor" and row.problems == {HOST_INPUT} and row.calls == 2


def test_host_ops_are_counted_not_judged():
    with mps_audit() as audit:
        torch.segment_reduce(torch.randn(4, 1), "mean", lengths=torch.tensor([1, 3]))
    assert audit.problems() == [] and "aten::segment_reduce" in audit.host_ops

# -- the audit of the tiny cascade -----------------------------------------------------------------


def test_tiny_cascade_sends_only_mps_ops_to_the_device(tiny):
    """Published dtype placement (bf16 flows, fp16 decoders), staged policy, export included."""
    audit = audit_tiny_cascade([("staged", "published")], config=tiny,
                               weights=resolve_weights(tiny.weights, offline=True, need_moge=True))
    assert audit.problems() == [], "\n".join(audit.summary()["problems"])
    stages = {s for r in audit.rows.values() for s in r.stages}
    assert {"camera", "structure", "shape_512", "upsample", "shape_1024", "texture", "decode", "export"} <= stages
    ops = {r.op for r in audit.rows.values()}
    assert "aten::index_add_" in ops and "aten::segment_reduce" not in ops  # the sampler's rescale ran
    assert audit.summary()["bfloat16_ops"], "the published placement runs the flows in bfloat16"
    camera_half = {r.op for r in audit.rows.values() if "camera" in r.stages and "f16" in r.dtypes}
    assert {"aten::convolution", "aten::addmm"} <= camera_half, "MoGe-2 runs in float16, as under autocast on mps"
    control = audit_tiny_cascade([("staged", "tiny")], config=tiny,
                                 weights=resolve_weights(tiny.weights, offline=True, need_moge=True))
    assert not {r.op for r in control.rows.values() if "camera" in r.stages and "f16" in r.dtypes}  # no autocast


def test_standin_model_matches_its_cpu_run_to_rounding(tiny):
    """The stand-in changes where ops are observed, not the maths. Not bitwise for a transformer: SDPA
    picks its kernel by device (the CPU a fused one, meta:1 the math decomposition, as mps often does)."""
    import copy

    from pixal3d.models.dinov3 import load_dinov3

    model = load_dinov3(resolve_weights(tiny.weights, offline=True).path("dinov3"), torch.device("cpu"))
    pixels = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(pixels).last_hidden_state
        with mps_audit():
            got = to_standin(copy.deepcopy(model))(pixels.to(STANDIN)).last_hidden_state.cpu()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
