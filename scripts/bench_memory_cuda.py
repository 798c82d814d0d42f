"""CUDA memory benchmark at real model sizes: staged vs resident, per stage, at realistic token counts.

Same machinery as ``scripts/bench_memory.py`` (random real-size checkpoints, the real cascade, one
subprocess per policy with the memory meter attached), but on a CUDA device and with the reference's
work: the sparse-structure flow runs (16^3 = 4096 dense tokens, the config's 12 steps with CFG), the
shape_512 flow on ~4k LR tokens, shape_1024 and texture on ~20k HR tokens, conditioning at the
reference image sizes, the decoders on every token. Structure coords are synthetic (random weights
give a random occupancy), so the token counts are the ones asked for. Per stage it reports
``torch.cuda.max_memory_allocated`` (reset at every stage boundary by the meter), load seconds and
compute seconds (stage wall time minus its loads, with ``torch.cuda.synchronize`` at the stage end).

    python scripts/bench_memory_cuda.py --out benchmarks            # staged, then resident
    python scripts/bench_memory_cuda.py --hr-tokens 8000 --decode-tokens 4000   # lighter

Writes ``<out>/cuda_memory.json``, ``<out>/cuda_memory.md`` and traces under ``<out>/traces/``, and
prints the table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts import bench_io
from scripts import write_random_checkpoints as wrc
from scripts.bench_memory import CPU_WORK, CUDA_WORK, REPO, run_policies, weight_files
from scripts.bench_report import read_trace, stage_peaks, window_weights

logger = logging.getLogger("bench_memory_cuda")
GIB = 2**30


def stage_rows(result: Mapping[str, Any], trace: list[dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Stage → device peak, weights resident, working set (peak minus weights), loaded bytes, load
    seconds and compute seconds of one policy's run."""
    peaks = stage_peaks(result)
    weights = window_weights(result, trace) if trace is not None else {}
    rows = {}
    for record in result["stages"]:
        row = peaks.get(record["stage"], {})
        load_s = float(row.get("load_seconds") or 0.0)
        held = weights.get(record["stage"])
        peak = row.get("peak_device")
        rows[record["stage"]] = {
            "peak_device": peak, "peak_process": row.get("peak_process"), "weights": held,
            "working_set": peak - held if peak is not None and held is not None else None,
            "loaded_bytes": row.get("loaded_bytes", 0), "load_seconds": round(load_s, 3),
            "compute_seconds": round(max(0.0, record["seconds"] - load_s), 3),
            "stage_seconds": record["seconds"]}
    return rows


