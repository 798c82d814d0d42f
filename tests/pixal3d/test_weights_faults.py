"""Weights under faults (issue 16): first runs racing on an empty tiny cache, a partial Hugging Face cache,
advice that fits where a file came from."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pixal3d.config import WeightsConfig, WeightSource
from pixal3d.hub import CorruptWeightsError, MissingWeightsError
from pixal3d.pipeline_json import planned_sizes, resolve_weights
from pixal3d.tiny_weights import TINY_VERSION
from tests.support.cascade_fixtures import REPO, tiny_cache  # noqa: F401

# A process that generates the tiny weights (a stand-in writer that takes `delay` seconds), then keeps
# using the folder for `hold` seconds and checks nobody replaced or removed it meanwhile. All processes
# start generating together: each waits for the `go` file after announcing itself.
FIRST_RUN = """
    import os, sys, time
    from pathlib import Path
    import pixal3d.tiny_weights as tiny
    root, me, delay, hold = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
    def write(folder):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "weights.bin").write_bytes(me.encode())
        time.sleep(delay)
        return folder
    tiny.write_tiny_weights = write
    (root.parent / f"ready-{me}").touch()
    while not (root.parent / "go").exists():
        time.sleep(0.01)
    target = tiny.ensure_tiny_weights(root)
    inode, content = os.stat(target).st_ino, (target / "weights.bin").read_bytes()
    time.sleep(hold)
    assert os.stat(target).st_ino == inode, "the folder was replaced while this process used it"
    assert (target / "weights.bin").read_bytes() == content, "the weights changed under a reader"
    print(content.decode())
"""


def test_concurrent_first_runs_generate_once_and_never_remove_a_finished_folder(tmp_path):
    """Two processes suffice to show the race (the battery ran three): without a lock the one that finishes
    second removed the folder the first had completed and was reading."""
    root = tmp_path / "cache" / "tiny"
    root.parent.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    plans = {"a": (0.3, 2.0), "b": (1.0, 0.0)}  # a finishes first and keeps reading while b finishes
    procs = {me: subprocess.Popen([sys.executable, "-c", textwrap.dedent(FIRST_RUN), str(root), me, str(d), str(h)],
                                  cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for me, (d, h) in plans.items()}
    deadline = time.monotonic() + 120
    while not all((tmp_path / "cache" / f"ready-{me}").exists() for me in plans):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values()), \
            {me: p.communicate()[1] for me, p in procs.items() if p.poll() is not None}
        time.sleep(0.05)
    (tmp_path / "cache" / "go").touch()
    results = {me: p.communicate(timeout=120) for me, p in procs.items()}
    for me, p in procs.items():
        assert p.returncode == 0, f"{me}: {results[me][1]}"
    writers = {out.strip() for out, _ in results.values()}
    assert len(writers) == 1  # every process uses the same folder, written once
    assert sorted(p.name for p in root.iterdir()) == [TINY_VERSION]  # no temporary folder left


def _copy_generated(tiny_cache: Path, tmp_path: Path) -> Path:
    root = tmp_path / "cache"
    shutil.copytree(tiny_cache / "tiny", root / "tiny")
    return root


def test_truncated_generated_weights_advise_regenerating_not_downloading(tiny_cache, tmp_path, monkeypatch):
    root = _copy_generated(tiny_cache, tmp_path)
    monkeypatch.setenv("PIXAL3D_CACHE", str(root))
    path = root / "tiny" / TINY_VERSION / "pixal3d" / "ckpts" / "shape_dec_tiny.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    generated = WeightSource(generate="tiny")
    weights = WeightsConfig(pixal3d=generated, dinov3=generated,
                            naf=WeightSource(generate="tiny", files=("naf.safetensors",)), rembg=None)
    with pytest.raises(CorruptWeightsError) as info:
        resolve_weights(weights, offline=True)
    message = str(info.value)
    assert "shape_dec_tiny.safetensors" in message and "download" not in message
    assert str(root / "tiny" / TINY_VERSION) in message and "regenerate" in message


REV = "b0cb2e1b794cab9aa0ac38a95d794a4d9337437f"


def test_offline_partial_cache_names_every_missing_file_of_every_source(tiny_cache, tmp_path, monkeypatch):
    from huggingface_hub import constants

    hub = tmp_path / "hub"
    for repo, sub in (("t--p", "pixal3d"), ("t--d", "dinov3")):
        shutil.copytree(tiny_cache / "tiny" / TINY_VERSION / sub, hub / f"models--{repo}" / "snapshots" / REV)
    (hub / "models--t--p" / "snapshots" / REV / "ckpts" / "ss_flow_tiny.safetensors").unlink()
    (hub / "models--t--p" / "snapshots" / REV / "ckpts" / "tex_dec_tiny.json").unlink()
    (hub / "models--t--d" / "snapshots" / REV / "model.safetensors").unlink()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    weights = WeightsConfig(pixal3d=WeightSource(repo="t/p", revision=REV),
                            dinov3=WeightSource(repo="t/d", revision=REV, files=("config.json", "model.safetensors")),
                            naf=WeightSource(local=str(tiny_cache / "tiny" / TINY_VERSION / "naf"),
                                             files=("naf.safetensors",)), rembg=None)
    for call in (lambda: resolve_weights(weights, offline=True),
                 lambda: planned_sizes(weights, models=["sparse_structure_flow_model", "dinov3"], offline=True)):
        with pytest.raises(MissingWeightsError) as info:
            call()
        lines = str(info.value).splitlines()  # a heading per source, then each of its files on its own line
        assert "    ckpts/ss_flow_tiny.safetensors" in lines and "    model.safetensors" in lines
        assert any(line.startswith("  weights.pixal3d from t/p@") for line in lines)
        assert any(line.startswith("  weights.dinov3 from t/d@") for line in lines)
        assert lines[-1] == "fetch everything this config needs with: pixal3d-fetch --config CONFIG"
    with pytest.raises(MissingWeightsError) as info:
        resolve_weights(weights, offline=True)
    assert "ckpts/tex_dec_tiny.json" in str(info.value)  # the whole run's files, not only the first missing one
