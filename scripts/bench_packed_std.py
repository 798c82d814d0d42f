"""The sampler's per-sample std with index_add_ (now) vs torch.segment_reduce (before), on the CPU.

    python scripts/bench_packed_std.py                     # 200k rows × 32 channels, 1 and 4 samples
    python scripts/bench_packed_std.py --rows 50000 --repeats 21

Prints the median seconds of each, their ratio (new / old, interleaved in one run) and whether the
results are bitwise equal.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pixal3d.samplers import packed_std


def segment_reduce_std(feats: torch.Tensor, layout: list[slice]) -> torch.Tensor:
    """The former implementation (CPU and CUDA only)."""
    lengths = torch.tensor([s.stop - s.start for s in layout], device=feats.device)
    mean = torch.segment_reduce(feats.mean(dim=1, keepdim=True), "mean", lengths=lengths)
    mean_sq = torch.segment_reduce((feats ** 2).mean(dim=1, keepdim=True), "mean", lengths=lengths)
    return (mean_sq - mean ** 2).sqrt()


def timed(fn: Callable[[], torch.Tensor]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args(argv)
    feats = torch.randn(args.rows, args.channels, generator=torch.Generator().manual_seed(0))
    for samples in (1, 4):
        bounds = [args.rows * i // samples for i in range(samples + 1)]
        layout = [slice(a, b) for a, b in itertools.pairwise(bounds)]
        now, before = functools.partial(packed_std, feats, layout), functools.partial(segment_reduce_std, feats, layout)
        new, old = [], []
        for _ in range(args.repeats):
            new.append(timed(now))
            old.append(timed(before))
        same = torch.equal(now(), before())
        print(f"{samples} sample(s), {args.rows} rows x {args.channels}: index_add_ {statistics.median(new) * 1e3:.1f} ms, "
              f"segment_reduce {statistics.median(old) * 1e3:.1f} ms, ratio {statistics.median(new) / statistics.median(old):.2f}, "
              f"bitwise equal: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
