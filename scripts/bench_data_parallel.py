"""Throughput of ``--parallel data``: a folder of tiny images on 2 ranks x 1 thread against 1 process x 1 thread.

    PYTHONPATH=$PWD python scripts/bench_data_parallel.py [--images 6] [--repeats 3] [--ranks 2] [--split claims|static]

Both sides run the command (``pixal3d-image-to-mesh``, the tiny config, offline, ``--quiet``) over the same folder
(``assets/example.png`` mirrored, flipped and turned, so every image differs), in fresh processes, alternating
(single, data, single, data, ...). ``--split claims`` (default): each data run with its own fresh work directory
(the groups claim images; every stage is recorded there) and each single run without one; ``--split static``: no
work directory on either side (image i to rank i mod K), so the two sides do the same work. Every run's wall time
is taken around the whole command (start-up and model loads included: what a user waits for), and split into the
images' own stage seconds (batch.json: per rank, the sum of its images' ``seconds``) and the rest (start-up,
imports, rendezvous, plan, model loads, writing outputs): ``fixed_s`` = wall - the busiest rank's image seconds.
Printed: each run's seconds, the median of each side, their ratio, the outputs' fingerprints checked equal
between the two sides, and the load average before and after (``os.getloadavg``). The ratio only
means something on a machine otherwise idle with at least ``--ranks`` free cores: read the load average first.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("identity", "mirror", "flip", "rot90", "rot180", "rot270", "rot45", "mirror_rot90")


def write_images(folder: Path, count: int) -> None:
    from PIL import Image, ImageOps

    source = Image.open(REPO / "assets" / "example.png")
    made = {"identity": source, "mirror": ImageOps.mirror(source), "flip": ImageOps.flip(source),
            "rot90": source.rotate(90), "rot180": source.rotate(180), "rot270": source.rotate(270),
            "rot45": source.rotate(45), "mirror_rot90": ImageOps.mirror(source).rotate(90)}
    for i in range(count):
        name = VARIANTS[i % len(VARIANTS)]
        made[name].save(folder / f"{i:02d}_{name}.png")


def fingerprints(out: Path) -> dict[str, dict]:
    return {p.name: {s["stage"]: s["fingerprints"] for s in json.loads(p.read_text())["stages"]}
            for p in sorted(out.glob("*.run.json"))}


def busiest(out: Path) -> float:
    """The largest per-rank sum of the images' stage seconds in batch.json (one process: all its images)."""
    per_rank: dict[int, float] = {}
    for row in json.loads((out / "batch.json").read_text())["images"]:
        per_rank[row.get("rank", 0)] = per_rank.get(row.get("rank", 0), 0.0) + float(row.get("seconds") or 0.0)
    return max(per_rank.values())


def run(kind: str, images: Path, work: Path, ranks: int, env: dict[str, str], split: str
        ) -> tuple[float, float, dict]:
    out = work / "out"
    command = [str(REPO / "scripts" / "image_to_mesh.py"), str(images), "--config", "tiny", "-o", str(out), "--quiet"]
    if kind == "data":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                   *command, "--parallel", "data", *(["--work-dir", str(work / "claims")] if split == "claims" else [])]
    else:
        command = [sys.executable, *command]
    start = time.perf_counter()
    subprocess.run(command, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start, busiest(out), fingerprints(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side, alternating")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--split", choices=["claims", "static"], default="claims",
                        help="claims: the data side claims images in a work dir (records every stage); static: "
                             "neither side has a work dir")
    args = parser.parse_args(argv)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    before = os.getloadavg()
    times: dict[str, list[float]] = {"single": [], "data": []}
    images_s: dict[str, list[float]] = {"single": [], "data": []}
    reference = None
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        images = Path(tmp) / "in"
        images.mkdir()
        write_images(images, args.images)
        for i in range(args.repeats):
            for kind in ("single", "data"):
                work = Path(tmp) / f"{kind}{i}"
                seconds, busy, prints = run(kind, images, work, args.ranks, env, args.split)
                if reference is None:
                    reference = prints
                if prints != reference or len(prints) != args.images:
                    raise SystemExit(f"{kind} run {i}: fingerprints differ from the first run's")
                times[kind].append(seconds)
                images_s[kind].append(busy)
                print(f"{kind:6s} run {i}: {seconds:.2f} s ({args.images} images; busiest rank's images {busy:.2f} s, "
                      f"the rest {seconds - busy:.2f} s)", flush=True)
                shutil.rmtree(work)
    after = os.getloadavg()
    single, data = statistics.median(times["single"]), statistics.median(times["data"])
    busy = {kind: statistics.median(v) for kind, v in images_s.items()}
    print(json.dumps({"images": args.images, "ranks": args.ranks, "split": args.split, "threads_per_process": 1,
                      "seconds": times, "images_seconds_busiest_rank": images_s,
                      "median_single_s": single, "median_data_s": data, "speedup": single / data,
                      "median_images_s": busy, "images_speedup": busy["single"] / busy["data"],
                      "median_fixed_s": {"single": single - busy["single"], "data": data - busy["data"]},
                      "fingerprints_equal": True, "load_average_before": before, "load_average_after": after,
                      "cpu_count": os.cpu_count()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
