"""Batch benchmark at real model sizes, under ``staged``: four images one by one vs stage by stage.

What it does, in order:

1. Writes (once, then reuses) the real-size random checkpoints (``scripts/write_random_checkpoints.py``).
2. Writes four input images (``assets/example.png`` turned by 0, 90, 180 and 270 degrees).
3. Runs the reduced cascade of ``scripts/bench_memory.py`` (its ``bench_config`` and ``reduced_stages``: the
   cascade's own loads, releases and resident weights, the expensive compute cut so two cores get through it)
   over the four images with ``Pixal3D.run_batch``, once per order (``image``: one by one, every model read again
   for every image; ``stage``: each stage over all four, each model read once per batch), each in a fresh
   subprocess with the memory meter attached and the checkpoint files evicted from the page cache first.
   Loaders touch every page of a loaded model (as in bench_memory), so a load's seconds include the read.
4. Writes ``benchmarks/batch.md`` and ``batch.json`` (seconds and bytes loaded per image, load counts, peak
   memory of both orders) and the traces, and checks that both orders give every image the same fingerprints.

    python scripts/bench_batch.py                     # both orders (about 10 minutes on 2 cores)
    python scripts/bench_batch.py --report-only       # rebuild the report from benchmarks/traces/batch-*
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts import bench_io
from scripts import write_random_checkpoints as wrc
from scripts.bench_memory import (
    CPU_WORK,
    bench_config,
    reduced_stages,
    touching,
    weight_files,
)

logger = logging.getLogger("bench_batch")

REPO = Path(__file__).resolve().parents[1]
ORDERS = ("image", "stage")
IMAGES = 4
GIB = 2**30


def write_images(folder: Path, count: int = IMAGES) -> list[Path]:
    """``count`` PNGs: the example image turned by 0, 90, 180, ... degrees."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    example = Image.open(REPO / "assets" / "example.png")
    paths = []
    for i in range(count):
        path = folder / f"view{i}.png"
        example.rotate(90 * i).save(path)
        paths.append(path)
    return paths


# -- one order, in this process -------------------------------------------------------------------

def run_child(order: str, cache: Path, images: list[Path], trace: Path, result: Path) -> dict[str, Any]:
    """Run the reduced cascade over ``images`` in ``order`` under staged; write the result JSON."""
    import torch

    from pipelines import Pixal3D
    from pixal3d.staging import EventLog
    from pixal3d.telemetry import read_trace, summarize

    torch.set_grad_enabled(False)
    config = bench_config(cache, CPU_WORK)
    info: dict[str, Any] = {}

    pipe = Pixal3D.from_config(config, policy="staged", device="cpu", replace=reduced_stages(config, CPU_WORK, info),
                               until="decode", wrap_loader=touching)
    log = EventLog()
    meta = {"bench": "scripts/bench_batch.py", "reduced_work": CPU_WORK.describe(), "torch": torch.__version__}
    load_before = os.getloadavg()
    start = time.perf_counter()
    with pipe:
        items = list(pipe.run_batch(images, order=order, events=log, trace=trace, trace_meta=meta))
    seconds = time.perf_counter() - start
    failed = [f"{i.name}: {i.message}" for i in items if not i.ok]
    if failed:
        raise SystemExit(f"order {order}: {failed}")
    traces = [trace] if order == "stage" else [trace.with_name(f"{trace.stem}.{p.stem}{trace.suffix}") for p in images]
    summaries = [summarize(read_trace(t)) for t in traces]
    loads = [e for e in log.events if e.kind in ("load", "reload")]
    out = {
        "order": order, "images": [str(p) for p in images], "seconds": round(seconds, 2),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "loads": len(loads), "loaded_bytes": sum(e.bytes for e in loads),
        "load_seconds": round(sum(e.seconds for e in loads), 2),
        "load_events": [{"kind": e.kind, "model": e.model, "stage": e.stage, "bytes": e.bytes,
                         "seconds": round(e.seconds, 3)} for e in loads],
        "peak_process": max(s.peak_process or 0 for s in summaries),
        "stage_seconds": _stage_seconds(items),
        "stage_peaks": _stage_peaks(summaries),
        "fingerprints": {i.name: i.result.fingerprints() for i in items},
        "traces": [str(t) for t in traces], "info": info,
    }
    result.parent.mkdir(parents=True, exist_ok=True)
    result.write_text(json.dumps(out, indent=1) + "\n")
    return out


