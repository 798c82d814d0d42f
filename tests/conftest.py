"""Session-wide settings: two intra-op threads on any machine, in this process and in the ones tests start.

The golden fingerprints depend on the thread count (fp32 CPU kernels split their work by thread, and the
last elements of each thread's range take a different code path), so the suite pins it: the same bits on
a 2-core laptop and a 64-core CI runner. Tests that need another count set it themselves.
"""
import os

import torch

THREADS = 2
os.environ["OMP_NUM_THREADS"] = str(THREADS)  # processes the tests start (the CLI, fresh runs, ranks)
torch.set_num_threads(THREADS)
