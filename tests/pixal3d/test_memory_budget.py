"""The memory budget: sizes, the decode's tile plan under shrinking budgets, the one-line refusal, chunk sizes."""
from __future__ import annotations

import pytest

from pixal3d import memory_budget as mb
from pixal3d.memory_budget import GIB, MemoryBudgetError, parse_budget, plan_decode

DECODER_WEIGHTS = int(1.77 * GIB)  # both released decoders (bf16/fp16 torsos)


@pytest.mark.parametrize("text, expected", [("8G", 8 * GIB), ("8GiB", 8 * GIB), ("7.5g", int(7.5 * GIB)),
                                            ("6000M", 6000 * 2**20), ("123456", 123456), (4096, 4096)])
def test_parse_budget_reads_binary_sizes(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("text", ["eight", "8X", "-1G", "0", ""])
def test_parse_budget_names_the_bad_value(text):
    with pytest.raises(ValueError, match="memory budget"):
        parse_budget(text)


def test_a_large_budget_decodes_untiled():
    assert plan_decode(64 * GIB, latent_tokens=20_000, weight_bytes=DECODER_WEIGHTS) is None


def test_smaller_budgets_pick_smaller_tiles_and_every_plan_fits_its_budget():
    costs = mb.DECODE_COSTS
    plans = {}
    for gib in (10, 8, 6, 4):
        plan = plan_decode(gib * GIB, latent_tokens=20_000, weight_bytes=DECODER_WEIGHTS)
        assert plan is not None
        plans[gib] = plan
        voxels = mb.decoded_voxels(20_000)
        held = mb.PROCESS_BYTES + DECODER_WEIGHTS + costs.output_bytes * voxels
        prefix_held = 4 * costs.channels[plan.start_level] * 20_000 * mb.REFERENCE_GROWTH ** plan.start_level \
            if plan.start_level else 0
        assert held + prefix_held + costs.fixed_bytes + costs.voxel_bytes * plan.tile_voxels <= gib * GIB
    tiles = [plans[g].tile_voxels for g in (10, 8, 6, 4)]
    assert tiles == sorted(tiles, reverse=True) and tiles[0] > 2 * tiles[-1]
    assert plans[10].start_level >= plans[4].start_level  # tighter budgets may start tiling earlier


def test_an_impossible_budget_is_one_line_naming_the_stage_the_need_and_the_budget():
    with pytest.raises(MemoryBudgetError) as err:
        plan_decode(2 * GIB, latent_tokens=20_000, weight_bytes=DECODER_WEIGHTS)
    message = str(err.value)
    assert "\n" not in message
    assert "'decode'" in message and "needs at least" in message and "budget is 2.00 GiB" in message
    need = float(message.split("needs at least ")[1].split(" GiB")[0])
    assert need > 2.0  # the need stated is more than the budget


def test_the_budget_bounds_the_decode_estimate():
    free = mb.working_sets()
    bounded = mb.working_sets(budget=8 * GIB, decoder_weight_bytes=DECODER_WEIGHTS)
    assert free["decode"] + DECODER_WEIGHTS > 8 * GIB  # untiled, the decode does not fit 8 GiB
    assert bounded["decode"] + DECODER_WEIGHTS + mb.PROCESS_BYTES <= 8 * GIB
    assert {k: v for k, v in bounded.items() if k != "decode"} == {k: v for k, v in free.items() if k != "decode"}


def test_chunk_sizes_shrink_with_the_memory_left_and_are_restored_in_this_thread_only():
    import threading

    from pixal3d.nn.attention import score_budget
    from pixal3d.nn.limits import current_limits, kernel_limits

    assert mb.attention_score_elements(64 * GIB) == 1 << 26  # the default when it fits
    assert mb.attention_score_elements(96 * 2**20) < 1 << 26
    assert mb.naf_chunk_elements(24 * 2**20) < 1 << 23
    before = score_budget(), current_limits().naf_elements
    assert before == (1 << 26, 1 << 23)
    seen = {}
    with kernel_limits(attention_scores=1 << 20, naf_elements=1 << 18):
        assert (score_budget(), current_limits().naf_elements) == (1 << 20, 1 << 18)
        with kernel_limits(naf_elements=1 << 19):  # one limit changed, the other kept
            assert (score_budget(), current_limits().naf_elements) == (1 << 20, 1 << 19)
        other = threading.Thread(target=lambda: seen.update(other=(score_budget(), current_limits().naf_elements)))
        other.start()
        other.join()
    assert seen["other"] == before  # another thread never saw this block's limits
    assert (score_budget(), current_limits().naf_elements) == before


def test_flow_stage_chunks_default_when_they_fit_shrink_when_short_and_refuse_when_hopeless():
    weights = int(3.8 * GIB)  # DINOv3 + NAF + a 1.3B flow
    roomy = mb.plan_flow_stage("texture", 8 * GIB, weight_bytes=weights, tokens=20_000)
    assert roomy == mb.FlowChunks(attention_scores=1 << 26, naf_elements=1 << 23)
    # just below what the default chunks need: smaller chunks, still a plan
    need = mb.PROCESS_BYTES + weights + 20_000 * mb.FLOW_BYTES_PER_TOKEN \
        + mb.FLOW_FIXED_BYTES
    tight = mb.plan_flow_stage("texture", need - 100 * 2**20, weight_bytes=weights, tokens=20_000)
    assert tight.attention_scores < roomy.attention_scores
    with pytest.raises(MemoryBudgetError, match=r"stage 'texture' needs at least .* budget is 4\.00 GiB"):
        mb.plan_flow_stage("texture", 4 * GIB, weight_bytes=weights, tokens=20_000)
