"""The memory a run may use is its cgroup's limit where that is lower than the machine's RAM (a container,
``systemd-run -p MemoryMax``; v1 and v2): the plan sizes "auto" to it and warns of a budget above it (issue 44
item 8: it read the RAM and warned of nothing). A fake cgroup reading here; a real cgroup where root."""
from __future__ import annotations

import os
import subprocess
import sys

import psutil

from pipelines import Pixal3D
from pixal3d.staging import policy
from pixal3d.telemetry import linux
from tests.support.cascade_fixtures import EXAMPLE, REPO, TINY_CONFIG, tiny_cache  # noqa: F401
from tests.support.cgroup import new_group

GIB = 1 << 30


def test_a_cgroup_limit_below_the_ram_is_the_memory_the_plan_sees(monkeypatch, tiny_cache):
    monkeypatch.setattr(policy.sys, "platform", "linux")
    monkeypatch.setattr(linux, "cgroup_memory", lambda: linux.CgroupMemory(2, usage=GIB // 2, limit=2 * GIB,
                                                                           peak=None))
    machine = policy.detect_machine("cpu")
    assert machine.device_total == machine.host_total == 2 * GIB
    assert machine.device_available <= 2 * GIB - GIB // 2 and machine.host_bound == "cgroup v2 limit"
    plan = Pixal3D.plan(TINY_CONFIG, device="cpu", memory_budget=4 * GIB)
    [warning] = [r for r in plan.reasons if "bounds nothing" in r]
    assert "cgroup v2 limit" in warning and "2.00 GiB" in warning, warning
    # control: no limit (or one above the RAM) leaves the machine's RAM
    monkeypatch.setattr(linux, "cgroup_memory", lambda: linux.CgroupMemory(2, usage=GIB, limit=None, peak=None))
    assert policy.detect_machine("cpu").device_total == psutil.virtual_memory().total
    plan = Pixal3D.plan(TINY_CONFIG, device="cpu", memory_budget=4 * GIB)
    assert not any("bounds nothing" in r for r in plan.reasons)


def test_inside_a_real_cgroup_the_plan_warns_of_a_budget_above_its_limit(tiny_cache, tmp_path):
    group = new_group(3 * GIB)
    try:
        command = [sys.executable, "-m", "pipelines.cli", str(EXAMPLE), "--config", str(TINY_CONFIG), "-o",
                   str(tmp_path / "o.glb"), "--plan", "--memory-budget", "4G"]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        inside = group.run(command, cwd=REPO, env=env, timeout=300)
    finally:
        group.remove()
    assert inside.returncode == 0, inside.stderr
    assert f"is more than this process's 3.00 GiB (cgroup v{group.version} limit" in inside.stdout, inside.stdout
    # control: the same command outside the group, on this machine's RAM
    control = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert control.returncode == 0 and "bounds nothing" not in control.stdout, control.stdout