def per_token(rows: Mapping[str, Mapping[str, Any]], info: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Working-set bytes per token of each flow/decoder stage: the number ``pipelines/working_set.py``'s
    estimate multiplies by the token count (structure: 16^3 dense tokens; decode: decoded voxels)."""
    tokens = {"structure": 16**3, "shape_512": info.get("lr_tokens"), "upsample": info.get("lr_tokens"),
              "shape_1024": info.get("hr_tokens"), "texture": info.get("hr_tokens"),
              "decode": info.get("decoded_voxels")}
    out = {}
    for stage, count in tokens.items():
        work = rows.get(stage, {}).get("working_set")
        if count and work is not None:
            out[stage] = {"tokens": count, "working_set": work, "bytes_per_token": round(work / count)}
    return out


def _cell(value: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if value is None else fmt.format(value)


def table_md(results: Mapping[str, Mapping[str, Any]],
             traces: Mapping[str, list[dict[str, Any]]] | None = None) -> str:
    """Markdown table: per stage, each policy's max_memory_allocated, working set, load s and compute s."""
    traces = traces or {}
    rows = {p: stage_rows(r, traces.get(p)) for p, r in results.items()}
    policies = list(results)
    head = ["stage"]
    for p in policies:
        head += [f"{p} max alloc (GiB)", f"{p} working set (GiB)", f"{p} load s", f"{p} compute s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    stages = [s["stage"] for s in next(iter(results.values()))["stages"]]
    for stage in stages:
        cells = [stage]
        for p in policies:
            r = rows[p].get(stage, {})
            peak, work = r.get("peak_device"), r.get("working_set")
            cells += [_cell(peak / GIB if peak is not None else None), _cell(work / GIB if work is not None else None),
                      _cell(r.get("load_seconds"), "{:.1f}"), _cell(r.get("compute_seconds"), "{:.1f}")]
        lines.append("| " + " | ".join(cells) + " |")
    totals = ["**whole run**"]
    for p in policies:
        summary = results[p]["summary"]
        peak = summary.get("peak_device")
        totals += [_cell(peak / GIB if peak is not None else None), "", _cell(summary["loads"]["seconds"], "{:.1f}"),
                   _cell(results[p]["seconds"], "{:.1f} (wall)")]
    lines.append("| " + " | ".join(totals) + " |")
    return "\n".join(lines)


def write_cuda_report(out: Path, results: Mapping[str, Mapping[str, Any]], traces: Mapping[str, list],
                      raw: Mapping[str, Mapping[str, Any]], work: Any, command: str, device_name: str) -> str:
    """Write ``<out>/cuda_memory.md`` and ``.json``; return the markdown."""
    first = "staged" if "staged" in results else next(iter(results))
    tokens = per_token(stage_rows(results[first], traces[first]), results[first]["info"])
    md = "\n".join([
        f"Command: `{command}` on {device_name}", "",
        *[f"- {k}: {v}" for k, v in work.describe().items()], "",
        table_md(results, traces), "",
        f"Raw sequential read of the same files: cold {raw['cold']['gb_per_s']:.2f} GB/s "
        f"({100 * raw['cold']['cached_before']:.0f}% cached before), warm {raw['warm']['gb_per_s']:.2f} GB/s.",
        *[f"- {p}: {r['summary']['loads']['count']} loads, {r['summary']['loads']['bytes'] / 1e9:.2f} GB in "
          f"{r['summary']['loads']['seconds']:.1f} s; tokens {r['info']}" for p, r in results.items()],
        "", f"Working set per token ({first} run; calibrates pipelines/working_set.py's estimates):",
        *[f"- {stage}: {v['working_set'] / GIB:.2f} GiB over {v['tokens']} tokens = {v['bytes_per_token']} B/token"
          for stage, v in tokens.items()],
    ])
    out.mkdir(parents=True, exist_ok=True)
    (out / "cuda_memory.md").write_text(md + "\n")
    (out / "cuda_memory.json").write_text(json.dumps({
        "command": command, "device": device_name, "work": dataclasses.asdict(work), "raw_read": dict(raw),
        "per_token": tokens,
        "policies": {p: {"seconds": r["seconds"], "stages": stage_rows(r, traces[p]), "info": r["info"],
                         "loads": r["summary"]["loads"], "peak_device": r["summary"]["peak_device"]}
                     for p, r in results.items()}}, indent=1) + "\n")
    return md


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=wrc.DEFAULT_CACHE)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--policies", nargs="+", default=["staged", "resident"],
                        choices=["staged", "resident", "eager", "offload"])
    parser.add_argument("--lr-tokens", type=int, help=f"LR structure voxels (default {CUDA_WORK.lr_tokens})")
    parser.add_argument("--hr-tokens", type=int, help=f"HR tokens (default {CUDA_WORK.hr_tokens})")
    parser.add_argument("--decode-tokens", type=int, default=None, help="HR tokens the decoders see (default all)")
    parser.add_argument("--steps", type=int, default=None, help="sampler steps per flow stage (default: config)")
    parser.add_argument("--jobs", type=int, default=8, help="processes writing the checkpoints (first run only)")
    parser.add_argument("--smoke", action="store_true",
                        help="plumbing check on any device: the CPU benchmark's reduced work, not realistic sizes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    cache = args.cache.expanduser()
    base = CPU_WORK if args.smoke else CUDA_WORK
    given = {"lr_tokens": args.lr_tokens, "hr_tokens": args.hr_tokens, "decode_tokens": args.decode_tokens,
             "steps": args.steps}
    work = dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})

    start = time.perf_counter()
    wrc.write_all(cache, jobs=args.jobs)
    wrc.write_pipeline_json(cache)
    logger.info("checkpoints ready in %.0f s", time.perf_counter() - start)
    raw = bench_io.cold_and_warm(weight_files(cache))
    logger.info("raw read: cold %.2f GB/s, warm %.2f GB/s", raw["cold"].gb_per_s, raw["warm"].gb_per_s)
    results = run_policies(args.policies, cache, args.out / "traces", work, device=args.device, label="cuda")
    traces = {p: read_trace(args.out / "traces" / f"cuda-{p}.jsonl") for p in results}

    command = " ".join(["python scripts/bench_memory_cuda.py", *(argv if argv is not None else sys.argv[1:])])
    raw_dict = {k: v.to_dict() for k, v in raw.items()}
    md = write_cuda_report(args.out, results, traces, raw_dict, work, command, _device_name(args.device))
    print(md, flush=True)
    return 0


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return device


if __name__ == "__main__":
    sys.exit(main())
