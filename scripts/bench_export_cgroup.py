"""The export benchmark inside a memory cgroup (v1 ``memory.limit_in_bytes``, swap off; root only): does the whole
process group — the exporting process and the slab remesh's forked workers — fit the limit?

    python scripts/bench_export_cgroup.py --limit-mib 3400 [-- bench_export.py arguments]

Prints one JSON line: the limit, the command's exit status, the kernel's OOM kills, the group's anonymous memory
(``total_rss`` of ``memory.stat``, sampled at 5 Hz) and its usage high-water mark (page cache included), and the
group's sampled peak per export step (a step is the one in progress: the step after the last ``export <step>:`` line
in the log). The export's own output goes to ``--log``. Defaults: 9M voxels → 1M faces, 4096², the release remesh, the fields cached at
``--cache`` (``bench_export.py`` makes them on the first run).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pixal3d.mesh.export import STEPS

REPO = Path(__file__).resolve().parents[1]


def _step_in_progress(log, step: str) -> str:
    """The step the export is in, from the log's new lines: the one after the last that reported itself done."""
    for line in log.readlines():
        name = line.split(":", 1)[0].removeprefix("export ")
        if line.startswith("export ") and name in STEPS:
            step = STEPS[min(STEPS.index(name) + 1, len(STEPS) - 1)]
    return step


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
            peak, steps, step = 0, {}, STEPS[0]
            with open(args.log) as progress:
                while proc.poll() is None:
                    stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
                    rss = int(stat["total_rss"])
                    peak, steps[step] = max(peak, rss), max(steps.get(step, 0), rss)
                    step = _step_in_progress(progress, step)
                    time.sleep(0.2)
        control = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
        print(json.dumps({"limit_mib": args.limit_mib, "returncode": proc.returncode,
                          "oom_kill": int(control.get("oom_kill", 0)),
                          "group_total_rss_peak_gib": round(peak / 2**30, 3),
                          "max_usage_gib": round(int((group / "memory.max_usage_in_bytes").read_text()) / 2**30, 3),
                          "step_group_rss_peak_gib": {k: round(v / 2**30, 3) for k, v in steps.items()}}))
    finally:
        group.rmdir()


if __name__ == "__main__":
    main()