def _stage_seconds(items: Sequence[Any]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for item in items:
        for record in item.result.stages:
            totals[record.stage] = round(totals.get(record.stage, 0.0) + record.seconds, 2)
    return totals


def _stage_peaks(summaries: Sequence[Any]) -> dict[str, int]:
    peaks: dict[str, int] = {}
    for summary in summaries:
        for row in summary.rows:
            peaks[row.stage] = max(peaks.get(row.stage, 0), row.peak_process or 0)
    return peaks


# -- the report -----------------------------------------------------------------------------------

def report(results: dict[str, dict[str, Any]], command: str, note: str = "") -> tuple[str, dict[str, Any]]:
    """batch.md text and the batch.json content."""
    one, batch = results["image"], results["stage"]
    n = len(one["images"])
    same = one["fingerprints"] == batch["fingerprints"]
    rows = [("", "one by one (image order)", "stage by stage (stage order)", "stage / one by one")]

    def row(label: str, a: float, b: float, fmt: str) -> None:
        rows.append((label, format(a, fmt), format(b, fmt), f"{b / a:.2f}" if a else "–"))
    row("seconds, whole batch", one["seconds"], batch["seconds"], ".1f")
    row("seconds per image", one["seconds"] / n, batch["seconds"] / n, ".1f")
    row("model loads, whole batch", one["loads"], batch["loads"], "d")
    row("GiB loaded per image", one["loaded_bytes"] / n / GIB, batch["loaded_bytes"] / n / GIB, ".2f")
    row("load seconds per image", one["load_seconds"] / n, batch["load_seconds"] / n, ".1f")
    row("peak process memory, GiB", one["peak_process"] / GIB, batch["peak_process"] / GIB, ".2f")
    table = ["| " + " | ".join(r) + " |" for r in rows]
    table.insert(1, "|---|---|---|---|")
    stages = list(batch["stage_seconds"])
    per_stage = [("| stage | one by one: seconds (4 images) | stage by stage: seconds | one by one: peak GiB | "
                  "stage by stage: peak GiB |"), "|---|---|---|---|---|"]
    for stage in stages:
        per_stage.append(f"| {stage} | {one['stage_seconds'].get(stage, 0):.1f} | {batch['stage_seconds'][stage]:.1f} | "
                         f"{one['stage_peaks'].get(stage, 0) / GIB:.2f} | {batch['stage_peaks'].get(stage, 0) / GIB:.2f} |")
    loads = [r.get("load_average") for r in results.values()]
    busy = ("1-minute load average before/after: " + "; ".join(
        f"{order} {r['load_average']['before'][0]:.1f}/{r['load_average']['after'][0]:.1f}"
        for order, r in results.items()) if all(loads) else "load average not recorded")
    text = "\n".join([
        "# Batches: one by one vs stage by stage (CPU, staged, real model sizes)",
        "",
        f"Command: `{command}` (under `pixal3d-guard --wait-free 40 --`).",
        "",
        (f"{n} images (`assets/example.png` turned by 0/90/180/270°) through the reduced cascade of "
         "`scripts/bench_memory.py` (same reduced work: 1 Euler step per flow stage, guidance 1, 512 px "
         "conditioning, synthetic structure, decoders on a few tokens, no export) with `Pixal3D.run_batch` under "
         "`staged`, each order in a fresh process with the checkpoint files evicted from the page cache first. "
         "Loads touch every page (a load's seconds include reading it)."),
        "",
        f"Machine: 2 vCPUs, 24 GiB RAM, no swap; {busy}. {note}".rstrip(),
        "",
        *table,
        "",
        f"Every image's fingerprints are {'identical' if same else 'DIFFERENT'} in both orders.",
        "",
        "Per stage (seconds summed over the images; peak process memory in the stage's windows):",
        "",
        *per_stage,
        "",
        "Loads per order (model: count):",
        "",
        f"- one by one: {_counts(one)}",
        f"- stage by stage: {_counts(batch)}",
        "",
    ])
    data = {"command": command, "images": n, "same_fingerprints": same,
            "orders": {k: {key: v for key, v in r.items() if key not in ("load_events", "fingerprints")}
                       for k, r in results.items()}}
    return text, data


def _counts(result: dict[str, Any]) -> str:
    counts: dict[str, int] = {}
    for event in result["load_events"]:
        counts[event["model"]] = counts.get(event["model"], 0) + 1
    return ", ".join(f"{m} {c}" for m, c in counts.items())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=wrc.DEFAULT_CACHE)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks")
    parser.add_argument("--orders", nargs="+", default=list(ORDERS), choices=ORDERS)
    parser.add_argument("--report-only", action="store_true", help="rebuild the report from the saved results")
    parser.add_argument("--note", default="", help="a sentence about the run for the report (e.g. the machine's load)")
    parser.add_argument("--child", choices=ORDERS, help=argparse.SUPPRESS)
    parser.add_argument("--images", type=Path, nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--trace", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    cache = args.cache.expanduser()
    if args.child:
        run_child(args.child, cache, list(args.images), args.trace, args.result)
        return 0
    traces = args.out / "traces"
    given = [a for a in (argv if argv is not None else sys.argv[1:])]
    if "--note" in given:  # the note is not part of how the numbers were made
        del given[given.index("--note"):given.index("--note") + 2]
    if "--report-only" in given:
        saved = args.out / "batch.json"
        command = json.loads(saved.read_text())["command"] if saved.exists() else "python scripts/bench_batch.py"
    else:
        command = " ".join(["python scripts/bench_batch.py", *given])
    if not args.report_only:
        wrc.write_all(cache)
        wrc.write_pipeline_json(cache)
        images = write_images(cache.parent / "bench-batch-images")
        files = weight_files(cache)
        for order in args.orders:
            for path in files:
                bench_io.evict(path)
            trace, result = traces / f"batch-{order}.jsonl", traces / f"batch-{order}.result.json"
            child = [sys.executable, str(Path(__file__).resolve()), "--child", order, "--cache", str(cache),
                     "--trace", str(trace), "--result", str(result), "--images", *map(str, images)]
            logger.info("order %s (%.0f%% of the weights cached): %s", order,
                        100 * bench_io.mean_cached_fraction(files), " ".join(child))
            start = time.perf_counter()
            if subprocess.run(child, cwd=REPO, check=False).returncode != 0:
                raise SystemExit(f"order {order} failed; see {trace}")
            logger.info("order %s done in %.0f s", order, time.perf_counter() - start)
    results = {order: json.loads((traces / f"batch-{order}.result.json").read_text()) for order in ORDERS}
    text, data = report(results, command, args.note)
    (args.out / "batch.md").write_text(text)
    (args.out / "batch.json").write_text(json.dumps(data, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
