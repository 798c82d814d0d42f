"""The real 1024 cascade planned within 4 GiB from its checkpoints' headers (faked Hub answers, nothing downloaded):
``auto`` streams the flows' and decoders' blocks, every stage fits with the interpreter, the plan states the
smallest budget that works and what streaming copies; a budget below that is refused naming the stage and the
smallest budget; whole models alone cannot meet 4 GiB (the control)."""
from __future__ import annotations

import pytest

from pipelines import Pixal3D
from pixal3d.memory_budget import GIB, PROCESS_BYTES, MemoryBudgetError
from pixal3d.staging import Policy
from tests.support.header_hub import REAL, hub  # noqa: F401

STREAMED = {"sparse_structure_flow_model", "shape_slat_flow_model_512", "shape_slat_flow_model_1024",
            "tex_slat_flow_model_1024", "shape_slat_decoder", "tex_slat_decoder"}


def test_four_gib_plans_every_stage_of_the_real_cascade_by_streaming_blocks(hub):
    plan = Pixal3D.plan(REAL, device="cpu", memory_budget="4G")
    assert plan.policy is Policy.stream and set(plan.memory.streamed) == STREAMED
    for row in plan.memory.stages:
        assert row.total_bytes + PROCESS_BYTES <= 4 * GIB, row
        if STREAMED & set(row.models):
            whole = sum(plan.memory.model_bytes[m] for m in row.models)
            assert row.weight_bytes < whole / 2, row  # the blocks in flight, not the models
            assert row.streamed_bytes > 0
    flows = {r.name: r for r in plan.memory.stages}
    assert flows["shape_1024"].streamed_bytes > 2.5 * GIB  # one forward copies every block of a 1.3B flow
    assert plan.choices()["decode"]["tiles"]["start_level"] >= 1
    text = plan.table()
    assert "the smallest memory budget this cascade plans within (stream)" in text
    assert "of blocks copied per forward" in text and "GB/s" in text
    smallest = next(r for r in plan.reasons if r.startswith("the smallest memory budget"))
    assert float(smallest.split(": ")[1].split(" GiB")[0]) <= 4.0


def test_a_budget_below_the_smallest_is_refused_naming_the_stage_and_the_smallest_budget(hub):
    plan = Pixal3D.plan(REAL, device="cpu", memory_budget="4G")
    smallest = float(next(r for r in plan.reasons if r.startswith("the smallest")).split(": ")[1].split(" GiB")[0])
    with pytest.raises(MemoryBudgetError, match=r"stage '\w+' needs at least .* the smallest budget this cascade "
                                                r"plans within is") as caught:
        Pixal3D.plan(REAL, device="cpu", memory_budget=f"{smallest - 0.05:.2f}G")
    assert caught.value.smallest == pytest.approx(smallest * GIB, abs=0.011 * GIB)
    Pixal3D.plan(REAL, device="cpu", memory_budget=f"{smallest:.2f}G")  # and at it, it plans


def test_control_whole_models_cannot_meet_four_gib(hub):
    with pytest.raises(MemoryBudgetError, match="the smallest budget this cascade plans within is"):
        Pixal3D.plan(REAL, device="cpu", memory_budget="4G", policy="staged")
