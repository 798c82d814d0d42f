"""Benchmark the submanifold sparse conv against dense ``F.conv3d`` on the same voxels.

For each (voxels × channels × kernel) case a thin spherical shell of about ``voxels`` voxels is placed in
the smallest cube that holds it (a decoded surface looks like this), and the script reports:

- ``map ms``: building the neighbour map once (cached on the SparseTensor afterwards),
- ``ours ms`` / ``ours MiB``: one convolution with the cached map, and the extra memory it allocates,
- ``dense ms`` / ``dense MiB``: ``F.conv3d`` on the full grid, when it fits ``--dense-limit-gib``,
- ``max|diff|``: ours vs the dense result at the voxels (submanifold conv == dense conv restricted to
  the active voxels when inactive voxels hold zeros).

Times are medians over ``--repeat`` runs after ``--warmup`` runs; on CUDA measured with CUDA events and
peak memory from ``torch.cuda.max_memory_allocated``; on CPU with ``time.perf_counter`` and the peak
resident-set growth sampled every millisecond (approximate).

    python scripts/bench_sparse_conv.py --device cpu --voxels 20000 100000 --channels 32 64
    python scripts/bench_sparse_conv.py --device cuda --voxels 100000 1000000 --channels 64 128 256 --dtype fp16
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self

import psutil

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from pixal3d.nn.sparse_conv import DEFAULT_CHUNK_BYTES, neighbor_map, sparse_conv3d
from pixal3d.nn.sparse_tensor import SparseTensor

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MIB = 2**20


def shell_coords(voxels: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """About ``voxels`` voxels on a sphere shell (thickness ~1.5 voxels) -> (coords [N, 4] int32, grid size)."""
    radius = math.sqrt(voxels / (4 * math.pi * 1.5))
    grid = int(2 * radius + 6)
    axis = torch.arange(grid, device=device, dtype=torch.float32) - grid / 2 + 0.5
    coords = []
    for x in range(grid):  # one slab at a time keeps the scan at O(grid²) memory
        yy, zz = torch.meshgrid(axis, axis, indexing="ij")
        dist = (axis[x] ** 2 + yy**2 + zz**2).sqrt()
        hit = ((dist - radius).abs() < 0.75).nonzero()
        coords.append(torch.cat([torch.zeros_like(hit[:, :1]), torch.full_like(hit[:, :1], x), hit], 1))
    return torch.cat(coords).to(torch.int32), grid


class PeakMemory:
    """Extra memory allocated inside the ``with`` block: CUDA allocator peak, or sampled RSS growth on CPU."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0

    def __enter__(self) -> Self:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.process, self.stop = psutil.Process(), threading.Event()
            self.base = self.process.memory_info().rss
            self.rss_peak = self.base
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.is_set():
            self.rss_peak = max(self.rss_peak, self.process.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self.stop.set()
            self.thread.join()
            self.peak = max(self.rss_peak, self.process.memory_info().rss) - self.base


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeat: int) -> float:
    """Median wall time of ``fn`` in milliseconds (CUDA events on CUDA)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(voxels: int, channels: int, kernel: int, args: argparse.Namespace) -> dict[str, str]:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    gen = torch.Generator(device="cpu").manual_seed(0)
    coords, grid = shell_coords(voxels, device)
    n = coords.shape[0]
    feats = (torch.randn(n, channels, generator=gen) * 0.5).to(device, dtype)
    weight = (torch.randn(channels, kernel, kernel, kernel, channels, generator=gen)
              / math.sqrt(channels * kernel**3)).to(device, dtype)
    bias = torch.zeros(channels, device=device, dtype=dtype)
    x = SparseTensor(feats, coords)

    synchronize(device)
    t0 = time.perf_counter()
    neighbor_map(x, (kernel,) * 3)
    synchronize(device)
    map_ms = (time.perf_counter() - t0) * 1e3

    conv = lambda: sparse_conv3d(x, weight, bias, chunk_bytes=args.chunk_mib * MIB)
    with torch.no_grad():
        ours_ms = median_ms(conv, device, args.warmup, args.repeat)
        with PeakMemory(device) as mem:
            ours = conv().feats
    row = {"voxels": f"{n}", "grid": f"{grid}³", "C": f"{channels}", "k": f"{kernel}", "dtype": args.dtype,
           "map ms": f"{map_ms:.1f}", "ours ms": f"{ours_ms:.2f}", "ours MiB": f"{mem.peak / MIB:.0f}",
           "dense ms": "-", "dense MiB": "-", "max|diff|": "-"}

    dense_bytes = 2 * channels * grid**3 * feats.element_size()  # input + output grids
    if dense_bytes > args.dense_limit_gib * 2**30:
        row["dense ms"] = f"skip ({dense_bytes / 2**30:.1f} GiB)"
        return row
    c = coords.long()
    with torch.no_grad():
        dense_in = torch.zeros(1, channels, grid, grid, grid, device=device, dtype=dtype)
        dense_in[0, :, c[:, 1], c[:, 2], c[:, 3]] = feats.t()
        w = weight.permute(0, 4, 1, 2, 3).contiguous()
        dense = lambda: F.conv3d(dense_in, w, bias, padding=kernel // 2)
        dense_ms = median_ms(dense, device, args.warmup, args.repeat)
        with PeakMemory(device) as mem:
            out = dense()
        ref = out[0, :, c[:, 1], c[:, 2], c[:, 3]].t()
    row.update({"dense ms": f"{dense_ms:.2f}", "dense MiB": f"{mem.peak / MIB:.0f}",
                "max|diff|": f"{(ours.float() - ref.float()).abs().max().item():.1e}"})
    return row


def print_table(rows: list[dict[str, str]]) -> None:
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    print(" | ".join(c.rjust(widths[c]) for c in cols))
    print("-+-".join("-" * widths[c] for c in cols))
    for r in rows:
        print(" | ".join(r[c].rjust(widths[c]) for c in cols))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | mps")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default fp32 on cpu, fp16 elsewhere")
    parser.add_argument("--voxels", type=int, nargs="+", default=[20_000, 100_000])
    parser.add_argument("--channels", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--kernel", type=int, nargs="+", default=[3])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--chunk-mib", type=int, default=DEFAULT_CHUNK_BYTES // MIB)
    parser.add_argument("--dense-limit-gib", type=float, default=2.0, help="skip dense conv3d above this size")
    args = parser.parse_args()
    if args.dtype is None:
        args.dtype = "fp32" if args.device == "cpu" else "fp16"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda requested but torch.cuda.is_available() is False")
    rows = [run_case(v, c, k, args) for v in args.voxels for c in args.channels for k in args.kernel]
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else args.device
    print(f"submanifold sparse conv vs dense conv3d on {name}, torch {torch.__version__}, "
          f"chunk {args.chunk_mib} MiB, median of {args.repeat} after {args.warmup} warm-up")
    print_table(rows)


if __name__ == "__main__":
    main()
