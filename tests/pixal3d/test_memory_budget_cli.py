"""--memory-budget on the command: bad sizes and budgets no config can meet are one line before any weight is
read; a run under a budget records it and what each stage was fitted to (NAF mode, tiles, chunks) in run.json."""
from __future__ import annotations

import json

import pytest

from pipelines import cli
from pixal3d.memory_budget import CAMERA_BAND_ROWS
from tests.support.cascade_fixtures import EXAMPLE, TINY_CONFIG, tiny_cache  # noqa: F401


def _run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("budget", "message"), [
    ("7x", "--memory-budget: memory budget '7x' is not a size; write e.g. 8G"),
    ("100M", "stage 'preprocess' needs at least 450.0 MiB (weights 0 B and a working set of 0 B) but the "
             "memory budget is 100.0 MiB; raise --memory-budget or use a smaller config"),
])
def test_a_budget_that_cannot_be_read_or_met_is_one_line_before_any_weight_is_read(tiny_cache, tmp_path, capsys,
                                                                                    monkeypatch, budget, message):
    import pipelines.loaders

    monkeypatch.setattr(pipelines.loaders, "load_model", lambda *a, **k: pytest.fail("a weight was read"))
    code, _, err = _run(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", tmp_path / "o.glb", "--memory-budget", budget)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert not list(tmp_path.iterdir())


def test_a_run_records_its_budget_and_what_each_stage_was_fitted_to(tiny_cache, tmp_path, capsys):
    out = tmp_path / "o.glb"
    code, stdout, err = _run(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", out, "--memory-budget", "2G")
    assert code == 0, err
    record = json.loads(out.with_suffix(".run.json").read_text())
    assert record["memory_budget"] == 2 * 2**30
    naf = {name: {"naf_mode": "full"} for name in ("shape_512", "shape_1024", "texture")}
    assert record["stage_choices"] == {"camera": {"conv_band_rows": CAMERA_BAND_ROWS}, **naf}  # MoGe-2's bands (CPU)
    assert "memory budget 2.00 GiB: every stage's work is bounded to it" in stdout
    assert "1.56 GiB usable (the memory budget;" in record["policy_reasons"][0]  # the policy chose within it
    assert any("NAF full (the reference's values) for shape_512, shape_1024, texture" in r
               for r in record["policy_reasons"])
    code, _, err = _run(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", tmp_path / "p.glb", "--quiet")
    assert code == 0, err
    control = json.loads((tmp_path / "p.run.json").read_text())  # without a budget: none recorded
    assert control["memory_budget"] is None and control["stage_choices"] == naf  # and no bands: MoGe-2 whole
    assert "memory budget" not in control["policy_reasons"][0]
