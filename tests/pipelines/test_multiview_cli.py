"""The command on views folders (``--views DIR``, ``--num-views N``): the library's run, batches, resume, --plan,
and every refusal in one line before any weight is read."""
from __future__ import annotations

import json
import shutil

import pytest

from pipelines import Pixal3D
from tests.support.cascade_fixtures import TINY_CONFIG, tiny_cache  # noqa: F401
from tests.support.cli import one_error_line, run_cli
from tests.support.views_fixtures import EXAMPLE_VIEWS, fast_mv_config, swapped_views  # noqa: F401


def _prints(record: dict) -> dict:
    return {s["stage"]: s["fingerprints"] for s in record["stages"] if s["fingerprints"]}


def test_the_command_on_a_views_folder_is_the_librarys_run(fast_mv_config, tmp_path, capsys):
    out = tmp_path / "ex.glb"
    code, stdout, err = run_cli(capsys, "--views", EXAMPLE_VIEWS, "--config", fast_mv_config, "-o", out, "--seed", 9,
                             "--memory-policy", "staged")
    assert code == 0, err
    record = json.loads(out.with_suffix(".run.json").read_text())
    assert "views: 4 posed views from" in stdout and "frame 0 at the front pose" in stdout
    assert record["views"]["names"] == ["azim000", "azim090", "azim180", "azim270"] and record["cli"]["settings"][
        "num_views"] is None
    with Pixal3D.from_config(fast_mv_config, policy="resident", device="cpu") as pipe:
        result = pipe.run(views=EXAMPLE_VIEWS, seed=9)
    assert result.fingerprints() == _prints(record)
    assert result.mesh.glb == out.read_bytes()


def test_two_folders_are_a_batch_one_bad_folder_costs_only_itself_and_a_work_dir_resumes(fast_mv_config, tmp_path,
                                                                                        capsys):
    good = swapped_views(tmp_path / "good")
    bad = tmp_path / "bad"
    shutil.copytree(EXAMPLE_VIEWS, bad)
    (bad / "view02_azim180.png").unlink()
    args = ["--views", good, bad, "--config", fast_mv_config, "-o", tmp_path / "out", "--quiet",
            "--work-dir", tmp_path / "work", "--num-views", 3]
    code, _, err = run_cli(capsys, *args)
    assert code == 1  # an input failed
    assert "skipped bad: " in err and "frame 2's file view02_azim180.png does not exist" in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["batch.json", "good.glb", "good.run.json"]
    first = json.loads((tmp_path / "out" / "good.run.json").read_text())
    assert first["views"]["views"] == 3 and first["views"]["given"] == 4
    shutil.copy(EXAMPLE_VIEWS / "view02_azim180.png", bad)  # fixed: the same command finishes what is left
    code, _, err = run_cli(capsys, *args)
    assert code == 0, err
    again = json.loads((tmp_path / "out" / "good.run.json").read_text())
    assert all(s["reused"] for s in again["stages"]) and _prints(again) == _prints(first)
    assert not any(s["reused"] for s in json.loads((tmp_path / "out" / "bad.run.json").read_text())["stages"])


def test_plan_takes_views_and_reads_no_weights(fast_mv_config, tmp_path, capsys, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("--plan must not read weights")
    monkeypatch.setattr("pipelines.loaders.load_model", forbidden)
    code, stdout, err = run_cli(capsys, "--views", EXAMPLE_VIEWS, "--config", fast_mv_config, "--plan",
                             "-o", tmp_path / "o.glb")
    assert code == 0, err
    assert "views" in stdout and "features" in stdout and "moge" not in stdout
    assert not (tmp_path / "o.glb").exists()


@pytest.mark.parametrize("case", ["views on an image config", "an image on a views config", "no input",
                                  "num-views without views", "fov with views", "too many views", "no transforms",
                                  "not a folder"])
def test_every_wrong_input_is_one_line_and_exit_2_before_any_weight(case, tmp_path, capsys):
    mv = "tiny_mv"
    image = EXAMPLE_VIEWS / "view00_azim000.png"
    args, expected = {
        "views on an image config": (["--views", EXAMPLE_VIEWS, "--config", TINY_CONFIG],
                                     "--views needs a multi-view config (tiny.yaml takes images)"),
        "an image on a views config": ([image, "--config", mv], "tiny_mv.yaml takes posed views: pass --views DIR"),
        "no input": (["--config", TINY_CONFIG], "no input: pass an image, a folder of images, or --views DIR"),
        "num-views without views": ([image, "--num-views", 2, "--config", TINY_CONFIG],
                                    "--num-views: a number of views applies to a multi-view config"),
        "fov with views": (["--views", EXAMPLE_VIEWS, "--fov", 30, "--config", mv],
                           "--fov: a field of view does not apply to posed views"),
        "too many views": (["--views", EXAMPLE_VIEWS, "--num-views", 5, "--config", mv],
                           "--num-views 5 is above the 4 frames"),
        "no transforms": (["--views", tmp_path, "--config", mv], "has no transforms.json"),
        "not a folder": (["--views", image, "--config", mv], "is a file, not a folder"),
    }[case]
    code, _, err = run_cli(capsys, *args, "-o", tmp_path / "o.glb", "--quiet")
    assert code == 2 and expected in one_error_line(err)
    assert not (tmp_path / "o.glb").exists()
