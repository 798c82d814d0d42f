"""The command under real-world input and faults (issue 16's battery): every error a user can cause is one
line on stderr and a non-zero exit, found before any weight is read when it can be, and no partial or
temporary file is ever left. Signals and a second concurrent run need their own process; a full disk is
the process's file-size limit (writes past it fail as on a full disk). ``Pixal3D.run`` is replaced by
``tests.support.stub_result`` where the test is about what happens around a run, not inside it."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from pipelines import Pixal3D, cli, session
from pixal3d.tiny_weights import TINY_VERSION
from tests.support.cascade_fixtures import EXAMPLE, REPO, TINY_CONFIG, tiny_cache  # noqa: F401
from tests.support.stub_result import stub_run
from tests.support.cli import files_in, missing_weights_lines, one_error_line, run_cli
from tests.support.disk import file_size_limit


def _empty_cache(monkeypatch, tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("PIXAL3D_CACHE", str(cache))
    return cache


def _python(script: str, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter at the checkout root."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _stderr_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("pixal3d-image-to-mesh: error: "), proc.stderr
    return lines[0]


# -- item 1: an image without alpha under a config without a background remover ---------------------------
def _opaque(kind: str, folder: Path) -> Path:
    rgba = Image.open(EXAMPLE).convert("RGBA")
    if kind == "rgb.jpg":
        rgba.convert("RGB").save(folder / kind, quality=95)
    elif kind == "opaque.png":
        rgba.putalpha(255)
        rgba.save(folder / kind)
    elif kind == "cmyk.jpg":
        rgba.convert("CMYK").save(folder / kind)
    elif kind == "gray16.png":
        Image.fromarray(np.asarray(rgba.convert("L"), np.uint16) * 257).save(folder / kind)
    return folder / kind


@pytest.mark.parametrize("kind", ["rgb.jpg", "opaque.png", "cmyk.jpg", "gray16.png"])
def test_an_image_without_alpha_and_no_remover_is_refused_before_any_weight_is_read(kind, tmp_path, capsys,
                                                                                 monkeypatch):
    cache = _empty_cache(monkeypatch, tmp_path)
    image = _opaque(kind, tmp_path)
    code, _, err = run_cli(capsys, image, "--config", TINY_CONFIG, "-o", tmp_path / "out" / "o.glb")
    line = one_error_line(err)
    assert code == 2 and kind in line and "alpha" in line and "weights.rembg" in line
    assert "load_background_remover" not in line  # no API advice a command-line user cannot follow
    assert files_in(cache) == [] and files_in(tmp_path / "out") == []  # no weight generated, let alone read


def test_an_image_with_alpha_passes_the_check(tmp_path, capsys, tiny_cache):
    code, out, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", tmp_path / "o.glb", "--plan")
    assert code == 0 and "policy:" in out, err


# -- item 3: the CPU runs out of memory --------------------------------------------------------------------
def test_cpu_out_of_memory_during_the_run_is_one_line_and_exit_1(tiny_cache, tmp_path, capsys, monkeypatch):
    def allocate(self, *_, **__):  # run_batch(images=... or views=..., ...)
        np.empty((2**40, 2**20), np.uint8)  # 1 EiB: numpy's _ArrayMemoryError, a MemoryError
    monkeypatch.setattr(Pixal3D, "run_batch", allocate)
    out = tmp_path / "out" / "o.glb"
    code, _, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", out, "--quiet")
    line = one_error_line(err)
    assert code == 1 and "not enough memory" in line and "Unable to allocate" in line
    assert files_in(out.parent) == []


# -- item 5: signals ---------------------------------------------------------------------------------------
SIGNAL_AT_COMMIT = """
    import os, signal, sys
    from tests.support.stub_result import patch_run
    patch_run()
    real = os.replace
    def replace(src, dst, *args, **kwargs):
        if str(dst).endswith(".glb"):  # the temporary GLB is complete: stop the run now
            os.kill(os.getpid(), getattr(signal, sys.argv[1]))
        return real(src, dst, *args, **kwargs)
    os.replace = replace
    from pipelines.cli import main
    sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("name, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_after_the_temporary_glb_is_written_leaves_no_file_and_one_line(name, code, tiny_cache, tmp_path):
    out = tmp_path / "out" / "x.glb"
    proc = _python(SIGNAL_AT_COMMIT, name, str(EXAMPLE), "--config", str(TINY_CONFIG), "-o", str(out), "--quiet",
                   env={"PIXAL3D_CACHE": str(tiny_cache)})
    assert proc.returncode == code, proc.stderr
    assert "stopped by" in _stderr_line(proc) and "Traceback" not in proc.stderr
    assert files_in(out.parent) == []  # neither x.glb, nor its run.json, nor a temporary file


# -- item 6: an output path that is a folder ---------------------------------------------------------------
@pytest.mark.parametrize("option", ["-o", "--trace"])
def test_an_output_or_trace_path_that_is_a_folder_is_refused_before_the_run(option, tmp_path, capsys, monkeypatch):
    cache = _empty_cache(monkeypatch, tmp_path)
    folder = tmp_path / ("x.glb" if option == "-o" else "t.jsonl")
    folder.mkdir()
    args = ["-o", folder] if option == "-o" else ["-o", tmp_path / "o.glb", "--trace", folder]
    code, _, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, *args)
    line = one_error_line(err)
    assert code == 2 and option in line and "folder" in line and str(folder) in line
    assert files_in(cache) == []


