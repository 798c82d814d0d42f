"""Job server benchmark with the tiny config on this machine: throughput with one worker and with two, the time
from ``POST /jobs`` to the job's first stage, and what the durability costs (a job with its stage records and
without).

What it does, in order:

1. Throughput: ``--rounds`` times, alternated, for each layout (one CPU worker with every thread; two CPU workers with half the threads each) a fresh
   ``pixal3d-serve`` on loopback over an empty data folder; ``--jobs`` jobs of distinct seeds (``--group-size 1``:
   each job alone, so the workers and not the grouping are measured) posted at once; jobs per minute from the first
   POST to the last job done. Each server is started and its workers made ready before the clock starts.
2. POST to first stage: on the warm one-worker server, idle, ``--probes`` jobs one after another: the 202's round
   trip (the job's input and settings written and flushed before it) and the time until ``GET /jobs/{id}`` first
   shows a stage (polled every 5 ms).
3. Durability: in this process, the same pipeline runs the tiny cascade with ``Pixal3D.run_batch`` with and
   without a work directory (every stage's outputs written and flushed), alternating, ``--repeats`` times each,
   and times what the records cost directly: the seconds spent in ``StateStore.saved`` (encode, write, fsync,
   rename) per job, which the shared machine's noise does not swamp.
4. Prints the tables and writes ``benchmarks/serve.json``.

    python scripts/bench_serve.py                 # about 12 minutes on 2 busy cores
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tiny.yaml"
EXAMPLE = REPO / "assets" / "example.png"
SETTINGS = {"texture_size": 128, "face_budget": 2000, "memory_policy": "resident"}


def start(data: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """A server on a free loopback port, its workers ready; returns the process and its URL."""
    log = data.parent / f"{data.name}.log"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pipelines.serve", "--config", str(CONFIG), "--data", str(data),
                                 "--port", "0", *args], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    while not (found := re.search(r"serving (http://\S+)", log.read_text())):
        if proc.poll() is not None:
            raise RuntimeError(log.read_text())
        time.sleep(0.1)
    url = found[1]
    while not httpx.get(f"{url}/health").json()["ready"]:
        time.sleep(0.2)
    return proc, url


def post(client: httpx.Client, seed: int) -> str:
    response = client.post("/jobs", files={"image": ("example.png", EXAMPLE.read_bytes(), "image/png")},
                           data={"settings": json.dumps({**SETTINGS, "seed": seed})})
    response.raise_for_status()
    return response.json()["id"]


def wait_all(client: httpx.Client, ids: list[str]) -> list[dict[str, Any]]:
    views: dict[str, dict[str, Any]] = {}
    while len(views) < len(ids):
        for job_id in ids:
            if job_id not in views:
                view = client.get(f"/jobs/{job_id}").json()
                if view["status"] in ("done", "failed", "cancelled"):
                    views[job_id] = view
        time.sleep(0.1)
    return [views[i] for i in ids]


def throughput(folder: Path, name: str, jobs: int, *args: str) -> tuple[dict[str, Any], Any]:
    proc, url = start(folder / name, "--group-size", "1", *args)
    client = httpx.Client(base_url=url, timeout=60)
    begin = time.perf_counter()
    ids = [post(client, seed) for seed in range(jobs)]
    views = wait_all(client, ids)
    seconds = time.perf_counter() - begin
    assert all(v["status"] == "done" for v in views), views
    row = {"layout": name, "args": list(args), "jobs": jobs, "seconds": round(seconds, 2),
           "jobs_per_minute": round(60 * jobs / seconds, 2),
           "mean_job_seconds": round(statistics.mean(v["seconds"] for v in views), 2),
           "load_average": [round(x, 2) for x in os.getloadavg()]}
    return row, (proc, client)


def first_stage(client: httpx.Client, probes: int) -> dict[str, Any]:
    accepted, started = [], []
    for seed in range(1000, 1000 + probes):
        begin = time.perf_counter()
        job_id = post(client, seed)
        accepted.append(time.perf_counter() - begin)
        while not client.get(f"/jobs/{job_id}").json().get("stage"):
            time.sleep(0.005)
        started.append(time.perf_counter() - begin)
        wait_all(client, [job_id])
    return {"probes": probes, "post_202_ms": [round(1000 * s, 1) for s in accepted],
            "post_to_first_stage_ms": [round(1000 * s, 1) for s in started],
            "median_post_202_ms": round(1000 * statistics.median(accepted), 1),
            "median_post_to_first_stage_ms": round(1000 * statistics.median(started), 1)}


def durability(repeats: int, folder: Path) -> dict[str, Any]:
    from pipelines import Pixal3D, work_dir
    from pipelines.job import Job
    from pixal3d.config import load_config

    config = Job.from_request({"texture_size": 128, "face_budget": 2000}, load_config(CONFIG)).config
    rows: dict[str, list[float]] = {"without records": [], "with records": []}
    saving: list[float] = []  # seconds inside StateStore.saved (encode, write, fsync, rename) per job
    original = work_dir.StateStore.saved

    def timed(self: Any, item: Any, k: int) -> None:
        begin = time.perf_counter()
        original(self, item, k)
        if self.work is not None:
            saving[-1] += time.perf_counter() - begin

    work_dir.StateStore.saved = timed
    with Pixal3D.from_config(config, policy="resident", device="cpu") as pipe:
        list(pipe.run_batch([str(EXAMPLE)], seed=0))  # warm: the models load once, before the clock
        for i in range(repeats):
            for label in ("without records", "with records"):
                work = folder / f"work-{i}" if label == "with records" else None
                saving.append(0.0)
                begin = time.perf_counter()
                [item] = list(pipe.run_batch([str(EXAMPLE)], seed=i, work_dir=work))
                assert item.ok and not item.resumed
                rows[label].append(time.perf_counter() - begin)
    work_dir.StateStore.saved = original
    record_bytes = sum(p.stat().st_size for p in (folder / "work-0").rglob("*") if p.is_file())
    out = {label: {"seconds": [round(s, 3) for s in times], "median": round(statistics.median(times), 3)}
           for label, times in rows.items()}
    writes = saving[1::2]  # the runs with records (the others spend nothing there)
    out["seconds_writing_records"] = [round(s, 3) for s in writes]
    out["median_seconds_writing_records"] = round(statistics.median(writes), 3)
    out["writing_share_of_job"] = round(statistics.median(writes) / out["with records"]["median"], 4)
    out["ratio_with_to_without"] = round(out["with records"]["median"] / out["without records"]["median"], 3)
    out["record_bytes_per_job"] = record_bytes
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=6)
    parser.add_argument("--probes", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="throughput rounds, the two layouts alternated")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "serve.json")
    args = parser.parse_args()
    cores = os.cpu_count() or 2
    results: dict[str, Any] = {"machine": {"cpus": cores, "load_average_start": list(os.getloadavg())}}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as scratch:
        folder = Path(scratch)
        layouts = {"one worker": ("--devices", "cpu", "--threads", str(cores)),
                   "two workers": ("--devices", "cpu,cpu", "--threads", str(max(1, cores // 2)))}
        results["throughput"], ratios = [], []
        for round_ in range(args.rounds):  # alternated, so that a change in the machine's load hits both
            pair = {}
            for name, layout in layouts.items():
                row, (proc, client) = throughput(folder, f"{name} {round_}", args.jobs, *layout)
                row["round"] = round_
                pair[name] = row
                if round_ == 0 and name == "one worker":
                    results["first_stage"] = first_stage(client, args.probes)
                proc.terminate()
                proc.wait(60)
                results["throughput"].append(row)
            ratios.append(pair["two workers"]["jobs_per_minute"] / pair["one worker"]["jobs_per_minute"])
        results["throughput_ratio_two_to_one"] = [round(r, 3) for r in ratios]
        results["durability"] = durability(args.repeats, folder)
    results["machine"]["load_average_end"] = list(os.getloadavg())
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print("| layout | jobs | seconds | jobs/minute | mean job seconds | load average after |")
    print("|---|---|---|---|---|---|")
    for row in results["throughput"]:
        print(f"| {row['layout']} ({' '.join(row['args'])}) | {row['jobs']} | {row['seconds']} | "
              f"{row['jobs_per_minute']} | {row['mean_job_seconds']} | {row['load_average'][0]} |")
    print(f"two workers / one worker, jobs per minute, per round: {results['throughput_ratio_two_to_one']}")
    fs = results["first_stage"]
    print(f"POST → 202: median {fs['median_post_202_ms']} ms {fs['post_202_ms']}; POST → first stage: median "
          f"{fs['median_post_to_first_stage_ms']} ms {fs['post_to_first_stage_ms']}")
    d = results["durability"]
    print(f"job without records: median {d['without records']['median']} s {d['without records']['seconds']}; with "
          f"records: median {d['with records']['median']} s {d['with records']['seconds']}; ratio "
          f"{d['ratio_with_to_without']}; writing the records: median {d['median_seconds_writing_records']} s "
          f"{d['seconds_writing_records']} ({100 * d['writing_share_of_job']:.1f} % of a job); "
          f"{d['record_bytes_per_job']} bytes of records per job")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
