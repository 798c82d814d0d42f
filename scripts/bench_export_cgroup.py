"""The export benchmark inside a memory cgroup (v1 ``memory.limit_in_bytes``, swap off; root only): does the whole
process group — the exporting process and the slab remesh's forked workers — fit the limit?

    python scripts/bench_export_cgroup.py --limit-mib 3400 [-- bench_export.py arguments]

Prints one JSON line: the limit, the command's exit status, the kernel's OOM kills, the group's anonymous memory
(``total_rss`` of ``memory.stat``, sampled at 5 Hz) and its usage high-water mark (page cache included). The export's
own output goes to ``--log``. Defaults: 9M voxels → 1M faces, 4096², the release remesh, the fields cached at
``--cache`` (``bench_export.py`` makes them on the first run).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit-mib", type=float, required=True)
    parser.add_argument("--cache", default="/work/cache/fields_9M.npz")
    parser.add_argument("--log", default="/tmp/bench_export_cgroup.log")
    parser.add_argument("--name", default="pixal3d_export_proof")
    parser.add_argument("extra", nargs="*", help="more bench_export.py arguments (after --)")
    args = parser.parse_args()
    group = Path("/sys/fs/cgroup/memory") / args.name
    group.mkdir(exist_ok=False)  # a fresh group: its counters are this run's
    try:
        (group / "memory.limit_in_bytes").write_text(str(int(args.limit_mib * 2**20)))
        (group / "memory.swappiness").write_text("0")
        command = [sys.executable, str(REPO / "scripts" / "bench_export.py"), "--voxels", "9000000", "--target",
                   "1000000", "--texture-size", "4096", "--remesh", "--cache", args.cache, "--out",
                   "/tmp/bench_export_cgroup.glb", *args.extra]
        with open(args.log, "w") as log:
            proc = subprocess.Popen(["sh", "-c", f'echo $$ > "{group}/cgroup.procs" && exec "$@"', "sh", *command],
                                    cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
            peak = 0
            while proc.poll() is None:
                stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
                peak = max(peak, int(stat["total_rss"]))
                time.sleep(0.2)
        control = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
        print(json.dumps({"limit_mib": args.limit_mib, "returncode": proc.returncode,
                          "oom_kill": int(control.get("oom_kill", 0)),
                          "group_total_rss_peak_gib": round(peak / 2**30, 3),
                          "max_usage_gib": round(int((group / "memory.max_usage_in_bytes").read_text()) / 2**30, 3)}))
    finally:
        group.rmdir()


if __name__ == "__main__":
    main()
