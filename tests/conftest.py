"""Session-wide settings: two intra-op threads on any machine, in this process and in the ones tests start;
Ctrl-C deliverable to the processes tests start.

The golden fingerprints depend on the thread count (fp32 CPU kernels split their work by thread, and the
last elements of each thread's range take a different code path), so the suite pins it: the same bits on
a 2-core laptop and a 64-core CI runner. Tests that need another count set it themselves.

A suite started in the background by a shell without job control (``nohup``, ``cmd &`` in a script) inherits
SIGINT ignored, and so would every process it starts: the command rightly keeps an inherited SIG_IGN (as any
background job does), and the tests that press Ctrl-C on it would see nothing happen. Those tests stand for a
user at a terminal, so the suite restores Python's own handler; children then start with the default.
"""
import os
import signal

import pytest
import torch

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
