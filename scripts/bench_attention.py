"""Attention accuracy at long key lengths, on this CPU: the fp32-chunked route against an fp64 reference,
beside SDPA in bf16 and an emulation of MPSGraph's half-precision softmax; time and peak memory of each.

Inputs are what the flow transformers feed attention: 12 heads × 128, bf16, q and k RMS-normed per head
(``normalize(x) · gamma · sqrt(128)``, as ``MultiHeadRMSNorm`` with a gamma of ``--gamma``), v standard
normal. Fewer queries than keys (``--queries``): every query row is independent, so the error per row does
not depend on how many are computed, and the wall time stays reasonable on 2 cores.

Methods (all from the same bf16 q, k, v):

- ``fp32_chunked``: ``pixal3d.nn.attention.fp32_chunked_attention`` (the route ``auto`` picks on mps);
- ``sdpa_bf16_cpu``: ``torch.nn.functional.scaled_dot_product_attention`` on bf16 (the CPU's fused kernel);
- ``mpsgraph_bf16``: the issue's emulation: scores rounded to bf16 before the softmax and the probabilities
  after it (softmax itself in fp32), times v;
- ``mpsgraph_bf16_sum``: the same with the softmax denominator and the value product accumulated in bf16
  over blocks of 256 keys (each block summed in fp32) — a model of a reduction that does not accumulate
  half precision in fp32, not MPS's exact arithmetic (which no Mac here could measure).

Error: max |out - ref| / max |ref| over all rows and heads (and the mean absolute error relative to the mean
|ref|), against fp64 attention of the same bf16 values — of each method's result before its cast back to bf16
(fp32 for all but SDPA, whose result is bf16), and after that cast (what the model receives: bf16 rounding,
~2e-3, is then the floor). Time: one call, after a warm-up. Peak memory: the CPU allocator's peak during a
second call above what was allocated before it (PyTorch profiler memory events).

    python scripts/bench_attention.py                        # print the table
    python scripts/bench_attention.py -o benchmarks/attention.md
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pixal3d.nn.attention import fp32_chunked_attention

KEY_LENGTHS = (1024, 4096, 14336, 20000, 50000)
HEADS, HEAD_DIM = 12, 128
SUM_BLOCK = 256


def rms_normed_inputs(queries: int, keys: int, *, gamma: float = 1.5, seed: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 ``q [1, H, queries, D]``, ``k, v [1, H, keys, D]``: q, k RMS-normed to ``gamma·sqrt(D)``, v ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)

    def normed(n: int) -> torch.Tensor:
        x = torch.randn(1, HEADS, n, HEAD_DIM, generator=g)
        return (F.normalize(x, dim=-1) * gamma * math.sqrt(HEAD_DIM)).bfloat16()

    q, k = normed(queries), normed(keys)
    v = torch.randn(1, HEADS, keys, HEAD_DIM, generator=g).bfloat16()
    return q, k, v


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, chunk: int = 64) -> torch.Tensor:
    """fp64 softmax attention of the given (bf16) values, chunked over queries (rows are independent)."""
    k64, v64 = k.double(), v.double()
    parts = []
    for qc in q.double().split(chunk, dim=2):
        parts.append(torch.softmax(qc @ k64.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v64)
    return torch.cat(parts, dim=2)


def mpsgraph_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Scores rounded to bf16 before the softmax and after it (see module doc); fp32 result."""
    scores = (q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])).bfloat16()
    probs = torch.softmax(scores.float(), dim=-1).bfloat16()
    return probs.float() @ v.float()


def mpsgraph_bf16_sum(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block: int = SUM_BLOCK) -> torch.Tensor:
    """As ``mpsgraph_bf16``, the softmax sum and the value product accumulated in bf16 over key blocks."""
    scores = (q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])).bfloat16().float()
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True)).bfloat16().float()  # [1, H, Lq, Lk]
    total = torch.zeros(weights.shape[:-1], dtype=torch.bfloat16)
    acc = torch.zeros(*weights.shape[:-1], v.shape[-1], dtype=torch.bfloat16)
    for start in range(0, weights.shape[-1], block):
        w = weights[..., start:start + block]
        total = (total.float() + w.sum(dim=-1)).bfloat16()
        acc = (acc.float() + w @ v[:, :, start:start + block].float()).bfloat16()
    return acc.float() / total.float().unsqueeze(-1)


METHODS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "fp32_chunked": fp32_chunked_attention,
    "sdpa_bf16_cpu": F.scaled_dot_product_attention,
    "mpsgraph_bf16": mpsgraph_bf16,
    "mpsgraph_bf16_sum": mpsgraph_bf16_sum,
}


