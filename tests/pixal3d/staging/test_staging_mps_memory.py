"""The MPS allocator limit check, on injected Macs (no Mac here): a setting that lets a run swap is refused,
PyTorch's default is lowered at run time, a safe setting is left alone."""
import pytest

from pixal3d.staging.mps_memory import (
    DEFAULT_HIGH,
    GIB,
    HIGH_VAR,
    LOW_VAR,
    MpsMemoryLimitError,
    apply_mps_memory_limit,
    check_mps_memory_limit,
)
from tests.support.cascade_fixtures import tiny, tiny_cache  # noqa: F401

MAC_48 = {"recommended_bytes": int(37.44 * GIB), "physical_bytes": 48 * GIB}  # a 48 GB M-series Mac


class FakeMps:
    def __init__(self):
        self.fractions = []

    def set_per_process_memory_fraction(self, fraction):
        assert isinstance(fraction, float)  # torch.mps refuses anything else
        self.fractions.append(fraction)


def test_pytorch_default_lets_a_48gb_mac_swap_and_is_lowered_to_the_budget():
    limit = check_mps_memory_limit(env={}, **MAC_48)
    assert (limit.high, limit.low, limit.from_environment) == (DEFAULT_HIGH, 1.4, False)
    assert limit.limit_bytes > 48 * GIB and limit.lets_swap  # 1.7 × 37.44 GiB = 63.6 GiB
    assert limit.safe_ratios() == (1.08, 0.88)               # 40.8 GiB budget / 37.44 GiB
    api = FakeMps()
    assert apply_mps_memory_limit(limit, api=api) == 1.08 and api.fractions == [1.08]
    assert 1.08 * limit.recommended_bytes <= limit.budget_bytes


@pytest.mark.parametrize(("high", "needle"), [("0.0", "0 turns the limit off"), ("1.5", "56.2 GiB")])
def test_a_user_setting_that_lets_the_run_swap_is_refused_with_the_safe_setting(high, needle):
    with pytest.raises(MpsMemoryLimitError) as err:
        check_mps_memory_limit(env={HIGH_VAR: high, LOW_VAR: "0.0"}, **MAC_48)
    text = str(err.value)
    assert f"{HIGH_VAR}={high}" in text and needle in text
    assert f"{HIGH_VAR}=1.08 {LOW_VAR}=0.88" in text


def test_a_safe_user_setting_is_accepted_and_left_alone():
    limit = check_mps_memory_limit(env={HIGH_VAR: "1.0", LOW_VAR: "0.8"}, **MAC_48)
    assert not limit.lets_swap and limit.limit_bytes == int(37.44 * GIB)
    api = FakeMps()
    assert apply_mps_memory_limit(limit, api=api) is None and api.fractions == []


def test_a_default_that_fits_is_not_changed():
    limit = check_mps_memory_limit(env={}, recommended_bytes=20 * GIB, physical_bytes=48 * GIB)
    assert not limit.lets_swap  # 1.7 × 20 = 34 GiB <= 40.8 GiB
    assert apply_mps_memory_limit(limit, api=FakeMps()) is None


def test_high_below_the_default_low_watermark_is_refused_as_the_allocator_would():
    with pytest.raises(MpsMemoryLimitError, match=f"{LOW_VAR}=1.4 is above {HIGH_VAR}=1"):
        check_mps_memory_limit(env={HIGH_VAR: "1.0"}, **MAC_48)


@pytest.mark.parametrize("value", ["abc", "2.5", "-0.1"])
def test_invalid_values_name_the_variable(value):
    with pytest.raises(MpsMemoryLimitError, match=HIGH_VAR):
        check_mps_memory_limit(env={HIGH_VAR: value}, **MAC_48)


@pytest.mark.parametrize("ram_gib", [8, 16, 24, 36, 48, 64, 96, 128, 192])
@pytest.mark.parametrize("recommended_share", [0.65, 0.75, 0.8])
def test_safe_ratios_fit_every_mac_and_the_default_fits_none(ram_gib, recommended_share):
    limit = check_mps_memory_limit(env={}, recommended_bytes=int(recommended_share * ram_gib * GIB),
                                   physical_bytes=ram_gib * GIB)
    high, low = limit.safe_ratios()
    assert 0 < low <= high <= 2.0
    assert high * limit.recommended_bytes <= limit.budget_bytes
    assert limit.lets_swap  # control: PyTorch's default 1.7 exceeds the budget on all of them


def test_a_stage_change_empties_the_mps_cache_after_collecting_the_released_models(monkeypatch):
    """On a Mac, memory freed by a release goes back to Metal only through torch.mps.empty_cache()
    (which waits for the command buffers, then frees the allocator's cached blocks)."""
    import gc
    from collections import Counter

    import torch

    from pixal3d.staging import StagedModels
    from tests.support.substitute_pipeline import STAGES, make_loaders

    calls = []
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "empty_cache", lambda: calls.append("empty_cache"))
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect") or collect(*a))
    models = StagedModels(make_loaders(Counter()), STAGES, preserve_rng=False)  # no MPS generator to save here
    models.enter("denoise")
    models["encoder"], models["denoiser"]
    calls.clear()
    models.enter("decode")  # releases both
    assert calls == ["collect", "empty_cache"]
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)  # control: no MPS, no call
    calls.clear()
    models.enter("denoise")
    models["denoiser"]
    models.enter("decode")
    assert calls == ["collect"]


def test_script_prints_the_export_line_for_a_given_mac(capsys, monkeypatch):
    from scripts import mps_memory_limit

    monkeypatch.delenv(HIGH_VAR, raising=False)
    monkeypatch.delenv(LOW_VAR, raising=False)
    assert mps_memory_limit.main(["--recommended-gib", "37.44", "--ram-gib", "48"]) == 0
    out = capsys.readouterr().out
    assert "would swap" in out and f"export {HIGH_VAR}=1.08 {LOW_VAR}=0.88" in out
    monkeypatch.setenv(HIGH_VAR, "0.0")
    assert mps_memory_limit.main(["--recommended-gib", "37.44", "--ram-gib", "48"]) == 2
    assert "0 turns the limit off" in capsys.readouterr().err


def _fake_mps(monkeypatch, env):
    """A 48 GB Mac as the plan sees it: detect_machine and the allocator's numbers injected."""
    from pipelines import pipeline, plan
    from pixal3d.staging import Machine

    mac = Machine("mps", "Apple GPU", True, 48 * GIB, 40 * GIB, 48 * GIB, 40 * GIB)
    monkeypatch.setattr(pipeline, "detect_machine", lambda device: mac)
    monkeypatch.setattr(pipeline.torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(plan, "check_mps_memory_limit", lambda: check_mps_memory_limit(
        env=env, recommended_bytes=int(37.44 * GIB), physical_bytes=48 * GIB))


def test_the_plan_on_mps_refuses_a_swapping_limit_and_says_what_the_run_applies(monkeypatch, tiny):
    from pipelines import Pixal3D

    _fake_mps(monkeypatch, {HIGH_VAR: "0"})
    with pytest.raises(MpsMemoryLimitError, match="0 turns the limit off"):
        Pixal3D.plan(tiny, device="mps")
    _fake_mps(monkeypatch, {})  # PyTorch's default: the run lowers it itself
    plan = Pixal3D.plan(tiny, device="mps", policy="staged")
    assert plan.mps_limit is not None and plan.mps_limit.lets_swap
    assert any("the run lowers the MPS limit to 1.08" in r for r in plan.reasons)
    assert "Metal allocations limited to" in plan.table()
    assert Pixal3D.plan(tiny, device="cpu").mps_limit is None  # control: no MPS, no check
