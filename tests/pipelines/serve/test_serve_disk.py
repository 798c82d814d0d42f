"""The job server on a full data disk: ``--data`` on a small file system of its own (a tmpfs, mounted for the test;
it skips where mounting is not allowed), filled to the last byte. A job then gets a JSON 507 with one line (before:
a plain-text 500 and a traceback in the log), nothing of it is left (no folder, no temporary file, no row), the
server goes on answering, and once space is freed the next job is accepted."""
from __future__ import annotations

import errno
import os
import subprocess

import pytest

from tests.support.cascade_fixtures import EXAMPLE, TINY_CONFIG, tiny_cache  # noqa: F401
from tests.support.serve_harness import Server

pytest.importorskip("fastapi")


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs at ``tmp_path/disk``, unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({proc.stderr.strip()})")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


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
