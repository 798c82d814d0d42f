"""The image_to_mesh command: the offline demo end to end, --plan, several inputs, and every user error
(one line on stderr, non-zero exit, no partial output)."""
from __future__ import annotations

import json
import runpy
import shutil
import sys
from pathlib import Path

import pytest
import numpy as np
import torch
import trimesh
import yaml
from PIL import Image

from pipelines import Pixal3D, pipeline
from pixal3d.staging.fingerprint import fingerprint_tensor
from pixal3d.staging.policy import Machine
from pixal3d import kernels
from tests.support.cascade_fixtures import EXAMPLE, REPO, TINY_CONFIG, tiny, tiny_cache, tiny_reference  # noqa: F401
from tests.support.cli import run_cli, one_error_line, files_in


@pytest.mark.golden
def test_offline_demo_writes_a_glb_and_a_run_json_with_the_eager_fingerprints(tiny_reference, tmp_path, capsys,
                                                                              monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "demo" / "demo.glb"
    code, stdout, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", out, "--memory-policy", "staged")
    assert code == 0, err
    scene = trimesh.load(out)
    assert sum(len(g.faces) for g in scene.geometry.values()) > 100
    record = json.loads((tmp_path / "demo" / "demo.run.json").read_text())
    assert record["seed"] == 42 and record["policy"] == "staged" and record["config"]["name"] == "tiny"
    prints = {s["stage"]: s["fingerprints"] for s in record["stages"] if s["fingerprints"]}
    glb = prints.pop("export")
    assert prints == tiny_reference
    assert record["kernels"] == kernels.describe()  # which kernels made these bits: pins, key, CPU, threads
    assert glb == {"mesh.glb": fingerprint_tensor(torch.from_numpy(np.frombuffer(out.read_bytes(), np.uint8).copy()))}
    assert [s["stage"] for s in record["stages"]][-1] == "export"
    assert all(s["seconds"] >= 0 and s["peak_process_bytes"] > 0 for s in record["stages"])
    assert record["versions"]["torch"] and record["policy_reasons"]
    assert [row["stage"] for row in record["memory"]][-1] == "export"
    assert files_in(out.parent) == ["demo.glb", "demo.run.json"]  # no temporary files left
    table = stdout[stdout.index("stage       seconds"):]
    assert "texture" in table and "MiB" in table and "total" in table


def test_run_on_an_in_memory_image_gives_the_commands_fingerprints_and_glb(tiny_cache, tmp_path, capsys):
    out = tmp_path / "cli.glb"
    code, _, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", out, "--quiet", "--memory-policy", "staged",
                        "--keep-latents", tmp_path / "cli-latents")
    assert code == 0, err
    command = json.loads(out.with_suffix(".run.json").read_text())
    with Pixal3D.from_config(TINY_CONFIG, policy="resident", device="cpu") as pipe:
        result = pipe.run(Image.open(EXAMPLE))
    assert result.fingerprints() == {s["stage"]: s["fingerprints"] for s in command["stages"] if s["fingerprints"]}
    assert result.mesh.glb == out.read_bytes()
    assert result.input == "<image>" and result.save(tmp_path / "lib.glb").read_bytes() == out.read_bytes()
    # the record and the latents the library writes are the command's (new folders made as needed)
    record = json.loads(result.save_record(tmp_path / "lib" / "lib.run.json", output=tmp_path / "lib.glb").read_text())
    assert record["output"] == str(tmp_path / "lib.glb") and record["export"]["path"] == str(tmp_path / "lib.glb")
    assert [(s["stage"], s["fingerprints"]) for s in record["stages"]] == \
        [(s["stage"], s["fingerprints"]) for s in command["stages"]]
    assert record["config"] == command["config"] and record["seed"] == command["seed"]
    mine = torch.load(result.save_latents(tmp_path / "lib" / "latents.pt"))
    theirs = torch.load(tmp_path / "cli-latents" / "example.latents.pt")
    assert mine.keys() == theirs.keys()
    for key, value in mine.items():
        assert torch.equal(value, theirs[key]) if isinstance(value, torch.Tensor) else value == theirs[key], key


def test_plan_prints_the_plan_and_policy_and_reads_no_weights(tiny_cache, tmp_path, capsys, monkeypatch):
    from pipelines import loaders

    def forbidden(*args, **kwargs):
        raise AssertionError("--plan must not read weights")
    monkeypatch.setattr(loaders, "load_model", forbidden)
    monkeypatch.setattr("pixal3d.models.dinov3.load_dinov3", forbidden)
    out = tmp_path / "o.glb"
    code, stdout, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", out, "--plan",
                             "--memory-policy", "auto")
    assert code == 0, err
    assert "policy: resident" in stdout and "shape_slat_flow_model_1024" in stdout and "largest stage" in stdout
    assert not out.exists()


def test_script_wrapper_is_the_command(tiny_cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["image_to_mesh.py", str(EXAMPLE), "--config", str(TINY_CONFIG), "--plan",
                                      "--memory-policy", "staged", "-o", str(tmp_path / "o.glb")])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(REPO / "scripts" / "image_to_mesh.py"), run_name="__main__")
    assert exit_.value.code == 0
    assert "policy: staged" in capsys.readouterr().out


def _fast_config(tmp_path: Path) -> Path:
    """tiny.yaml with one sampler step per stage and a smaller export (for tests that run twice)."""
    path = tmp_path / "fast.yaml"
    steps = {s: {"sampler": {"steps": 1}} for s in ("structure", "shape_512", "shape_1024", "texture")}
    path.write_text(yaml.safe_dump({"base": str(TINY_CONFIG), **steps,
                                    "export": {"texture_size": 64, "decimation_target": 500}}))
    return path


