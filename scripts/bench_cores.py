"""The ceiling of any 2-process speed-up on this machine: the same one-thread work in 1 process, then in 2 processes
at once, each doing the whole of it (so 2 independent cores give 2.0x the work in the same time, and two threads of
one core, or a memory bus the two saturate, less).

Work: ``--repeats`` fp32 GEMMs of the real flow width (``--tokens`` x 1536 by 1536 x 1536, what a block's linear
layers do), and a bf16 variant (``--dtype bfloat16``). Printed: seconds of one process alone, seconds of each of
the two run together, the throughput ratio (2 x alone / together), and the load average before and after.

    python scripts/bench_cores.py [--tokens 1024] [--repeats 200] [--dtype float32]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def work(tokens: int, repeats: int, dtype: str) -> float:
    import torch

    torch.set_num_threads(1)
    kind = getattr(torch, dtype)
    a = torch.randn(tokens, 1536).to(kind)
    b = torch.randn(1536, 1536).to(kind)
    torch.mm(a, b)  # warm the kernels
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(work(args.tokens, args.repeats, args.dtype))
        return 0
    command = [sys.executable, __file__, "--child", "--tokens", str(args.tokens), "--repeats", str(args.repeats),
               "--dtype", args.dtype]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    before = os.getloadavg()
    alone = float(subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout)
    procs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    together = [float(p.communicate()[0]) for p in procs]
    after = os.getloadavg()
    ratio = 2 * alone / max(together)
    print(json.dumps({"tokens": args.tokens, "repeats": args.repeats, "dtype": args.dtype, "alone_s": alone,
                      "together_s": together, "throughput_2_processes": ratio, "cpu_count": os.cpu_count(),
                      "load_average_before": before, "load_average_after": after}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
