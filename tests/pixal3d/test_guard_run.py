"""The guard with real child processes; memory comes from injected sources (this machine has no swap)."""
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from pixal3d.guard import GuardConfig, MemoryReading, find_busy, own_lineage, run_guarded

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="process groups are POSIX")

ALLOCATOR = textwrap.dedent("""
    import sys, time
    blocks = []
    for step in range(200):
        blocks.append(bytearray(b"\\x01") * (4 * 2**20))
        with open(sys.argv[1], "a") as log:
            log.write(f"{len(blocks) * 4 * 2**20} {time.time()}\\n")
        time.sleep(0.05)
    time.sleep(60)
""")


def gone(pid, timeout=3.0):
    """True when pid has exited (a zombie waiting for its new parent counts as gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def wait_for_lines(path, count, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return path.read_text().splitlines()
        time.sleep(0.02)
    raise AssertionError(f"{path} never got {count} lines")


def steady(available=90.0, swap=0):
    return lambda: MemoryReading(available, swap)


@pytest.fixture
def bystander():
    """An unrelated process the test starts: the guard must never touch it."""
    process = subprocess.Popen(["sleep", "300"])
    yield process
    alive = process.poll() is None
    process.kill()
    process.wait()
    assert alive, "the guard signalled a process it did not start"


def test_swap_growth_stops_the_whole_group_within_two_polls(tmp_path, bystander):
    script = tmp_path / "allocate.py"
    script.write_text(ALLOCATOR)
    progress, pids = tmp_path / "progress", tmp_path / "pids"
    budget = 40 * 2**20

    seen = []

    def swap_source():  # pretend every byte the child allocates lands in swap
        lines = progress.read_text().splitlines() if progress.exists() else []
        seen.append(int(lines[-1].split()[0]) if lines else 0)
        return MemoryReading(90.0, 2**30 + seen[-1])

    command = ["sh", "-c", f'sleep 60 & echo $! > {pids}; exec "{sys.executable}" {script} {progress}']
    config = GuardConfig(swap_budget=budget, poll=0.2, grace=2.0)
    assert run_guarded(command, config, memory=swap_source) == 3
    returned = time.time()
    over = next(float(line.split()[1]) for line in progress.read_text().splitlines()
                if int(line.split()[0]) > budget)
    assert [value > budget for value in seen[-2:]] == [False, True]  # stopped at the first one over
    assert returned - over < 2 * config.poll + 1.5
    assert gone(int(pids.read_text())), "the command's own child survived"


def test_member_ignoring_sigterm_is_killed_after_the_grace(tmp_path, bystander):
    pids = tmp_path / "pids"
    command = ["sh", "-c", f"trap '' TERM; sleep 60 & echo $! > {pids}; wait"]
    low = iter([90.0] + [5.0] * 100)  # room to start, then memory stays low
    began = time.monotonic()
    code = run_guarded(command, GuardConfig(poll=0.1, grace=0.4),
                       memory=lambda: MemoryReading(next(low), 0))
    assert code == 3
    assert gone(int(wait_for_lines(pids, 1)[0]))
    assert 0.4 <= time.monotonic() - began < 4


def test_exit_status_passes_through(bystander):
    assert run_guarded(["sh", "-c", "exit 7"], GuardConfig(poll=0.1), memory=steady()) == 7
    assert run_guarded(["true"], GuardConfig(poll=0.1), memory=steady()) == 0


def test_command_ended_by_a_signal_gives_128_plus_n():
    assert run_guarded(["sh", "-c", "kill -TERM $$"], GuardConfig(poll=0.1), memory=steady()) == 143


def test_missing_command_gives_127():
    assert run_guarded(["no-such-command-pixal3d"], GuardConfig(poll=0.1), memory=steady()) == 127


def test_no_room_gives_4_without_starting(tmp_path):
    marker = tmp_path / "ran"
    code = run_guarded(["touch", str(marker)], GuardConfig(poll=0.1, start_timeout=0.3),
                       memory=steady(available=10.0))
    assert code == 4 and not marker.exists()


def test_signal_while_waiting_exits_128_plus_n_without_starting(tmp_path):
    marker = tmp_path / "ran"
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        code = run_guarded(["touch", str(marker)], GuardConfig(poll=0.1), memory=steady(available=1.0))
    finally:
        timer.cancel()
    assert code == 143 and not marker.exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the guard put the handler back


def test_waits_for_busy_process_and_quiet_period(tmp_path):
    marker = tmp_path / "ran"
    busy = subprocess.Popen(["sleep", "7.3129"])
    threading.Timer(0.5, busy.kill).start()
    began = time.monotonic()
    code = run_guarded(["touch", str(marker)],
                       GuardConfig(busy=(re.compile(r"sleep 7\.3129"),), quiet_for=0.4, poll=0.1),
                       memory=steady())
    busy.wait()
    assert code == 0 and marker.exists()
    assert time.monotonic() - began >= 0.9  # 0.5 s busy + 0.4 s quiet


def test_busy_matching_ignores_the_guard_and_its_parents():
    sleeper = subprocess.Popen(["sleep", "5.2718"])
    try:
        pattern = (re.compile(r"sleep 5\.2718"),)
        assert find_busy(pattern, set()) == ("sleep 5.2718",)
        assert find_busy(pattern, {sleeper.pid}) == ()
    finally:
        sleeper.kill()
        sleeper.wait()
    lineage = own_lineage()
    assert os.getpid() in lineage and os.getppid() in lineage


def guard_cli(*args):
    return subprocess.Popen([sys.executable, "-m", "pixal3d.guard", *args], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)


def test_guard_cli_stops_its_command_on_sigterm_and_exits_143(tmp_path, bystander):
    pids = tmp_path / "pids"
    guard = guard_cli("--wait-free", "0", "--kill-free", "0", "--poll", "0.2", "--",
                      "sh", "-c", f"echo $$ > {pids}; sleep 60 & echo $! >> {pids}; wait")
    try:
        leader, child = map(int, wait_for_lines(pids, 2))
        guard.send_signal(signal.SIGTERM)
        assert guard.wait(timeout=10) == 143
    finally:
        guard.kill()
    assert gone(leader) and gone(child)
    assert "got SIGTERM, stopping pid" in guard.stderr.read()  # EOF only once the group is gone


def test_guard_cli_ignores_its_own_command_line_when_matching_busy():
    guard = guard_cli("--busy", "pixal3d-own-marker", "--quiet-for", "0", "--wait-free", "0",
                      "--start-timeout", "2s", "--poll", "0.1", "--", "true", "pixal3d-own-marker")
    assert guard.wait(timeout=20) == 0, guard.stderr.read()
