"""The guard's decisions as pure functions, replayed on synthetic reading sequences."""
import re

import pytest

from pixal3d.guard import AdmissionState, GuardConfig, Reading, WatchState, decide_start, decide_stop, main

GIB = 2**30


def admit(config, readings):
    """Replay readings through decide_start; return the decisions in order."""
    state, decisions = None, []
    for reading in readings:
        decision, state = decide_start(config, reading, state)
        decisions.append(decision)
        if decision.action != "wait":
            break
    return decisions


def watch(config, readings, swap_at_start=0):
    state, decisions = WatchState(swap_at_start), []
    for reading in readings:
        decision, state = decide_stop(config, reading, state)
        decisions.append(decision)
        if decision.action == "stop":
            break
    return decisions


def test_starts_at_once_when_memory_is_free():
    (decision,) = admit(GuardConfig(), [Reading(0.0, 55.0, 0)])
    assert decision.action == "start"


def test_waits_while_memory_is_short_then_starts():
    decisions = admit(GuardConfig(wait_free=40), [Reading(0, 30.0, 0), Reading(5, 39.9, 0),
                                                  Reading(10, 40.0, 0)])
    assert [d.action for d in decisions] == ["wait", "wait", "start"]
    assert decisions[0].reason == "memory available 30% < 40%"


def test_unknown_memory_does_not_block_the_start():
    assert admit(GuardConfig(), [Reading(0, None, None)])[0].action == "start"


def test_gives_up_after_the_start_timeout():
    config = GuardConfig(start_timeout=10, poll=5)
    decisions = admit(config, [Reading(t, 20.0, 0) for t in (100, 105, 110, 115)])
    assert [d.action for d in decisions] == ["wait", "wait", "give_up"]
    assert "20% < 40%" in decisions[-1].reason


def test_busy_process_blocks_and_a_gap_between_jobs_is_not_enough():
    config = GuardConfig(busy=(re.compile("render"),), quiet_for=2.0, poll=1.0)
    busy = ("python render.py --scene a",)
    pattern = [busy, (), busy, (), (), (), ()]  # the timer restarts at t=2
    decisions = admit(config, [Reading(float(t), 90.0, 0, b) for t, b in enumerate(pattern)])
    assert [d.action for d in decisions] == ["wait"] * 5 + ["start"]
    assert decisions[0].reason.startswith("busy: 'python render.py")
    assert decisions[1].reason == "quiet for 0 s of 2 s"
    assert decisions[4].reason == "quiet for 1 s of 2 s"


def test_quiet_timer_needs_busy_patterns():
    config = GuardConfig(quiet_for=60.0)
    assert admit(config, [Reading(0.0, 90.0, 0)])[0].action == "start"


def test_quiet_state_restarts_whenever_a_busy_process_is_seen():
    config = GuardConfig(busy=(re.compile("x"),), quiet_for=1.0)
    _, state = decide_start(config, Reading(3.0, 90.0, 0), AdmissionState(began=0.0, quiet_since=1.0))
    assert state.quiet_since == 1.0
    _, state = decide_start(config, Reading(4.0, 90.0, 0, ("x",)), state)
    assert state.quiet_since is None


def test_swap_growth_over_budget_stops_and_equal_growth_does_not():
    config = GuardConfig(swap_budget=8 * GIB)
    base = 3 * GIB
    decisions = watch(config, [Reading(1, 50.0, base + 8 * GIB), Reading(2, 50.0, base + 8 * GIB + 1)],
                      swap_at_start=base)
    assert [d.action for d in decisions] == ["run", "stop"]
    assert "swap grew 8.00 GiB since the start > budget 8.00 GiB" in decisions[-1].reason


def test_unknown_swap_never_stops():
    decisions = watch(GuardConfig(), [Reading(1, 50.0, None)] * 3, swap_at_start=None)
    assert [d.action for d in decisions] == ["run"] * 3


def test_two_consecutive_low_polls_stop_one_does_not():
    config = GuardConfig(kill_free=10)
    decisions = watch(config, [Reading(1, 9.0, 0), Reading(2, 50.0, 0), Reading(3, 9.0, 0),
                               Reading(4, None, 0), Reading(5, 9.0, 0), Reading(6, 5.0, 0)])
    assert [d.action for d in decisions] == ["run", "run", "run", "run", "run", "stop"]
    assert decisions[-1].reason == "memory available 5% < 10% for 2 polls in a row"


@pytest.mark.parametrize("field,value", [("wait_free", 101), ("kill_free", -1), ("poll", 0),
                                         ("grace", -1), ("swap_budget", -5)])
def test_config_rejects_values_out_of_range(field, value):
    with pytest.raises(ValueError, match=field):
        GuardConfig(**{field: value})


@pytest.mark.parametrize("args,message", [
    (["--wait-free", "140"], "out of range"), (["--kill-free", "ten"], "not a percentage"),
    (["--poll", "0s"], "more than zero"), (["--busy", "ltx("], "bad regex"),
    (["--swap-budget", "lots"], "not a size"), (["--quiet-for", "5 minutes"], "not a duration"),
    (["--grace=-1s"], "not a duration"), ([], "needs a command"),
])
def test_bad_options_exit_2_before_waiting(args, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main([*args, "--", "true"] if args else ["--poll", "1s"])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
