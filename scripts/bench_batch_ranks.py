"""The real-width reduced cascade of ``scripts/bench_batch.py`` over its four images: ``--parallel data`` on 2 ranks
against 1 process, each process one thread, stage order, ``staged`` (issue 28).

Both sides run ``Pixal3D.run_batch`` in fresh processes with the checkpoint files evicted from the page cache first:
the single process over all four images; under ``torchrun --nproc-per-node 2`` each rank over its share (a
``DataJob`` without a work directory: image i to rank i mod 2). Every rank writes what it loaded (count, bytes,
seconds), its peak process memory (from its memory trace) and its images' fingerprints, which must equal the
single process's. Printed and written to ``benchmarks/batch_ranks.md`` / ``.json``: wall seconds of each side
(around the whole launch: start-up, rendezvous and loads included), loads and peak per rank, and the load average.
Both sides run under the test suite's kernel pins (``pixal3d.kernels``), so that their bits are comparable.
Two ranks on one machine share its memory and disk: the per-rank peaks add up.

    python scripts/bench_batch_ranks.py [--ranks 2]     # about 10 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pixal3d import kernels
from scripts import bench_io
from scripts import write_random_checkpoints as wrc
from scripts.bench_batch import write_images
from scripts.bench_memory import (
    CPU_WORK,
    bench_config,
    reduced_stages,
    touching,
    weight_files,
)

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


def run_child(cache: Path, images: list[Path], out: Path, ranks: int) -> None:
    """One process of either side: the reduced cascade over its images (a rank's share under torchrun)."""
    import torch

    from pipelines import Pixal3D
    from pipelines.data_parallel import DataJob
    from pipelines.parallel import rank_of
    from pixal3d.parallel import ParallelSettings
    from pixal3d.staging import EventLog
    from pixal3d.telemetry import read_trace, summarize

    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    config = bench_config(cache, CPU_WORK)
    info: dict[str, Any] = {}
    settings = ParallelSettings(mode="data", data_groups=ranks) if ranks > 1 else None
    job = DataJob.join(settings) if settings is not None else None
    rank = job.rank if job is not None else 0
    group = dataclasses.replace(rank_of(settings, torch.device("cpu")), share=job) if job is not None else None

    log = EventLog()
    trace = out / f"rank{rank}.trace.jsonl"
    start = time.perf_counter()
    try:
        with Pixal3D.from_config(config, policy="staged", device="cpu", replace=reduced_stages(config, CPU_WORK, info),
                                 until="decode", wrap_loader=touching, parallel=group) as pipe:
            items = list(pipe.run_batch(images, order="stage", events=log, trace=trace))
        if job is not None:  # the end of the job: every rank done before rank 0 (the store's host) exits
            if job.gather([]) is not None:
                job.post_exit(0, readers=job.groups - 1)
            else:
                job.wait_exit()
    finally:
        if job is not None:
            job.close()
    seconds = time.perf_counter() - start
    failed = [f"{i.name}: {i.message}" for i in items if not i.ok]
    if failed:
        raise SystemExit(f"rank {rank}: {failed}")
    loads = [e for e in log.events if e.kind in ("load", "reload")]
    peak = summarize(read_trace(trace)).rows if trace.exists() else []
    result = {"rank": rank, "images": [i.name for i in items], "seconds_in_process": round(seconds, 2),
              "loads": len(loads), "loaded_bytes": sum(e.bytes for e in loads),
              "load_seconds": round(sum(e.seconds for e in loads), 2),
              "models_loaded": sorted({e.model for e in loads}),
              "peak_process": max((r.peak_process or 0 for r in peak), default=0),
              "fingerprints": {i.name: i.result.fingerprints() for i in items}}
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1) + "\n")


def launch(side: str, cache: Path, images: list[Path], out: Path, ranks: int) -> tuple[float, list[dict]]:
    """Run one side in fresh processes (the checkpoints evicted first); its wall seconds and per-rank results."""
    out.mkdir(parents=True, exist_ok=True)
    for path in weight_files(cache):
        bench_io.evict(path)
    script = [str(Path(__file__).resolve()), "--child", "--cache", str(cache), "--out", str(out),
              "--ranks", str(ranks if side == "data" else 1), "--images", *map(str, images)]
    command = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *script]
               if side == "data" else [sys.executable, *script])
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    kernels.apply_recommended_pins(env)  # the suite's kernel pins: unpinned MKL may round a GEMM differently per run
    start = time.perf_counter()
    subprocess.run(command, check=True, cwd=REPO, env=env)
    wall = time.perf_counter() - start
    return wall, [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=wrc.DEFAULT_CACHE)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--report", type=Path, default=REPO / "benchmarks" / "batch_ranks")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--images", type=Path, nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cache = args.cache.expanduser()
    if args.child:
        run_child(cache, list(args.images), args.out, args.ranks)
        return 0
    wrc.write_all(cache)
    wrc.write_pipeline_json(cache)
    images = write_images(cache.parent / "bench-batch-images")
    scratch = cache.parent / "bench-batch-ranks"
    before = os.getloadavg()
    sides = {}
    for side in ("single", "data"):
        folder = scratch / side
        for old in folder.glob("rank*"):
            old.unlink()
        sides[side] = launch(side, cache, images, folder, args.ranks)
        print(f"{side}: {sides[side][0]:.1f} s", flush=True)
    after = os.getloadavg()
    single = {k: v for r in sides["single"][1] for k, v in r["fingerprints"].items()}
    data = {k: v for r in sides["data"][1] for k, v in r["fingerprints"].items()}
    same = single == data and len(data) == len(images)
    rows = ["| side | wall s | rank | images | loads | GiB loaded | load s | peak GiB |", "|---|---|---|---|---|---|---|---|"]
    for side, (wall, results) in sides.items():
        for r in results:
            rows.append(f"| {side} | {wall:.1f} | {r['rank']} | {', '.join(r['images'])} | {r['loads']} | "
                        f"{r['loaded_bytes'] / GIB:.2f} | {r['load_seconds']:.1f} | {r['peak_process'] / GIB:.2f} |")
    command = " ".join(["python scripts/bench_batch_ranks.py", *(argv if argv is not None else sys.argv[1:])])
    text = "\n".join([
        "# The real-width reduced cascade over 4 images: 2 ranks (--parallel data) vs 1 process",
        "",
        (f"Command: `{command}`. Each process one thread, `staged`, stage order, the checkpoint files evicted from "
        "the page cache before each side; the reduced work of `scripts/bench_memory.py` (1 Euler step per flow stage, "
        "guidance 1, synthetic structure, decoders on a few tokens, no export) at the real model sizes."),
        "",
        (f"Machine: {os.cpu_count()} vCPUs; 1-minute load average {before[0]:.2f} before, {after[0]:.2f} after. "
        f"Kernel pins: {kernels.apply_recommended_pins(dict(os.environ)) or 'none'} (as the test suite's)."),
        "",
        *rows,
        "",
        (f"Speed-up (single wall / 2-rank wall): {sides['single'][0] / sides['data'][0]:.2f}x. Fingerprints of every "
        f"image {'equal' if same else 'DIFFERENT'} between the sides."),
        "",
    ])
    args.report.with_suffix(".md").write_text(text)
    args.report.with_suffix(".json").write_text(json.dumps(
        {"command": command, "load_average": [before, after], "same_fingerprints": same,
         "sides": {side: {"wall_s": wall, "ranks": [{k: v for k, v in r.items() if k != "fingerprints"}
                                                     for r in results]} for side, (wall, results) in sides.items()}},
        indent=1) + "\n")
    print(text)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
