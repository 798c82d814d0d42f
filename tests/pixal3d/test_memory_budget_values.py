"""Issue 30, item 9: memory budget values as a user writes them. A budget above the machine's memory is warned
about in the plan (it bounds nothing); sizes in messages show in a unit that shows them (``1.0 KiB``, not
``0.00 GiB``); a lower-case ``b`` (bits) is refused with the spelling to use."""
from __future__ import annotations

import psutil
import pytest

from pipelines import Pixal3D
from pixal3d.config import SettingError
from pixal3d.memory_budget import GIB, format_bytes, parse_budget
from tests.support.cascade_fixtures import EXAMPLE, TINY_CONFIG, tiny_cache  # noqa: F401
from tests.support.cli import one_error_line, run_cli


@pytest.mark.parametrize("value, shown", [(512, "512 B"), (1024, "1.0 KiB"), (100 * 2**20, "100.0 MiB"),
                                          (2 * GIB, "2.00 GiB"), (3 * 2**40, "3.00 TiB")])
def test_sizes_show_in_the_largest_unit_they_reach(value, shown):
    assert format_bytes(value) == shown


@pytest.mark.parametrize("text, meant", [("8Gb", "8GB"), ("8gb", "8GB"), ("8gib", "8GiB"), ("512mb", "512MB"),
                                         ("100b", "100B")])
def test_a_lower_case_b_is_bits_and_is_refused_with_the_spelling_to_use(text, meant):
    with pytest.raises(SettingError, match="bits") as caught:
        parse_budget(text)
    assert repr(meant) in str(caught.value)


@pytest.mark.parametrize("text, expected", [("8GB", 8 * GIB), ("8GiB", 8 * GIB), ("8g", 8 * GIB), ("100B", 100)])
def test_upper_case_byte_units_and_bare_prefixes_still_read(text, expected):
    assert parse_budget(text) == expected


def test_a_one_kilobyte_budget_is_refused_showing_it_as_a_kilobyte(tiny_cache, tmp_path, capsys):
    code, _, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", tmp_path / "o.glb", "--memory-budget", "1K")
    line = one_error_line(err)
    assert code == 2 and "the memory budget is 1.0 KiB" in line and "0.00 GiB" not in line, line
    assert "the smallest budget this cascade plans within is" in line and "(--memory-budget " in line, line


def test_a_budget_above_the_machines_memory_is_warned_about_in_the_plan(tiny_cache, tmp_path, capsys):
    total = psutil.virtual_memory().total
    code, out, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", tmp_path / "o.glb", "--plan",
                          "--memory-budget", "1000T")
    assert code == 0, err
    assert f"warning: the memory budget 1000.00 TiB is more than this machine's {format_bytes(total)}" in out, out
    assert "bounds nothing" in out and "--memory-budget" in out
    plan = Pixal3D.plan(TINY_CONFIG, device="cpu", memory_budget=total // 2)  # control: a real bound, no warning
    assert not any("bounds nothing" in r for r in plan.reasons)
