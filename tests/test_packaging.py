"""The package ships its configs (issue 16, item 13): a non-editable install finds its default config and
``--config tiny`` / ``base: 1024_cascade.yaml`` name the shipped files from anywhere."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pixal3d.config import load_config, shipped_config
from tests.support.cascade_fixtures import REPO


def test_the_wheel_ships_every_config_inside_the_package(tmp_path):
    source = tmp_path / "src"  # a copy: building in place would write build/ and *.egg-info into the checkout
    source.mkdir()
    for name in ("setup.py", "README.md", "configs", "pixal3d", "pipelines"):
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                            if (REPO / name).is_dir() else {}))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0 and "No module named" in proc.stderr:
        pytest.skip(f"cannot build a wheel here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr
    wheel = next((tmp_path / "dist").glob("pixal3d_staged-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"pixal3d/configs/{p.name}" for p in (REPO / "configs").glob("*.yaml")}
    assert shipped and shipped <= names


def test_shipped_configs_are_found_by_name_and_the_default_is_one_of_them(tmp_path, monkeypatch):
    from pipelines import cli

    monkeypatch.chdir(tmp_path)  # nowhere near a checkout's configs/ folder
    assert load_config("tiny").name == "tiny" and load_config("tiny.yaml").name == "tiny"
    assert Path(cli.DEFAULT_CONFIG).name == "1024_cascade.yaml" and Path(cli.DEFAULT_CONFIG).is_file()
    assert shipped_config("1536_cascade.yaml").is_file()
    own = tmp_path / "mine.yaml"
    own.write_text("base: 1024_cascade.yaml\nseed: 7\n")  # not beside it: the shipped one
    config = load_config(own)
    assert config.seed == 7 and config.name == "1024_cascade"
