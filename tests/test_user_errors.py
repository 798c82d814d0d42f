"""The one classifier of user-caused errors (exit code, one line) and the one signal handler (SIGTERM and
SIGHUP as exceptions, so every ``finally`` and atomic-write cleanup runs)."""
from __future__ import annotations

import errno
import os
from pathlib import Path
import signal
import time

import numpy as np
import pytest
import torch

from pipelines.errors import UsageError, classify
from pipelines.errors import NotEnoughMemoryError
from pixal3d.config import ConfigError
from pixal3d.files import atomic_path
from pixal3d.hub import MissingWeightsError
from pixal3d.interrupts import Terminated, terminate_as_exception
from pixal3d.models.preprocess import ImageError


def _numpy_out_of_memory() -> MemoryError:
    try:
        np.empty((2**40, 2**20), np.uint8)
    except MemoryError as err:
        return err
    raise AssertionError("allocating 1 EiB succeeded")


@pytest.mark.parametrize("error, kind", [
    (UsageError("-o x names one file"), "usage"), (ConfigError("c.yaml: bad"), "config"),
    (ImageError("x.png is not an image"), "input"), (MissingWeightsError("missing weights"), "weights"),
    (NotEnoughMemoryError("not enough memory for any policy"), "memory"),
])
def test_our_errors_are_one_line_exit_2_before_the_run_and_1_during_it(error, kind):
    before, during = classify(error, started=False), classify(error, started=True)
    assert (before.exit_code, during.exit_code) == (2, 1) and before.kind == during.kind == kind
    assert before.message == str(error)


def test_cpu_and_device_out_of_memory_say_what_to_try():
    cpu = classify(_numpy_out_of_memory(), started=True)
    assert cpu.kind == "memory" and cpu.exit_code == 1
    assert "not enough memory" in cpu.message and "Unable to allocate" in cpu.message
    assert "policy=staged" in cpu.message
    try:
        torch.empty(2**62, dtype=torch.uint8)  # 4 EiB: torch's CPU allocator fails with a plain RuntimeError
    except RuntimeError as err:
        torch_cpu = classify(err, started=False)
    assert torch_cpu.kind == "memory" and torch_cpu.exit_code == 2 and "can't allocate memory" in torch_cpu.message
    device = classify(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), started=True)
    assert device.kind == "memory" and "device memory" in device.message and "2.00 GiB" in device.message


@pytest.mark.parametrize("code, words", [
    (errno.ENOSPC, "no space left on device while writing"), (errno.EDQUOT, "quota"),
    (errno.EFBIG, "file-size limit"), (errno.EACCES, "permission denied"), (errno.EROFS, "read-only"),
])
def test_file_system_errors_name_the_file_and_the_next_step(code, words):
    failure = classify(OSError(code, os.strerror(code), "/data/out/x.glb"), started=True)
    assert failure.kind in ("disk", "permission") and failure.exit_code == 1
    assert "/data/out/x.glb" in failure.message and words in failure.message.lower()
    assert "\n" not in failure.message


def test_interrupts_exit_128_plus_the_signal():
    assert classify(KeyboardInterrupt(), started=True).exit_code == 130
    assert classify(Terminated(signal.SIGTERM), started=False).exit_code == 143
    assert classify(Terminated(signal.SIGHUP), started=True).exit_code == 129
    assert "SIGTERM" in classify(Terminated(signal.SIGTERM), started=True).message


@pytest.mark.parametrize("bug", [TypeError("unsupported operand"), ValueError("a library bug"), AssertionError(),
                                 KeyError("x"), RuntimeError("shape mismatch")])
def test_programming_errors_are_not_classified_so_their_traceback_shows(bug):
    assert classify(bug, started=True) is None


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_terminate_as_exception_raises_in_the_main_thread_and_restores_the_handler(name):
    signum = getattr(signal, name)
    previous = signal.getsignal(signum)
    with pytest.raises(Terminated) as info, terminate_as_exception():
        os.kill(os.getpid(), signum)
        time.sleep(5)
    assert info.value.signum == signum and signal.getsignal(signum) == previous


def test_a_terminated_atomic_write_leaves_no_temporary_file(tmp_path):
    with pytest.raises(Terminated), terminate_as_exception(), atomic_path(tmp_path / "x.glb") as tmp:
        tmp.write_bytes(b"half a file")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an fd through /proc (Linux)")
def test_an_atomic_group_is_flushed_to_disk_before_any_rename_and_its_commit_point_renamed_last(tmp_path, monkeypatch):
    """Durability for a crash of the machine: every temporary file's data is fsync'ed before the first
    rename (so no target can appear empty or short after a power loss); the group's last path (its commit
    point: the GLB) is renamed only after the others' renames are flushed (their folder fsync'ed), and an older
    file under its name is removed before any rename, so no power loss shows a GLB without its record."""
    from pixal3d.files import atomic_paths

    log: list[str] = []
    fsync, replace, unlink = os.fsync, os.replace, Path.unlink

    def logged_fsync(fd):
        log.append("fsync:" + os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def logged_replace(src, dst):
        log.append("replace:" + os.path.basename(dst))
        return replace(src, dst)

    def logged_unlink(path, missing_ok=False):
        if not path.name.startswith("."):
            log.append("unlink:" + path.name)
        return unlink(path, missing_ok=missing_ok)

    (tmp_path / "a.glb").write_bytes(b"old glb")
    monkeypatch.setattr(os, "fsync", logged_fsync)
    monkeypatch.setattr(os, "replace", logged_replace)
    monkeypatch.setattr(Path, "unlink", logged_unlink)
    with atomic_paths([tmp_path / "a.run.json", tmp_path / "a.glb"]) as (record, glb):
        record.write_bytes(b"{}")
        glb.write_bytes(b"glb")
    synced = [entry for entry in log if entry.startswith("fsync:.")]  # the hidden temporary names
    assert len(synced) == 2 and log[:2] == synced
    assert log[2:] == ["unlink:a.glb", "replace:a.run.json", f"fsync:{tmp_path.name}", "replace:a.glb",
                       f"fsync:{tmp_path.name}"]
    assert (tmp_path / "a.glb").read_bytes() == b"glb" and (tmp_path / "a.run.json").read_bytes() == b"{}"
