"""Issue 30, item 1: outputs whole after SIGKILL, and what a killed run left removed by the next one.

The invariant (``pixal3d.files``, ``Result.save_outputs``): the GLB is its group's commit point, renamed last, so
at every instant a visible GLB has its complete run.json (whose ``export.glb_sha256`` is the GLB's) and latents
beside it. The command is killed with SIGKILL just before each rename of the group in turn (``tests.support.stub_result``
stands in for the cascade), over an output that already exists from an earlier run."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipelines import Pixal3D
from pixal3d.locks import exclusive_lock, remove_if_stale
from tests.support.cascade_fixtures import EXAMPLE, REPO, TINY_CONFIG, tiny_cache  # noqa: F401
from tests.support.stub_result import stub_run
from tests.support.cli import run_cli

KILL_AT_RENAME = """
    import os, signal, sys
    from pathlib import Path
    from tests.support.stub_result import patch_run
    patch_run(glb=b"glTF second run")
    folders = {Path(sys.argv[2]).resolve(), Path(sys.argv[3]).resolve()}
    real, count = os.replace, [0]
    def replace(src, dst, *args, **kwargs):
        if Path(dst).resolve().parent in folders:
            count[0] += 1
            if count[0] == int(sys.argv[1]):
                os.kill(os.getpid(), signal.SIGKILL)
        return real(src, dst, *args, **kwargs)
    os.replace = replace
    from pipelines.cli import main
    sys.exit(main(sys.argv[4:]))
"""


def _hidden(*folders: Path) -> list[str]:
    return sorted(p.name for folder in folders if folder.is_dir() for p in folder.rglob(".*"))


def _check_whole(out: Path, latents: Path) -> None:
    """A visible GLB has its record (naming this GLB's bytes) and its latents."""
    if not out.exists():
        return
    record = out.with_name(out.stem + ".run.json")
    assert record.exists(), "a GLB without its run.json"
    assert json.loads(record.read_text())["export"].get("glb_sha256") == hashlib.sha256(out.read_bytes()).hexdigest()
    assert latents.exists(), "a GLB without its latents"


@pytest.mark.parametrize("rename", [1, 2, 3])
def test_a_sigkill_before_any_rename_of_the_group_never_leaves_a_glb_without_its_record_and_the_rerun_cleans_up(
        rename, tiny_cache, tmp_path, capsys, monkeypatch):
    out, lat, work = tmp_path / "out" / "example.glb", tmp_path / "lat", tmp_path / "work"
    args = [str(EXAMPLE), "--config", str(TINY_CONFIG), "-o", str(out), "--quiet", "--keep-latents", str(lat),
            "--work-dir", str(work)]
    monkeypatch.setattr(Pixal3D, "run_batch", stub_run(glb=b"glTF first run"))
    assert run_cli(capsys, *args)[0] == 0  # an earlier, complete run: the killed one overwrites its outputs
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(KILL_AT_RENAME), str(rename), str(out.parent),
                           str(lat), *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "PIXAL3D_CACHE": str(tiny_cache)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    _check_whole(out, lat / "example.latents.pt")
    left = _hidden(out.parent, lat, work)
    assert any(n.endswith(".tmp") for n in left) and ".example.glb.lock" in left, left  # the kill left these
    (out.parent / ".other.glb.lock").write_text("999999999\n")  # another lock whose owner died: nobody holds it

    monkeypatch.setattr(Pixal3D, "run_batch", stub_run(glb=b"glTF third run"))
    code, _, err = run_cli(capsys, *args)
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "a killed earlier run left" in lines[0] and ".tmp" in lines[0], err
    assert ".other.glb.lock" in lines[0], lines[0]
    assert _hidden(out.parent, lat, work) == []  # no temporary file, no lock file
    assert out.read_bytes() == b"glTF third run"
    _check_whole(out, lat / "example.latents.pt")


def test_a_run_json_whose_glb_never_appeared_is_removed_by_the_next_run(tiny_cache, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out" / "example.glb"
    out.parent.mkdir()
    out.with_name("example.run.json").write_text("{}")
    def nothing(self, *args, **kwargs):  # the image then writes nothing: only the cleanup can remove the record
        yield from ()
    monkeypatch.setattr(Pixal3D, "run_batch", nothing)
    code, _, err = run_cli(capsys, EXAMPLE, "--config", TINY_CONFIG, "-o", out, "--quiet")
    assert "example.run.json" in err and "a killed earlier run left" in err
    assert not out.with_name("example.run.json").exists()


def test_a_lock_that_a_live_process_holds_is_not_removed(tmp_path):
    lock = tmp_path / ".a.glb.lock"
    with exclusive_lock(lock, wait=False):
        assert remove_if_stale(lock) is False and lock.exists()
    lock.write_text("1\n")  # left by a process that died: unheld
    assert remove_if_stale(lock) is True and not lock.exists()


def test_without_temporaries_only_unheld_lock_files_are_removed(tmp_path):
    """What a ``--parallel data`` job's rank 0 cleans: the other groups write the same outputs without its locks,
    so their temporary files and a run.json whose GLB is still being renamed must stay."""
    from pipelines.leftovers import clean_leftovers

    out = tmp_path / "a.glb"
    temporary, record, lock = tmp_path / ".a.glb.x1y2z3.tmp", tmp_path / "a.run.json", tmp_path / ".b.glb.lock"
    for path in (temporary, record, lock):
        path.write_text("x")
    assert clean_leftovers([out], temporaries=False) == [lock]
    assert temporary.exists() and record.exists()
    assert sorted(clean_leftovers([out])) == sorted([temporary, record])  # control: a plain run removes them
