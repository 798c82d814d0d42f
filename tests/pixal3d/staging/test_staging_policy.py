"""Device policy: the memory plan from model sizes, the auto choice per machine, offload refusal, the table."""

import pytest
import torch

from pixal3d.staging import (
    Machine,
    MemoryPlan,
    Policy,
    PolicyError,
    detect_machine,
    format_plan,
    resolve_policy,
)
from pixal3d.staging.policy import choose_policy, placement

GB = 10**9
GiB = 2**30


def unified(available_gb: float) -> Machine:
    n = int(available_gb * GB)
    return Machine("mps", "Apple M-series", True, n, n, n, n)


def discrete(gpu_gb: float, host_gb: float) -> Machine:
    g, h = int(gpu_gb * GB), int(host_gb * GB)
    return Machine("cuda:0", "Discrete GPU", False, g, g, h, h)


# Roughly Pixal3D's shape: 17 GB of weights over five stages, texture the largest working set.
PLAN = MemoryPlan.build(
    {"cond": 1 * GB, "ss_flow": 4 * GB, "shape_flow": 4 * GB, "tex_flow": 4 * GB, "decoders": 4 * GB},
    {
        "structure": ["cond", "ss_flow"],
        "shape": ["cond", "shape_flow"],
        "texture": ["cond", "tex_flow"],
        "decode": ["decoders"],
        "export": [],
    },
    {"structure": 1 * GB, "shape": 2 * GB, "texture": int(4.5 * GB), "decode": 3 * GB, "export": 2 * GB},
)


def test_plan_totals():
    assert PLAN.all_weights == 17 * GB
    assert PLAN.staged_peak == int(9.5 * GB)  # texture: 1 + 4 weights, 4.5 working
    assert PLAN.resident_peak == int(21.5 * GB)


def test_plan_needs_a_size_for_every_model():
    with pytest.raises(PolicyError, match=r"\['vae'\]"):
        MemoryPlan.build({"a": 1}, {"s": ["a", "vae"]})


@pytest.mark.parametrize(
    ("machine", "expected"),
    [
        (unified(24), Policy.staged),  # 21.5 GB resident > 85% of 24
        (unified(128), Policy.resident),
        (discrete(80, 64), Policy.resident),
        (discrete(12, 64), Policy.offload),  # largest stage 9.5 GB fits 85% of 12; host holds 17
        (discrete(12, 8), Policy.staged),  # host too small for pinned copies
        (discrete(6, 64), Policy.staged),  # not even the largest stage fits the GPU
    ],
)
def test_auto_choice_per_machine(machine, expected):
    policy, reasons = choose_policy(PLAN, machine)
    assert policy is expected
    assert reasons and all(isinstance(r, str) for r in reasons)


def test_auto_reasons_give_the_numbers():
    _, reasons = choose_policy(PLAN, discrete(12, 64))
    text = "\n".join(reasons)
    assert "20.02 GiB" in text  # resident need, 21.5 GB
    assert "8.85 GiB" in text  # largest stage, 9.5 GB
    _, reasons = choose_policy(PLAN, discrete(6, 64))
    assert any(r.startswith("warning:") and "out-of-memory" in r for r in reasons)


def test_auto_never_offloads_on_unified_memory():
    for gb in (8, 16, 24, 64):
        assert choose_policy(PLAN, unified(gb))[0] in (Policy.staged, Policy.resident)


def test_offload_is_refused_on_unified_memory_with_the_next_step():
    with pytest.raises(PolicyError, match="unified memory.*policy=staged"):
        resolve_policy("offload", PLAN, unified(24))


def test_resolve_explicit_policies_and_auto():
    assert resolve_policy("auto", PLAN, unified(24))[0] is Policy.staged
    policy, reasons = resolve_policy("eager", PLAN, unified(24))
    assert policy is Policy.eager and "requested explicitly" in reasons[0]
    assert any("warning" in r for r in reasons)  # 21.5 GB resident on 24 GB unified
    assert resolve_policy(Policy.offload, PLAN, discrete(12, 64))[0] is Policy.offload
    with pytest.raises(PolicyError, match="unknown policy 'lazy'"):
        resolve_policy("lazy", PLAN, unified(24))


def test_auto_must_be_resolved_before_it_becomes_a_placement():
    with pytest.raises(PolicyError, match="resolved first"):
        placement("auto")
    with pytest.raises(PolicyError, match="unknown policy 'lazy'"):
        placement("lazy")


def test_plan_table_lists_every_stage_the_machine_and_the_choice():
    machine = discrete(12, 64)
    policy, reasons = choose_policy(PLAN, machine)
    table = format_plan(PLAN, machine, policy, reasons)
    lines = table.splitlines()
    assert lines[0].split() == ["stage", "models", "weights", "working", "set", "total"]
    assert set(lines[1]) <= {"-", " "}
    row = next(line for line in lines if line.startswith("texture"))
    assert "cond, tex_flow" in row and row.endswith("8.85 GiB")
    assert "policy: offload" in table
    assert "Discrete GPU (cuda:0, discrete memory): GPU 11.18 GiB available" in table
    assert all(f"  - {r}" in table for r in reasons)


def test_detect_machine_on_cpu_is_unified_with_host_memory():
    machine = detect_machine("cpu")
    assert machine.unified and machine.device == "cpu"
    assert 0 < machine.device_available <= machine.device_total == machine.host_total


def test_a_memory_budget_limits_what_auto_may_choose():
    """--memory-budget bounds the whole process, models included: on a machine where every model fits, a
    budget below the resident need makes auto stage (control: no budget keeps them resident); on a discrete
    GPU a budget below the pinned copies' size rules out offload; a budget above the machine changes nothing."""
    big = unified(128)
    assert choose_policy(PLAN, big)[0] is Policy.resident
    policy, reasons = choose_policy(PLAN, big, limit=10 * GB)
    assert policy is Policy.staged and "the memory budget" in reasons[0]
    assert not any(r.startswith("warning:") for r in reasons)  # the largest stage (9.5 GB) fits 10 GB
    _, reasons = choose_policy(PLAN, big, limit=9 * GB)
    assert any(r.startswith("warning:") for r in reasons)  # it does not fit 9 GB
    assert choose_policy(PLAN, discrete(12, 64))[0] is Policy.offload
    assert choose_policy(PLAN, discrete(12, 64), limit=int(10.1 * GB))[0] is Policy.staged  # 17 GB of copies
    assert choose_policy(PLAN, big, limit=10**15) == choose_policy(PLAN, big)
    policy, reasons = resolve_policy("resident", PLAN, big, limit=10 * GB)
    assert policy is Policy.resident and any("memory budget" in r and r.startswith("warning:") for r in reasons)
