"""Issue 30, item 8: a parallel job's errors as a user sees them. A setting every rank sees alike (``--work-dir``
under ``--parallel``) is one ``error:`` line from rank 0 and exit 2 on every rank, found before any rendezvous
(it was two lines, one showing ``UsageError:``, and rank 1 exited 1); when torchrun's agent stops rank 0
because another rank died without a word (SIGKILL, the OOM killer), rank 0's line names the rank that ended."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from pipelines import launch
from pixal3d.parallel import ParallelRuntime, ParallelSettings
from pixal3d.parallel.topology import Topology
from tests.support.cascade_fixtures import EXAMPLE, REPO, TINY_CONFIG

RANK = """
    import sys
    from pipelines import cli
    sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("extra, words", [
    (["--parallel", "cfg", "--work-dir", "WORK"], "--work-dir needs data groups under --parallel cfg"),
    (["--parallel", "cfg", "--batch-order", "stage"], "needs one process per image"),
    (["--parallel", "cfg", "--data-groups", "2"], "needs 4 processes (2 data groups × cfg 2 × pp 1) but WORLD_SIZE is 2"),
    (["--parallel", "data", "--data-groups", "2"], "--parallel data makes every process a data group"),
    (["--parallel", "pipefusion", "--pp", "3"], "needs 3 processes (cfg 1 × pp 3) but WORLD_SIZE is 2"),  # held before
])
def test_a_setting_every_rank_refuses_is_one_line_from_rank_0_and_exit_2_everywhere_before_any_rendezvous(
        extra, words, tmp_path):
    extra = [str(tmp_path / "work") if a == "WORK" else a for a in extra]
    argv = [str(EXAMPLE), "--config", str(TINY_CONFIG), "-o", str(tmp_path / "o.glb"), *extra]
    procs = {}
    for rank in (0, 1):  # no MASTER_ADDR: a rank that tried to join would fail, not wait
        env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
        env.pop("MASTER_ADDR", None)
        procs[rank] = subprocess.run([sys.executable, "-c", textwrap.dedent(RANK), *argv], cwd=REPO, env=env,
                                     capture_output=True, text=True, timeout=120, check=False)
    lines = [line for line in procs[0].stderr.splitlines() if line.strip()]
    assert procs[0].returncode == 2 and len(lines) == 1, procs[0].stderr
    assert lines[0].startswith("pixal3d-image-to-mesh: error: ") and words in lines[0]
    assert "UsageError" not in lines[0]
    assert procs[1].returncode == 2 and procs[1].stderr.strip() == "", procs[1].stderr
    assert not (tmp_path / "work").exists()


class _Store:
    """The c10d store's ``get`` over a dict (a missing key raises, as a store that waits and times out does)."""

    def __init__(self, posts: dict[str, str]):
        self.posts = posts

    def get(self, key: str) -> bytes:
        if key not in self.posts:
            raise RuntimeError(f"timeout waiting for {key}")
        return self.posts[key].encode()


def _runtime(posts: dict[str, str], world: int = 3) -> ParallelRuntime:
    settings = ParallelSettings(mode="pipefusion", pp=world, patches=world)
    topology = Topology.from_env(settings, {"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_RANK": "0"})
    return ParallelRuntime(settings, topology, None, "gloo", _Store(posts), {})


def test_ended_ranks_names_the_ranks_on_this_machine_whose_process_ended():
    host = socket.gethostname()
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()  # ended and reaped
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(killed.pid, signal.SIGKILL)
        os.waitid(os.P_PID, killed.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped: a zombie, as under torchrun
        runtime = _runtime({"pid/0": f"{host}:{os.getpid()}", "pid/1": f"{host}:{killed.pid}",
                            "pid/2": f"{host}:{alive.pid}"})
        assert runtime.ended_ranks() == [(1, killed.pid)]  # control: rank 2 runs, and is not named
        runtime = _runtime({"pid/1": f"{host}:{finished.pid}", "pid/2": f"elsewhere:{finished.pid}"})
        assert runtime.ended_ranks() == [(1, finished.pid)]  # another machine's pid is not judged
        line = launch.ended_ranks_line(runtime)
        assert f"rank 1 (pid {finished.pid}) of the parallel job had ended" in line and "torchrun" in line
        assert "another rank of the job ended" in launch.ended_ranks_line(_runtime({}))  # nothing known: said so
    finally:
        alive.kill()
        alive.wait()
        killed.wait()
