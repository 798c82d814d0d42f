"""The job server on a full data disk: ``--data`` on a small file system of its own (a tmpfs, mounted for the test;
it skips where mounting is not allowed), filled to the last byte. A job then gets a JSON 507 with one line (before:
a plain-text 500 and a traceback in the log), nothing of it is left (no folder, no temporary file, no row), the
server goes on answering, and once space is freed the next job is accepted."""
from __future__ import annotations

import errno
import os
import subprocess
import time

import pytest

from tests.support.cascade_fixtures import EXAMPLE, TINY_CONFIG, tiny_cache  # noqa: F401
from tests.support.serve_harness import Server

pytest.importorskip("fastapi")


def _mount(disk, size: str):
    """A tmpfs of ``size`` at ``disk``, unmounted afterwards (skips where mounting is not allowed)."""
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({proc.stderr.strip()})")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs at ``tmp_path/disk``."""
    yield from _mount(tmp_path / "disk", "4m")


@pytest.fixture
def roomy_disk(tmp_path):
    """A 64 MiB tmpfs at ``tmp_path/disk``: room for a tiny job's records until it is filled."""
    yield from _mount(tmp_path / "disk", "64m")


def _fill(disk) -> None:
    """Write a file until the disk has no byte left (ever smaller writes, down to one byte)."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        size = 1 << 20
        while size:
            try:
                os.write(fd, b"\0" * size)
            except OSError as err:
                assert err.errno == errno.ENOSPC
                size //= 2
    finally:
        os.close(fd)


def test_a_full_data_disk_is_a_json_507_in_one_line_leaves_nothing_and_the_server_goes_on(tiny_cache, small_disk,
                                                                                         tmp_path):
    data = small_disk / "data"
    server = Server(data, ["--config", str(TINY_CONFIG), "--role", "api"], tmp_path / "server.log")
    server.launch(ready=False)  # the log beside, not on the full disk
    try:
        _fill(small_disk)
        before = sorted(p.name for p in (data / "jobs").iterdir())
        for _ in range(2):
            response = server.submit(EXAMPLE.read_bytes(), {"seed": 1})
            assert response.status_code == 507, (response.status_code, response.text, server.tail())
            message = response.json()["error"]
            assert "full" in message and "\n" not in message, message
        assert sorted(p.name for p in (data / "jobs").iterdir()) == before
        assert not [p for p in data.rglob("*.tmp")]
        health = server.get("/health")
        assert health.status_code == 200 and health.json()["queue"] == 0
        assert "Traceback" not in server.tail()
        (small_disk / "filler").unlink()
        response = server.submit(EXAMPLE.read_bytes(), {"seed": 1})
        assert response.status_code == 202, response.text
        assert server.get("/health").json()["queue"] == 1
    finally:
        server.stop()


def test_a_data_disk_full_mid_job_then_freed_brings_the_worker_back(tiny_cache, roomy_disk, tmp_path):
    """The disk fills while a job runs: its next record cannot be written, nor its end in the queue's database
    (SQLite in --data). The worker process gives the job back (it used to die of the queue's error, again and
    again) and the device thread waits for the queue; once space is freed the job resumes from its records and is
    done, and so is the next one, with no traceback in the log."""
    data, hold = roomy_disk / "data", tmp_path / "hold"
    server = Server(data, ["--config", str(TINY_CONFIG), "--devices", "cpu", "--threads", "1"], tmp_path / "server.log",
                    hold=hold)
    server.launch()
    try:
        with server.held("structure"):
            job = server.submit(EXAMPLE.read_bytes(), {"seed": 1}).json()["id"]
            server.wait(job, lambda v: v.get("stage") == "structure", timeout=120)
            _fill(roomy_disk)
        deadline = time.monotonic() + 60
        while "is full" not in server.tail():  # the next record, then the job's end, cannot be written
            assert time.monotonic() < deadline, server.tail()
            time.sleep(0.2)
        time.sleep(2)
        assert server.get("/health").status_code == 200
        (roomy_disk / "filler").unlink()
        ended = server.wait(job, timeout=120)  # a full disk costs the job a retry, from its records
        assert ended["status"] == "done", (ended, server.tail())
        again = server.submit(EXAMPLE.read_bytes(), {"seed": 2})
        assert again.status_code == 202, again.text
        assert server.wait(again.json()["id"], timeout=120)["status"] == "done", server.tail()
        assert "Traceback" not in server.tail(), server.tail()
    finally:
        server.stop()