# -- item 7: no network ------------------------------------------------------------------------------------
def _hub_cache_missing_files(tiny_cache: Path, hub: Path) -> tuple[str, Path]:
    """A Hugging Face cache with the tiny pixal3d and dinov3 folders as repos, three checkpoints and DINOv3's
    weights missing; returns the revision and a config that uses them."""
    rev = "b0cb2e1b794cab9aa0ac38a95d794a4d9337437f"
    for repo, sub in (("t--p", "pixal3d"), ("t--d", "dinov3")):
        shutil.copytree(tiny_cache / "tiny" / TINY_VERSION / sub, hub / f"models--{repo}" / "snapshots" / rev)
        (hub / f"models--{repo}" / "refs").mkdir()
        (hub / f"models--{repo}" / "refs" / "main").write_text(rev)
    snapshot = hub / "models--t--p" / "snapshots" / rev
    for stem in ("ss_flow_tiny", "shape_flow_512_tiny", "tex_dec_tiny"):
        (snapshot / "ckpts" / f"{stem}.safetensors").unlink()
    (hub / "models--t--d" / "snapshots" / rev / "model.safetensors").unlink()
    config = hub.parent / "hub.yaml"
    config.write_text(yaml.safe_dump({"base": str(TINY_CONFIG), "weights": {
        "pixal3d": {"repo": "t/p", "revision": rev},
        "dinov3": {"repo": "t/d", "revision": rev, "files": ["config.json", "model.safetensors"]}}}))
    return rev, config


MISSING = ("ckpts/ss_flow_tiny.safetensors", "ckpts/shape_flow_512_tiny.safetensors",
           "ckpts/tex_dec_tiny.safetensors", "model.safetensors")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unreachable_hub(tiny_cache: Path, tmp_path: Path, monkeypatch) -> tuple[str, Path]:
    """The partial Hugging Face cache, no network (a closed local port as the Hub) and no HF_HUB_OFFLINE."""
    from huggingface_hub import constants

    rev, config = _hub_cache_missing_files(tiny_cache, tmp_path / "hub")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return rev, config


def test_an_unreachable_hub_is_one_error_naming_every_missing_file_without_retries(tiny_cache, tmp_path, capsys,
                                                                                   monkeypatch, caplog):
    rev, config = _unreachable_hub(tiny_cache, tmp_path, monkeypatch)
    code, _, err = run_cli(capsys, EXAMPLE, "--config", config, "-o", tmp_path / "o.glb", "--plan")
    lines = missing_weights_lines(err, config)
    assert code == 2 and any("could not be reached" in line for line in lines)
    assert all(f"    {name}" in lines for name in MISSING), lines  # each file on its own line
    assert f"or this source alone (with network access): hf download t/p {' '.join(sorted(MISSING[:3]))} --revision {rev}" in lines
    assert f"or this source alone (with network access): hf download t/d model.safetensors --revision {rev}" in lines
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]  # were 22 lines over 26-32 s


def test_an_unreachable_hub_costs_one_failed_request_not_retries(tiny_cache, tmp_path, monkeypatch):
    from pixal3d.config import load_config
    from pixal3d.hub import MissingWeightsError
    from pixal3d.pipeline_json import planned_sizes, resolve_weights

    _, config = _unreachable_hub(tiny_cache, tmp_path, monkeypatch)
    weights = load_config(config).weights
    for call in (lambda: planned_sizes(weights, models=["sparse_structure_flow_model", "dinov3"]),
                 lambda: resolve_weights(weights)):
        start = time.monotonic()
        with pytest.raises(MissingWeightsError, match="could not be reached"):
            call()
        assert time.monotonic() - start < 10  # huggingface_hub's retries sleep 1 + 2 + 4 + 8 + 8 = 23 s


