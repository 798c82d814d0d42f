"""Job server benchmark across processes, with the tiny config on this machine, on each queue database: one API
process (``--role api``) and one or two worker processes (``--role worker --name wN``), as machines of a fleet run
them; the queue in SQLite (in ``--data``) and in PostgreSQL (a throwaway cluster on loopback, ``tests/support/postgres_harness``).

What it measures, for each database (``--parts``, default all three):

1. ``post``: ``POST /jobs`` → ``202`` on an API alone (no worker takes the jobs, none competes for the CPU),
   ``--probes`` submissions 0.3 s apart over one connection: the image flushed to disk, the row committed.
   (The throughput runs record each POST's round trip too, with the workers running beside the API.)
2. ``throughput``: jobs per minute with 1 and with 2 workers (``--jobs`` jobs of distinct seeds, ``--group-size 1``, every worker
   started and ready before the clock starts; from the first POST to the last job done). The workers split the
   cores (``--threads`` each: all of them for one worker, half for two).
3. ``takeover``: a job running on one of two workers (``--lease`` seconds, default 3), that worker killed with
   SIGKILL once the job has recorded 4 stages; the seconds from the kill until the other worker runs the job
   (``GET /jobs/{id}`` shows attempt 2 running), and until it is done.

Prints a table per database and writes ``benchmarks/serve_fleet.json``.

    python scripts/bench_serve_fleet.py            # about 10 minutes on 2 busy cores
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.postgres_harness import start_server
from tests.support.serve_harness import Server

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tiny.yaml"
EXAMPLE = REPO / "assets" / "example.png"
SETTINGS = {"texture_size": 128, "face_budget": 2000, "memory_policy": "resident"}


def fleet(folder: Path, queue: list[str], workers: int, threads: int, lease: str) -> tuple[Server, list[Server]]:
    """An API and ``workers`` named worker processes on one queue and data folder, every worker ready."""
    data = folder / "data"
    common = ["--config", str(CONFIG), *queue]
    api = Server.start(data, *common, "--role", "api", ready=False, log="api")
    started = [Server.start(data, *common, "--role", "worker", "--name", f"w{i}", "--devices", "cpu", "--threads",
                            str(threads), "--group-size", "1", "--lease", lease, log=f"w{i}") for i in range(workers)]
    while True:
        health = api.get("/health").json()
        if health["ready"] and len(health["workers"]) == workers:
            return api, started
        time.sleep(0.2)


def stop(api: Server, workers: list[Server]) -> None:
    for process in [*workers, api]:
        process.stop()


def throughput(folder: Path, queue: list[str], workers: int, jobs: int, cores: int) -> dict[str, Any]:
    api, started = fleet(folder, queue, workers, max(1, cores // workers), "30")
    try:
        posts, ids = [], []
        begin = time.perf_counter()
        for seed in range(jobs):
            sent = time.perf_counter()
            response = api.submit(EXAMPLE.read_bytes(), {**SETTINGS, "seed": seed})
            posts.append(time.perf_counter() - sent)
            assert response.status_code == 202, response.text
            ids.append(response.json()["id"])
        views = [api.wait(job_id, timeout=1800) for job_id in ids]
        seconds = time.perf_counter() - begin
        assert all(v["status"] == "done" for v in views), views
        return {"workers": workers, "threads_each": max(1, cores // workers), "jobs": jobs,
                "seconds": round(seconds, 2), "jobs_per_minute": round(60 * jobs / seconds, 2),
                "post_202_ms": [round(1000 * s, 1) for s in posts],
                "median_post_202_ms": round(1000 * statistics.median(posts), 1),
                "load_average": [round(x, 2) for x in os.getloadavg()]}
    finally:
        stop(api, started)


def takeover(folder: Path, queue: list[str], lease: str, cores: int) -> dict[str, Any]:
    api, started = fleet(folder, queue, 2, max(1, cores // 2), lease)
    try:
        job = api.submit(EXAMPLE.read_bytes(), {**SETTINGS, "seed": 99}).json()["id"]
        view = api.wait(job, lambda v: v.get("stage_index", 0) >= 4, timeout=600)
        dead = next(w for w in started if w.log.stem == view["node"])
        killed = time.perf_counter()
        dead.kill()
        taken = api.wait(job, lambda v: v["status"] == "running" and v.get("attempt") == 2 or v["status"] == "done",
                         timeout=600)
        resumed = time.perf_counter()
        done = api.wait(job, timeout=600)
        finished = time.perf_counter()
        assert done["status"] == "done" and done["lost"] == 1, done
        return {"lease_seconds": float(lease), "kill_to_other_worker_running_s": round(resumed - killed, 2),
                "kill_to_done_s": round(finished - killed, 2), "resumed_stages": done["resumed"],
                "taken_over_running": taken["status"] == "running"}
    finally:
        stop(api, [w for w in started if w.process.poll() is None])


def post_latency(folder: Path, queue: list[str], probes: int) -> dict[str, Any]:
    api = Server.start(folder / "data", "--config", str(CONFIG), *queue, "--role", "api", "--queue-size",
                       str(probes + 1), ready=False, log="api")
    try:
        seconds = []
        with api.client() as client:
            for seed in range(probes):
                sent = time.perf_counter()
                response = client.post("/jobs", files={"image": ("example.png", EXAMPLE.read_bytes(), "image/png")},
                                       data={"settings": json.dumps({**SETTINGS, "seed": seed})})
                seconds.append(time.perf_counter() - sent)
                assert response.status_code == 202, response.text
                time.sleep(0.3)  # apart, as clients post: back to back, each waits ~40 ms more (delayed ACKs)
        return {"probes": probes, "post_202_ms": [round(1000 * s, 1) for s in seconds],
                "median_post_202_ms": round(1000 * statistics.median(seconds), 1),
                "load_average": [round(x, 2) for x in os.getloadavg()]}
    finally:
        api.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--probes", type=int, default=10)
    parser.add_argument("--parts", default="post,throughput,takeover")
    parser.add_argument("--lease", default="3", help="the takeover's lease in seconds (default 3)")
    parser.add_argument("--queues", default="sqlite,postgresql")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "serve_fleet.json")
    args = parser.parse_args()
    cores = os.cpu_count() or 2
    results: dict[str, Any] = {"machine": {"cpus": cores, "load_average_start": list(os.getloadavg())},
                               "settings": SETTINGS, "queues": {}}
    postgres = None
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as scratch:
        try:
            for kind in args.queues.split(","):
                queue: list[str] = []
                if kind == "postgresql":
                    postgres = postgres or start_server()
                    queue = ["--queue", postgres.new_database()]
                parts = args.parts.split(",")
                found = results["queues"][kind] = {}
                if "post" in parts:
                    found["post"] = post_latency(Path(tempfile.mkdtemp(dir=scratch)), queue, args.probes)
                if "throughput" in parts:
                    found["throughput"] = [throughput(Path(tempfile.mkdtemp(dir=scratch)), queue, n, args.jobs,
                                                      cores) for n in (1, 2)]
                if "takeover" in parts:
                    if kind == "postgresql":
                        queue = ["--queue", postgres.new_database()]
                    found["takeover"] = takeover(Path(tempfile.mkdtemp(dir=scratch)), queue, args.lease, cores)
        finally:
            if postgres is not None:
                postgres.stop()
    results["machine"]["load_average_end"] = list(os.getloadavg())
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    for kind, found in results["queues"].items():
        print(f"## {kind}")
        if "post" in found:
            p = found["post"]
            print(f"POST → 202 on an API alone: median {p['median_post_202_ms']} ms {p['post_202_ms']}")
        if "throughput" in found:
            print("| workers (threads each) | jobs | seconds | jobs/minute | POST → 202 median (each) | load after |")
            print("|---|---|---|---|---|---|")
            for row in found["throughput"]:
                print(f"| {row['workers']} ({row['threads_each']}) | {row['jobs']} | {row['seconds']} | "
                      f"{row['jobs_per_minute']} | {row['median_post_202_ms']} ms {row['post_202_ms']} | "
                      f"{row['load_average'][0]} |")
        if "takeover" in found:
            t = found["takeover"]
            print(f"takeover (lease {t['lease_seconds']:g} s): kill → the other worker runs it "
                  f"{t['kill_to_other_worker_running_s']} s; kill → done {t['kill_to_done_s']} s; resumed "
                  f"{len(t['resumed_stages'])} stages")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
