"""How long the command takes before it does anything: ``--help`` and ``--plan`` (tiny config, weights cached),
each in a fresh interpreter, as a user starts it; and what the heaviest imports of ``import pipelines.cli`` cost
(``python -X importtime``, cumulative microseconds of the slowest modules).

    python scripts/bench_startup.py [--repeat 5] [--checkout DIR]

``--checkout`` times another checkout (e.g. a worktree of an older commit) the same way, in the same run, so the
two can be compared under the same load. Prints the median and the range of each, the load average, the CPU."""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _time(checkout: Path, argv: list[str], cache: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(checkout), "PIXAL3D_CACHE": str(cache)}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pipelines.cli", *argv], cwd=checkout, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def _heaviest(checkout: Path, cache: Path, count: int = 8) -> list[tuple[str, float]]:
    env = {**os.environ, "PYTHONPATH": str(checkout), "PIXAL3D_CACHE": str(cache)}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "import pipelines.cli"], cwd=checkout, env=env,
                          capture_output=True, text=True, check=True)
    rows = []
    for line in proc.stderr.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((parts[2].strip(), int(parts[1]) / 1e6))
    wanted = ("torch", "transformers", "trimesh", "scipy", "pixal3d.config", "pixal3d.mesh", "pipelines.cli")
    return [(name, seconds) for name, seconds in rows if name in wanted][:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--checkout", type=Path, action="append", default=[],
                        help="another checkout to time the same way (repeatable)")
    args = parser.parse_args()
    print(f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        out = Path(tmp) / "o.glb"
        plan = ["assets/example.png", "--config", "configs/tiny.yaml", "--plan", "--quiet", "-o", str(out)]
        for checkout in [REPO, *args.checkout]:
            _time(checkout, plan, cache)  # generates the tiny weights once, so the plan reads cached headers
            for name, argv in (("--help", ["--help"]), ("--plan (tiny, cached)", plan)):
                times = [_time(checkout, argv, cache) for _ in range(args.repeat)]
                print(f"{checkout}: {name}: median {statistics.median(times):.2f} s "
                      f"(min {min(times):.2f}, max {max(times):.2f}, {args.repeat} runs)")
            heavy = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in _heaviest(checkout, cache))
            print(f"{checkout}: import pipelines.cli, cumulative: {heavy}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