def peak_allocated_bytes(fn: Callable[[], object]) -> tuple[object, int]:
    """``fn()`` and the CPU allocator's peak bytes during it above those allocated before (profiler memory
    events, in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return result, peak


def relative_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |out - ref| / max |ref|, mean |out - ref| / mean |ref|)."""
    diff = (out.double() - ref).abs()
    return float(diff.max() / ref.abs().max()), float(diff.mean() / ref.abs().mean())


def measure(keys: int, queries: int, gamma: float) -> list[dict[str, object]]:
    """One row per method at ``keys`` keys."""
    q, k, v = rms_normed_inputs(queries, keys, gamma=gamma)
    ref = reference(q, k, v)
    rows = []
    for name, method in METHODS.items():
        method(q[:, :, :2], k, v)  # warm up (allocator, kernels)
        start = time.perf_counter()
        out = method(q, k, v)
        seconds = time.perf_counter() - start
        _, peak = peak_allocated_bytes(functools.partial(method, q, k, v))
        max_err, mean_err = relative_errors(out, ref)
        cast_max, cast_mean = relative_errors(out.bfloat16(), ref)
        rows.append({"keys": keys, "queries": queries, "method": name, "result_dtype": str(out.dtype),
                     "max_rel_error": max_err, "mean_rel_error": mean_err, "max_rel_error_bf16": cast_max,
                     "mean_rel_error_bf16": cast_mean, "seconds": seconds, "peak_bytes": peak})
    return rows


def report(rows: Sequence[dict[str, object]], args: argparse.Namespace) -> str:
    """The markdown page: how it was made, then one table row per (keys, method)."""
    lines = [
        "# Attention accuracy at long key lengths (CPU)",
        "",
        (f"`python scripts/bench_attention.py --queries {args.queries} -o benchmarks/attention.md` — torch "
         f"{torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads (other jobs shared the two "
         f"cores: times are indicative); {HEADS} heads × {HEAD_DIM}, bf16 inputs, q/k RMS-normed to "
         f"{args.gamma:g}·sqrt({HEAD_DIM}), v ~ N(0, 1), {args.queries} queries per key length (rows are independent: "
         "the error of a row does not depend on how many are computed). Reference: fp64 attention of the same bf16 "
         "values. Max error: max |out − ref| / max |ref|; mean: mean |out − ref| / mean |ref| — of each method's "
         "result before its cast to bf16 (`result`), then after it (bf16 rounding, ~2e-3, is the floor there). "
         "Peak: the CPU allocator's peak during the call above what was allocated before it. The two `mpsgraph_*` "
         "rows are emulations on the CPU (see the script's docstring), not measurements on a Mac."),
        "",
        ("| keys | method | result | max rel. error | mean rel. error | max / mean after the bf16 cast | time (s) "
         "| peak memory |"),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        dtype = str(r["result_dtype"]).removeprefix("torch.")
        lines.append(f"| {r['keys']:,} | `{r['method']}` | {dtype} | {r['max_rel_error']:.2e} | "
                     f"{r['mean_rel_error']:.2e} | {r['max_rel_error_bf16']:.2e} / {r['mean_rel_error_bf16']:.2e} | "
                     f"{r['seconds']:.3f} | {r['peak_bytes'] / 2**20:.1f} MiB |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, nargs="+", default=list(KEY_LENGTHS))
    parser.add_argument("--queries", type=int, default=256)
    parser.add_argument("--gamma", type=float, default=1.5)
    parser.add_argument("-o", "--output", type=Path, help="also write the markdown page (and a .json beside it)")
    parser.add_argument("--from-json", type=Path, help="rebuild the page from an earlier run's .json (no measuring)")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        rows = json.loads(args.from_json.read_text())
        args.queries = rows[0]["queries"]
        page = report(rows, args)
        print(page)
        if args.output is not None:
            args.output.write_text(page, encoding="utf-8")
        return 0
    peak_allocated_bytes(lambda: torch.ones(1))  # the profiler's first start is slow: not in any row
    rows = []
    for keys in args.keys:
        rows.extend(measure(keys, args.queries, args.gamma))
        for r in rows[-len(METHODS):]:
            print(f"{r['keys']:>6} {r['method']:<18} max {r['max_rel_error']:.2e} mean {r['mean_rel_error']:.2e} "
                  f"{r['seconds']:.3f} s {r['peak_bytes'] / 2**20:.1f} MiB", flush=True)
    page = report(rows, args)
    print(page)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(page, encoding="utf-8")
        args.output.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