def test_offline_with_a_partial_cache_names_every_missing_file_at_once(tiny_cache, tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    _, config = _hub_cache_missing_files(tiny_cache, tmp_path / "hub")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run_cli(capsys, EXAMPLE, "--config", config, "-o", tmp_path / "o.glb", "--plan")
    lines = missing_weights_lines(err, config)
    assert code == 2 and all(f"    {name}" in lines for name in MISSING)
    assert "HF_HUB_OFFLINE is set, so only the local cache was searched" in lines


def test_the_command_configures_its_own_loggers_and_leaves_library_loggers_alone(tiny_cache, tmp_path, capsys,
                                                                                 monkeypatch):
    import logging

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # as in a fresh process (pytest's capture handlers set aside)
    code, _, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", tmp_path / "o.glb", "--plan")
    assert code == 0, err
    assert root.handlers == []  # nothing on the root logger, so huggingface_hub's warnings are not ours to print
    logging.getLogger("pixal3d.hub").warning("our warning")
    assert "pixal3d: WARNING: our warning" in capsys.readouterr().err


# -- item 8: the cache and the disk ------------------------------------------------------------------------
def test_a_cache_path_that_is_a_file_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")
    monkeypatch.setenv("PIXAL3D_CACHE", str(blocker))
    code, _, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", tmp_path / "o.glb")
    line = one_error_line(err)
    assert code == 2 and str(blocker) in line and "PIXAL3D_CACHE" in line


def test_a_full_disk_while_generating_the_demo_weights_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    cache = _empty_cache(monkeypatch, tmp_path)
    with file_size_limit(64 * 1024):
        code, _, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", tmp_path / "o.glb", "--plan")
    line = one_error_line(err)
    assert code == 2 and str(cache / "tiny") in line and "PIXAL3D_CACHE" in line and "File too large" in line
    assert files_in(cache / "tiny") == []  # no half-written weights, no temporary folder, no lock file


def test_glb_and_run_json_appear_together_or_not_at_all_on_a_full_disk(tiny_cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(Pixal3D, "run_batch", stub_run(glb=b"glTF" * 64))
    out = tmp_path / "out" / "x.glb"
    with file_size_limit(2048):  # the 256-byte GLB fits, the run.json (~4 KiB) does not
        code, _, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", out, "--quiet")
    line = one_error_line(err)
    assert code == 1 and str(out.with_name("x.run.json")) in line and "File too large" in line
    assert files_in(out.parent) == []


def test_keep_latents_on_a_full_disk_is_one_line_naming_the_file(tiny_cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(Pixal3D, "run_batch", stub_run())
    out, latents = tmp_path / "out" / "x.glb", tmp_path / "lat"
    with file_size_limit(64 * 1024):  # GLB (16 KiB) and run.json (~4 KiB) fit, the latents (~130 KiB) do not
        code, _, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", out, "--quiet", "--keep-latents", latents)
    line = one_error_line(err)
    assert code == 1 and str(latents / "example.latents.pt") in line, line
    assert files_in(out.parent) == [] and files_in(latents) == []


@pytest.mark.parametrize("option", ["--trace", "--keep-latents"])
def test_an_unwritable_trace_or_latents_folder_names_its_option(option, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("a file where a folder should be")
    target = blocker / "sub" / ("t.jsonl" if option == "--trace" else "")
    code, _, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", tmp_path / "o.glb", option, target)
    line = one_error_line(err)
    assert code == 2 and option in line and "-o" not in line.replace(str(tmp_path), "")


# -- item 9: two runs, one output --------------------------------------------------------------------------
HOLD_THE_RUN = """
    import sys, time
    from pathlib import Path
    from tests.support.stub_result import patch_run
    started, release = Path(sys.argv[1]), Path(sys.argv[2])
    def hold(pipe, image):
        started.touch()
        deadline = time.monotonic() + 60
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    patch_run(before=hold, glb=b"glTF first run")
    from pipelines.cli import main
    sys.exit(main(sys.argv[3:]))
"""


def test_a_second_run_writing_the_same_output_is_refused(tiny_cache, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out" / "x.glb"
    started, release = tmp_path / "started", tmp_path / "release"
    args = [str(EXAMPLE), "--config", str(TINY_CONFIG), "-o", str(out), "--quiet"]
    first = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLD_THE_RUN), str(started), str(release), *args],
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "PIXAL3D_CACHE": str(tiny_cache)},
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not started.exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.05)
        monkeypatch.setattr(Pixal3D, "run_batch", stub_run(glb=b"glTF second run"))
        code, _, err = run_cli(capsys, *args)
        line = one_error_line(err)
        assert code == 2 and "another run" in line and str(out) in line
    finally:
        release.touch()
        _, stderr = first.communicate(timeout=60)
    assert first.returncode == 0, stderr
    assert out.read_bytes() == b"glTF first run"
    assert json.loads(out.with_name("x.run.json").read_text())["output"] == str(out)


def test_outputs_that_differ_only_in_case_are_refused_on_a_case_insensitive_folder(tiny_cache, tmp_path, capsys,
                                                                                   monkeypatch):
    inputs = tmp_path / "in"
    inputs.mkdir()
    shutil.copy(EXAMPLE, inputs / "Cup.png")
    shutil.copy(EXAMPLE, inputs / "cup.png")
    monkeypatch.setattr(session, "folds_case", lambda folder: True)  # as on macOS's default volume
    code, _, err = run_cli(capsys, inputs, "--config", TINY_CONFIG, "-o", tmp_path / "out", "--plan")
    line = one_error_line(err)
    assert code == 2 and "Cup" in line and "cup" in line and "case" in line


# -- item 11: values out of range, devices that do not exist ----------------------------------------------
def test_a_seed_out_of_range_names_the_option_or_the_key(tmp_path, capsys):
    code, _, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", tmp_path / "o.glb", "--seed", str(2**70))
    line = one_error_line(err)
    assert code == 2 and "--seed" in line and "2**64 - 1" in line
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"base": str(TINY_CONFIG), "seed": 2**70}))
    code, _, err = run_cli(capsys, EXAMPLE, "--config", config, "-o", tmp_path / "o.glb")
    line = one_error_line(err)
    assert code == 2 and "'seed'" in line and "c.yaml" in line


