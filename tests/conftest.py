"""Session-wide settings: two intra-op threads on any machine, in this process and in the ones tests start;
Ctrl-C deliverable to the processes tests start.

The golden fingerprints depend on the thread count (fp32 CPU kernels split their work by thread, and the
last elements of each thread's range take a different code path), so the suite pins it: the same bits on
a 2-core laptop and a 64-core CI runner. Tests that need another count set it themselves.

A suite started in the background by a shell without job control (``nohup``, ``cmd &`` in a script) inherits
SIGINT ignored, and so would every process it starts: the command rightly keeps an inherited SIG_IGN (as any
background job does), and the tests that press Ctrl-C on it would see nothing happen. Those tests stand for a
user at a terminal, so the suite restores Python's own handler; children then start with the default.

The kernels are pinned too, before torch is imported (``pixal3d.kernels``): on an x86-64 CPU with AVX2 the
AVX2 family of ATen, MKL and oneDNN (with MKL's strict mode on Intel CPUs, ``recommended_pins``), so the golden fingerprints are those of the pinned family, not of the
CPU the suite happens to run on. Pins set by hand in the environment are kept (CI's second pass sets
another family), and ``PIXAL3D_KERNEL_PINS=none`` runs the suite on the CPU's own kernels; the goldens are
keyed by the pins in effect (``tests/support/cascade_fixtures.py``).
"""
import os
import signal
import subprocess
import sys

from pixal3d import kernels

kernels.apply_recommended_pins()  # before torch: the pins act only when torch loads its kernels

import pytest  # noqa: E402
import torch  # noqa: E402

THREADS = 2
os.environ["OMP_NUM_THREADS"] = str(THREADS)  # processes the tests start (the CLI, fresh runs, ranks)
torch.set_num_threads(THREADS)
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def one_thread():
    """Bitwise comparisons that run kernels with one thread (as spawned single-thread ranks do)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_unpinned(nodeid: str) -> None:
    """Run the test ``nodeid`` again in a fresh session on the CPU's own kernels (no pins): for controls whose
    effect the pins themselves hide. Passes if it passes there, skips with its reason if it skips there."""
    env = {k: v for k, v in os.environ.items() if k not in kernels.PIN_VARS}
    env["PIXAL3D_KERNEL_PINS"] = "none"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", nodeid],
                          capture_output=True, text=True, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr
    if proc.returncode == 0 and " passed" in summary:
        return
    if proc.returncode == 0 and " skipped" in summary:
        reasons = [line.split("] ", 1)[-1] for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
        pytest.skip(f"unpinned too, {reasons[-1]}" if reasons else f"unpinned too: {summary}")
    pytest.fail(f"{nodeid} on unpinned kernels: {summary}\n{proc.stdout[-3000:]}")


def pytest_report_header(config):
    """Which kernels made this session's numbers, and which golden they are compared with."""
    from tests.support.cascade_fixtures import golden_path

    path = golden_path()
    return (f"kernels: {kernels.key()} (pins {kernels.pins() or 'none'}; CPU {kernels.cpu_kind()}, torch uses "
            f"{torch.backends.cpu.get_cpu_capability()}); golden: "
            f"{path.name if path is not None else 'none verified for these kernels on this CPU (golden tests skip)'}")
