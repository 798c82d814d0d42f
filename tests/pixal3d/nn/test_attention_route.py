"""The fp32-chunked attention route: chosen on mps (the audit's stand-in standing for it) and nowhere else,
exact against one-shot fp32 and fp64 attention at 20k keys, its scratch within its budget, and the config
key and plan reason that say which route runs."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pipelines import working_set as ws
from pipelines.build import build_stages
from pipelines.pipeline import Pixal3D
from pipelines.plan import with_attention_route_of
from pipelines.stage import StageBudget
from pixal3d import memory_budget as mb
from pixal3d.audit import STANDIN, mps_audit
from pixal3d.config import ATTENTION_ROUTES, ConfigError, load_config
from pixal3d.nn import attention as attn
from pixal3d.nn.limits import kernel_limits
from pixal3d.nn.attention import (
    MultiHeadSelfAttention,
    attention,
    describe_route,
    fp32_chunk_length,
    fp32_chunked_attention,
    fp32_chunked_scratch_bytes,
    resolve_route,
    set_attention_route,
)
from scripts.bench_attention import peak_allocated_bytes, reference, rms_normed_inputs
from tests.support.cascade_fixtures import tiny, tiny_cache  # noqa: F401


@pytest.mark.parametrize(("device", "route"), [
    (torch.device("mps"), "fp32_chunked"),
    (STANDIN, "fp32_chunked"),
    (torch.device("cpu"), "sdpa"),
    (torch.device("cuda"), "sdpa"),
    (torch.device("cuda", 1), "sdpa"),
    (torch.device("meta"), "sdpa"),  # models built on meta, released to it: not the stand-in
])
def test_auto_route_is_fp32_chunked_on_mps_and_its_standin_only(device, route):
    assert resolve_route("auto", device) == route


def test_an_explicit_route_is_kept_and_an_unknown_one_refused():
    assert resolve_route("sdpa", torch.device("mps")) == "sdpa"
    assert resolve_route("fp32_chunked", torch.device("cpu")) == "fp32_chunked"
    with pytest.raises(ValueError, match="fp32_chunked"):
        resolve_route("flash", torch.device("cpu"))
    assert ATTENTION_ROUTES == attn.ROUTES


def test_on_the_standin_attention_runs_fp32_matmuls_and_softmax_not_sdpa(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 9, 2, 8, generator=g).bfloat16() for _ in range(3))
    on_cpu = attention(q, k, v)
    assert calls == [1]  # control: the CPU takes SDPA
    with mps_audit() as audit:
        out = attention(q.to(STANDIN), k.to(STANDIN), v.to(STANDIN)).cpu()
    assert calls == [1]  # the stand-in (mps) did not
    assert out.dtype == torch.bfloat16 and out.shape == on_cpu.shape
    ops = {(r.op, r.dtypes) for r in audit.rows.values()}
    assert ("aten::_softmax", ("f32",)) in ops and ("aten::bmm", ("f32",)) in ops
    assert audit.problems() == []
    torch.testing.assert_close(out.float(), on_cpu.float(), atol=1e-2, rtol=1e-2)


def test_set_attention_route_reaches_every_layer_and_is_used(monkeypatch):
    layer = MultiHeadSelfAttention(16, 2)
    calls = []
    real = attn.fp32_chunked_attention
    monkeypatch.setattr(attn, "fp32_chunked_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(1, 5, 16)
    layer(x)
    assert calls == []  # auto on the CPU: SDPA
    assert set_attention_route(layer, "fp32_chunked") is layer and layer.route == "fp32_chunked"
    layer(x)
    assert calls == [1]
    with pytest.raises(ValueError):
        set_attention_route(layer, "fast")


def test_fp32_chunked_equals_one_shot_fp32_and_fp64_at_20k_keys():
    """bf16 inputs with RMS-normed q/k, 12 heads × 128, 20k keys: the route's fp32 result (before the cast
    back) in several query chunks equals one-shot fp32 attention to fp32 rounding and fp64 within 1e-5."""
    q, k, v = rms_normed_inputs(48, 20_000)
    chunked = fp32_chunked_attention(q, k, v, chunk=7)  # 7 chunks of 7 queries, the last of 6
    assert chunked.dtype == torch.float32
    scores = (q.float() * (1.0 / math.sqrt(128))) @ k.float().transpose(-1, -2)  # all 48 queries at once
    one_shot = torch.softmax(scores, dim=-1) @ v.float()
    # fp32 rounding of a 20k-term sum, sqrt(n) ulps: the two agree bit for bit under the AVX2 kernels, and by 5e-6
    # of the largest value under the compat family (ATen's default level, MKL COMPATIBLE), whose GEMM adds the keys
    # in another order for 7 queries than for 48
    assert float((chunked - one_shot).abs().max()) <= math.sqrt(20_000) * 2**-24 * float(one_shot.abs().max())
    ref = reference(q, k, v)
    error = float((chunked.double() - ref).abs().max() / ref.abs().max())
    assert error < 1e-5
    # control: a bf16 softmax (scores and probabilities rounded) misses the same bound by far
    probs = torch.softmax(scores.bfloat16().float(), dim=-1).bfloat16().float()
    assert float(((probs @ v.float()).double() - ref).abs().max() / ref.abs().max()) > 1e-3


def test_chunk_length_keeps_scores_within_budget_and_under_2_to_the_32_bytes():
    assert fp32_chunk_length(1, 12, 20_000, 20_000, budget=1 << 26) == (1 << 26) // (12 * 20_000)
    assert fp32_chunk_length(1, 12, 50, 50, budget=1 << 26) == 50  # everything in one chunk
    assert fp32_chunk_length(1, 12, 10, 10**9, budget=1 << 40) == 1  # at least one query
    huge = fp32_chunk_length(1, 12, 200_000, 200_000, budget=1 << 40)  # a budget past MPSGraph's limit
    assert 4 * 12 * 200_000 * huge <= 2**32 < 4 * 12 * 200_000 * (huge + 1)


def test_fp32_chunked_peak_scratch_is_within_its_estimate_and_the_budget():
    with kernel_limits(attention_scores=12 * 4000 * 50):  # 50 queries a chunk
        q, k, v = rms_normed_inputs(400, 4000)
        _, peak = peak_allocated_bytes(lambda: fp32_chunked_attention(q, k, v).bfloat16())
        estimate = fp32_chunked_scratch_bytes(1, 12, 400, 4000, 128)
        assert peak <= estimate
        held = 4 * 12 * (2 * 4000 * 128 + 400 * 128)  # fp32 k, v and output
        assert peak - held <= 2 * 4 * attn.score_budget() + 4 * 12 * 50 * 256  # two score copies + q and product
        # control: one chunk of all 400 queries needs more than the budget allows
        _, whole = peak_allocated_bytes(lambda: fp32_chunked_attention(q, k, v, chunk=400))
        assert whole - held > 2 * 4 * attn.score_budget()


def test_the_config_key_and_the_plan_reason_name_the_route(tiny):
    assert tiny.runtime.attention == "auto"
    assert describe_route("auto", torch.device("mps")).startswith("attention: fp32_chunked (auto on mps)")
    assert describe_route("auto", torch.device("cpu")) == "attention: fused SDPA in the model dtype (auto on cpu)"
    assert "runtime.attention" in describe_route("fp32_chunked", torch.device("cpu"))


def test_an_unknown_attention_route_in_a_config_is_a_config_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("base: tiny.yaml\nruntime:\n  attention: flash\n")
    with pytest.raises(ConfigError, match="runtime.attention"):
        load_config(path)
    path.write_text("base: tiny.yaml\nruntime:\n  attention: fp32_chunked\n")
    assert load_config(path).runtime.attention == "fp32_chunked"


def test_the_memory_plan_counts_the_fp32_routes_chunk_memory():
    stages = build_stages(load_config("configs/1024_cascade.yaml"))
    sdpa = {s.name: s.working_set() for s in stages}
    fp32 = {s.name: s.working_set() for s in with_attention_route_of(stages, "fp32_chunked")}
    extra = ws.attention_route_bytes("fp32_chunked", 20_000, attn.score_budget())
    assert extra == fp32_chunked_scratch_bytes(1, 12, 20_000, 20_000, 128, budget=attn.score_budget()) > 0
    assert fp32["shape_1024"] - sdpa["shape_1024"] == extra
    assert fp32["texture"] - sdpa["texture"] == extra
    assert fp32["structure"] > sdpa["structure"] and fp32["shape_512"] > sdpa["shape_512"]
    assert fp32["decode"] == sdpa["decode"]  # no attention there
    assert ws.attention_route_bytes("sdpa", 20_000, attn.score_budget()) == 0


def test_the_plan_says_which_attention_route_runs(tiny):
    reasons = Pixal3D.plan(tiny, device="cpu").reasons
    assert "attention: fused SDPA in the model dtype (auto on cpu)" in reasons


def test_on_mps_the_1536_decode_tiles_so_no_tensor_exceeds_2_to_the_32_bytes():
    """At ~45k HR tokens (~20M voxels) the decode's largest tensor (the head's fp32 input) is 4.8 GiB: on
    mps the plan tiles it even with memory to spare; elsewhere, and at 1024, it stays whole."""
    decode = next(s for s in build_stages(load_config("configs/1536_cascade.yaml")) if s.name == "decode")
    assert mb.decode_largest_tensor(ws.hr_tokens(1536)) > 2**32 > mb.decode_largest_tensor(ws.hr_tokens(1024))
    roomy = StageBudget(200 * 2**30, 2 * 2**30)
    assert decode.fitted(roomy).tile_plan is None  # control: no array limit, no tiles
    tiled = decode.fitted(StageBudget(200 * 2**30, 2 * 2**30, array_bytes=attn.device_array_bytes("mps")))
    plan = tiled.tile_plan
    assert plan is not None and tiled.bounded_bytes is None
    per_final = mb.decode_largest_tensor(mb.REFERENCE_GROWTH ** -4, start=plan.start_level)
    assert plan.tile_voxels * per_final <= mb.ARRAY_MARGIN * 2**32
    at_1024 = next(s for s in build_stages(load_config("configs/1024_cascade.yaml")) if s.name == "decode")
    assert at_1024.fitted(StageBudget(200 * 2**30, 2 * 2**30, array_bytes=2**32)).tile_plan is None
    assert attn.device_array_bytes("cpu") is None and attn.device_array_bytes("cuda:0") is None


def test_under_a_tight_budget_the_fp32_route_gets_smaller_chunks_than_sdpa():
    """The route's fp32 copies of k, v and the output are held beside the weights: for the same budget its
    score chunks shrink where sdpa's need not, and a budget sdpa just fits is refused for it."""
    texture = next(s for s in build_stages(load_config("configs/1024_cascade.yaml")) if s.name == "texture")
    [fp32_stage] = with_attention_route_of([texture], "fp32_chunked")
    six = StageBudget(6 * 2**30, int(3.75 * 2**30), explicit=True)
    assert texture.fitted(six).chunks is None  # sdpa: the default chunks fit
    chunks = fp32_stage.fitted(six).chunks
    assert chunks is not None and chunks.attention_scores < attn.score_budget()
    tight = StageBudget(int(5.5 * 2**30), int(3.75 * 2**30), explicit=True)
    assert texture.fitted(tight).chunks is not None
    with pytest.raises(mb.MemoryBudgetError, match="texture"):
        fp32_stage.fitted(tight)