def test_a_device_index_that_does_not_exist_is_refused_without_blaming_the_weights(tmp_path, capsys, tiny_cache):
    code, _, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", tmp_path / "o.glb", "--device", "cpu:1")
    line = one_error_line(err)
    assert code == 2 and "cpu:1" in line and "delete" not in line and "download" not in line


# -- item 12: what run.json says ---------------------------------------------------------------------------
def test_run_json_export_path_is_the_output(tiny_cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(Pixal3D, "run_batch", stub_run())
    out = tmp_path / "out" / "x.glb"
    code, _, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", out, "--quiet")
    assert code == 0, err
    record = json.loads(out.with_name("x.run.json").read_text())
    assert record["export"]["path"] == str(out) == record["output"]
    assert files_in(out.parent) == ["x.glb", "x.run.json"]


# -- item 14: AppleDouble and other hidden files in a folder -----------------------------------------------
def test_hidden_files_in_an_input_folder_are_skipped(tiny_cache, tmp_path, capsys):
    inputs = tmp_path / "in"
    inputs.mkdir()
    shutil.copy(EXAMPLE, inputs / "cup.png")
    (inputs / "._cup.png").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(64))
    (inputs / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1" + bytes(64))
    code, _, err = run_cli(capsys, inputs, "--config", TINY_CONFIG, "-o", tmp_path / "out", "--plan")
    assert code == 0, err
    # an explicitly named hidden file is still checked
    code, _, err = run_cli(capsys, inputs / "._cup.png", "--config", TINY_CONFIG, "-o", tmp_path / "o.glb", "--plan")
    assert code == 2 and "._cup.png" in one_error_line(err)


def test_library_messages_name_settings_and_the_command_names_them_by_its_flags(tiny_cache, tmp_path, capsys):
    """The library says ``policy=staged``; the command says ``--memory-policy staged`` (``cli.in_flags``) in its
    error lines, and the plan it prints names its flags too (run.json keeps the library's words)."""
    from pipelines.pipeline import Pixal3D
    from pixal3d.staging import PolicyError

    with pytest.raises(PolicyError) as library:
        Pixal3D.plan(TINY_CONFIG, policy="offload", device="cpu")
    assert "policy=staged" in str(library.value) and "--" not in str(library.value)
    code, _, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", tmp_path / "o.glb", "--memory-policy",
                        "offload")
    line = one_error_line(err)
    assert code == 2 and "Use --memory-policy staged (or auto)" in line and "policy=" not in line
    code, out, _ = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "--memory-policy", "staged", "--plan")
    assert code == 0 and "requested explicitly (--memory-policy staged)" in out
    assert cli.in_flags("use warmup=2 or less; raise memory_budget; naf_mode=full") == \
        "use --warmup 2 or less; raise --memory-budget; naf_mode=full"
