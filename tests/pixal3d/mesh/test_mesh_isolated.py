"""Export steps in a forked child (pixal3d/mesh/isolated.py): the same result as in this process, errors raised
here, a dead child named; and the point of it: the quadric simplifier's buffers do not stay in the exporting
process (in a fresh process each, against the same call run in place: the control)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pixal3d.mesh.isolated import IsolatedStepError, can_isolate, run_isolated
from tests.support.meshes import grid_mesh

pytestmark = pytest.mark.skipif(not can_isolate(), reason="steps are isolated in a forked child on Linux only")


def test_an_isolated_step_returns_what_it_returns_in_place():
    from pixal3d.mesh.simplify import simplify_mesh

    v, f = grid_mesh(120)
    here = simplify_mesh(v, f, 2000, voxel_size=1.0)
    there = run_isolated(lambda a, b: simplify_mesh(a, b, 2000, voxel_size=1.0), v, f)
    assert all(np.array_equal(a, b) for a, b in zip(here, there))
    assert run_isolated(lambda: os.getpid()) != os.getpid()
    assert run_isolated(lambda: os.getpid(), isolate=False) == os.getpid()


def test_an_error_in_the_child_is_raised_here_and_a_killed_child_is_named():
    def fails():
        raise ValueError("no surface")

    with pytest.raises(ValueError, match="no surface"):
        run_isolated(fails)
    with pytest.raises(IsolatedStepError, match="killed by SIGKILL"):
        run_isolated(lambda: os.kill(os.getpid(), signal.SIGKILL))


PROBE = textwrap.dedent("""
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from tests.support.meshes import grid_mesh
    from pixal3d.mesh.isolated import run_isolated
    from pixal3d.mesh.simplify import quadric_simplify

    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    v, f = grid_mesh(800)  # 1.3M faces
    before = anon()
    run_isolated(lambda: quadric_simplify(v, f, 10000) and None, isolate=sys.argv[1] == "1")
    print(json.dumps({"kept": anon() - before}))
""")


def test_the_simplifiers_buffers_leave_with_the_child_and_stay_without_it():
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    kept = {}
    for isolate in ("1", "0"):
        out = subprocess.run([sys.executable, "-c", PROBE, isolate, repo], capture_output=True, text=True,
                             timeout=300, check=True, cwd=repo)
        kept[isolate] = json.loads(out.stdout.strip().splitlines()[-1])["kept"]
    assert kept["1"] < 16 << 20, kept  # isolated: nothing of the simplifier stays here
    assert kept["0"] > 64 << 20, kept  # the control: in place, its vectors stay allocated
