"""A real memory cgroup for the tests (root only): a new group under v2's unified hierarchy where it has the
memory controller, else under v1's ``memory`` hierarchy, limited to a size; a command run inside it (the shell
joins the group, then becomes the command). ``new_group`` skips the test where cgroups cannot be made."""
from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

import pytest

ROOT = Path("/sys/fs/cgroup")


class MemoryGroup:
    def __init__(self, limit: int):
        controllers = ROOT / "cgroup.controllers"
        if controllers.is_file() and "memory" in controllers.read_text().split():
            self.version, parent, limit_file = 2, ROOT, "memory.max"
        else:
            self.version, parent, limit_file = 1, ROOT / "memory", "memory.limit_in_bytes"
        self.path = parent / f"pixal3d-test-{secrets.token_hex(4)}"
        self.path.mkdir()
        (self.path / limit_file).write_text(str(limit))

    def run(self, command: list[str], **kwargs) -> subprocess.CompletedProcess:
        joined = ["sh", "-c", f'echo $$ > "{self.path / "cgroup.procs"}" && exec "$@"', "sh", *command]
        return subprocess.run(joined, capture_output=True, text=True, check=False, **kwargs)

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def new_group(limit: int) -> MemoryGroup:
    if os.geteuid() != 0:
        pytest.skip("making a memory cgroup needs root")
    try:
        return MemoryGroup(limit)
    except OSError as err:
        pytest.skip(f"cannot make a memory cgroup here ({err})")
