"""The ``stream`` policy on the tiny cascade: the flows', decoders', DINOv3's and MoGe-2's blocks streamed (copied
into process memory as onto a device) give the eager reference's fingerprints, and the comparison sees one changed block; ``auto``
takes ``stream`` when a budget needs it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipelines import Pixal3D
from pixal3d.staging import Policy
from pixal3d.staging.stream import streamed_units
from tests.support.cascade_fixtures import (  # noqa: F401
    EXAMPLE,
    first_difference,
    run_tiny,
    tiny,
    tiny_cache,
    tiny_reference,
)

STREAMED = {"sparse_structure_flow_model", "shape_slat_flow_model_512", "shape_slat_flow_model_1024",
            "tex_slat_flow_model_1024", "shape_slat_decoder", "tex_slat_decoder", "dinov3", "moge"}


def _copied(config):
    return config.with_overrides(runtime=dataclasses.replace(config.runtime, cpu_weights="copied"))


def test_a_streamed_run_with_copied_weights_gives_the_eager_fingerprints(tiny, tiny_reference):
    plan = Pixal3D.plan(_copied(tiny), policy="stream", device="cpu", until="decode")
    assert plan.policy is Policy.stream and set(plan.memory.streamed) == STREAMED
    with Pixal3D.from_plan(plan) as pipe:
        result = pipe.run(EXAMPLE)
        stats = pipe._stream.stats
    actual = result.fingerprints()
    assert actual == tiny_reference, first_difference(actual, tiny_reference)
    assert stats.units > 0 and stats.bytes > 0
    assert stats.unprefetched < stats.units / 2  # most copies started while the block before computed


def test_a_streamed_run_within_a_memory_budget_gives_the_eager_fingerprints(tiny, tiny_reference):
    """The budget's plan (chunks, NAF mode: full here, as the reference) with every block streamed: the resident
    reference's bits, and the plan says the smallest budget it fits."""
    plan = Pixal3D.plan(_copied(tiny), policy="stream", device="cpu", until="decode", memory_budget="1.5G")
    assert plan.policy is Policy.stream and plan.memory_budget == int(1.5 * 2**30)
    assert any(r.startswith("the smallest memory budget this cascade plans within (stream)") for r in plan.reasons)
    with Pixal3D.from_plan(plan) as pipe:
        actual = pipe.run(EXAMPLE).fingerprints()
    assert actual == tiny_reference, first_difference(actual, tiny_reference)


def _nudged(name, load):
    """A loader whose texture flow's second streamed block has its largest weight one ulp off (the control)."""
    def loader():
        model = load()
        if name == "tex_slat_flow_model_1024":
            tensor = max(streamed_units(model)[1].tensors, key=lambda t: t.source.numel())
            changed = tensor.source.read()  # copied weights: a FileSlice of the checkpoint
            changed.view(torch.int16).bitwise_xor_(1)  # bf16 in the file: the last mantissa bit of every value
            object.__setattr__(tensor, "source", changed)
        return model
    return loader


def test_control_one_streamed_block_one_ulp_off_changes_the_texture(tiny, tiny_reference):
    result = run_tiny(_copied(tiny), "stream", wrap_loader=_nudged)
    actual = result.fingerprints()
    assert first_difference(actual, tiny_reference).startswith("first differing stage 'texture'")


def test_stream_is_refused_where_nothing_can_stream(tiny):
    from pixal3d.staging import PolicyError

    with pytest.raises(PolicyError, match="needs models that can stream"):
        Pixal3D.plan(tiny, policy="stream", device="cpu", until="preprocess")