def test_a_folder_of_inputs_gives_one_glb_each_and_resident_models_load_once(tiny_cache, tmp_path, capsys):
    inputs = tmp_path / "in"
    inputs.mkdir()
    for name in ("a.png", "b.png"):
        shutil.copy(EXAMPLE, inputs / name)
    (inputs / "notes.txt").write_text("not an image")
    trace = tmp_path / "trace.jsonl"
    code, _, err = run_cli(capsys, inputs, "--config", _fast_config(tmp_path), "-o", tmp_path / "out", "--quiet",
                        "--memory-policy", "resident", "--trace", trace, "--keep-latents", tmp_path / "lat")
    assert code == 0, err
    assert files_in(tmp_path / "out") == ["a.glb", "a.run.json", "b.glb", "b.run.json", "batch.json"]
    assert files_in(tmp_path / "lat") == ["a.latents.pt", "b.latents.pt"]

    def loads(name: str) -> int:
        records = [json.loads(line) for line in (tmp_path / f"trace.{name}.jsonl").read_text().splitlines()]
        return sum(1 for r in records if r.get("type") == "event" and r.get("kind") in ("load", "reload"))
    assert loads("a") == 10 and loads("b") == 0  # the second image reuses every model (MoGe-2 and the nine others)


def test_missing_input(tmp_path, capsys):
    code, _, err = run_cli(capsys, tmp_path / "nope.png", "--config", TINY_CONFIG, "-o", tmp_path / "o.glb")
    assert code == 2 and "nope.png does not exist" in one_error_line(err)
    assert files_in(tmp_path) == []


def test_unreadable_image(tmp_path, capsys):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n this is not really a png")
    code, _, err = run_cli(capsys, bad, "--config", TINY_CONFIG, "-o", tmp_path / "out" / "o.glb")
    assert code == 2 and "bad.png" in one_error_line(err)
    assert files_in(tmp_path / "out") == []


def test_invalid_config(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(TINY_CONFIG.read_text().replace("seed: 42", "seed: 42\nsampler_stepz: 3"))
    code, _, err = run_cli(capsys, EXAMPLE, "--config", config, "-o", tmp_path / "o.glb")
    assert code == 2 and "unknown key 'sampler_stepz'" in one_error_line(err) and "c.yaml" in err


def test_missing_weights(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(TINY_CONFIG.read_text().replace("pixal3d: {generate: tiny}", "pixal3d: {local: empty}"))
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(capsys, EXAMPLE, "--config", config, "-o", tmp_path / "out" / "o.glb")
    lines = [line for line in err.splitlines() if line.strip()]  # a local folder: pixal3d-fetch cannot fill it
    assert lines[0] == "pixal3d-image-to-mesh: error: missing weights: 1 file a run needs is not on this machine"
    assert "weights.pixal3d from folder" in lines[1] and "empty" in lines[1] and lines[2] == "    pipeline.json"
    assert lines[-1] == "put the files there or point the config at the folder that holds them"
    assert files_in(tmp_path / "out") == []


def test_not_enough_memory_for_any_policy(tiny_cache, tmp_path, capsys, monkeypatch):
    small = Machine("cpu", "CPU", True, 2**30, 1024, 2**30, 1024)
    monkeypatch.setattr(pipeline, "detect_machine", lambda device: small)
    code, _, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", tmp_path / "out" / "o.glb")
    assert code == 2 and "not enough memory for any policy" in one_error_line(err)
    assert files_in(tmp_path / "out") == []


def test_output_folder_not_writable(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("a file where a folder should be")
    code, _, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", blocker / "sub" / "o.glb")
    assert code == 2 and "is not writable" in one_error_line(err)


def test_a_failure_during_the_run_exits_1_with_one_line_and_no_output(tiny_cache, tmp_path, capsys, monkeypatch):
    from pipelines.structure import StructureStage

    def failing(self, state, models):
        raise OSError("No space left on device")
    monkeypatch.setattr(StructureStage, "run", failing)
    out = tmp_path / "out" / "o.glb"
    code, _, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", out, "--quiet")
    assert code == 1 and "No space left on device" in one_error_line(err)
    assert files_in(out.parent) == []


def test_a_failed_write_leaves_no_partial_glb_and_no_run_json(tiny_cache, tmp_path, capsys, monkeypatch):
    import pixal3d.files

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(pixal3d.files.os, "replace", full_disk)
    out = tmp_path / "out" / "o.glb"
    code, _, err = run_cli(capsys, EXAMPLE, "--config", _fast_config(tmp_path), "-o", out, "--quiet")
    assert code == 1 and "No space left on device" in one_error_line(err)
    assert files_in(out.parent) == []  # neither the GLB, nor its temporary file, nor a run.json


def test_the_stage_table_starts_on_a_line_of_its_own_where_stdout_and_stderr_share_one(tiny_cache, tmp_path):
    """Issue 44 item 12: with ``2>&1`` (a terminal, ``| tee``) the table's header was glued to the last progress
    bar: the batch's bar closed only after the command had printed the table. The bar ends its line when the last
    stage is done."""
    import os
    import subprocess

    proc = subprocess.run([sys.executable, "scripts/image_to_mesh.py", str(EXAMPLE), "--config", str(TINY_CONFIG),
                           "-o", str(tmp_path / "o.glb"), "--texture-size", "128"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:]
    header = next(line for line in proc.stdout.split("\n") if "seconds" in line and "peak memory" in line)
    assert header.startswith("stage "), repr(header[-300:])
    assert "100%" in proc.stdout  # control: the bars were drawn into the same stream
