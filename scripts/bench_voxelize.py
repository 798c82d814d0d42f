"""Time and peak memory of ``pixal3d.mesh.voxelize.mesh_to_dual_grid`` against TRELLIS.2's C++ converter
(``tests/support/trellis2_voxelize.py`` builds it), on one mesh, in one run.

Each side runs in a fresh child process that loads the mesh from a .npy file; memory is the child's peak
resident set (``ru_maxrss``) above its resident set just before the call. Prints a table and, with
``--json``, writes the numbers.

    python scripts/bench_voxelize.py --resolution 1024 --faces 200000
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def bumpy_torus(faces: int) -> tuple[np.ndarray, np.ndarray]:
    """A closed torus with a wavy tube (about ``faces`` triangles) inside [-0.5, 0.5]³."""
    minor = max(8, int(round((faces / 2 / 2.5) ** 0.5)))
    major = max(8, int(round(faces / 2 / minor)))
    u, w = np.meshgrid(np.arange(major) * 2 * np.pi / major, np.arange(minor) * 2 * np.pi / minor, indexing="ij")
    tube = 0.11 * (1 + 0.15 * np.sin(7 * u) * np.cos(5 * w))
    x = (0.3 + tube * np.cos(w)) * np.cos(u)
    y = (0.3 + tube * np.cos(w)) * np.sin(u)
    z = tube * np.sin(w)
    v = np.stack([x, y, z], axis=-1).reshape(-1, 3)
    i, j = np.meshgrid(np.arange(major), np.arange(minor), indexing="ij")
    a, b = i * minor + j, ((i + 1) % major) * minor + j
    c, d = ((i + 1) % major) * minor + (j + 1) % minor, i * minor + (j + 1) % minor
    f = np.concatenate([np.stack([a, b, c], -1).reshape(-1, 3), np.stack([a, c, d], -1).reshape(-1, 3)])
    return v, f.astype(np.int64)


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(which: str, mesh: str, resolution: int) -> None:
    sys.path.insert(0, str(ROOT))
    data = np.load(mesh)
    v, f = data["v"], data["f"]
    if which == "ours":
        from pixal3d.mesh.voxelize import mesh_to_dual_grid

        run = lambda: len(mesh_to_dual_grid(v, f, resolution, progress=False).coords)  # noqa: E731
    else:
        from tests.support.trellis2_voxelize import build, reference_dual_grid

        build()
        run = lambda: len(reference_dual_grid(v, f, resolution)[0])  # noqa: E731
    base = _rss_mib()
    t = time.perf_counter()
    n = run()
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"which": which, "voxels": n, "seconds": seconds, "peak_mib": peak - base}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--faces", type=int, default=200_000)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", choices=["ours", "reference"], help=argparse.SUPPRESS)
    ap.add_argument("--mesh", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.mesh, args.resolution)
    v, f = bumpy_torus(args.faces)
    with tempfile.TemporaryDirectory() as tmp:
        mesh = os.path.join(tmp, "mesh.npz")
        np.savez(mesh, v=v, f=f)
        rows = {}
        for which in ("reference", "ours"):
            out = subprocess.run([sys.executable, __file__, "--child", which, "--mesh", mesh,
                                  "--resolution", str(args.resolution)], capture_output=True, text=True, check=True)
            rows[which] = json.loads(out.stdout.strip().splitlines()[-1])
    ours, ref = rows["ours"], rows["reference"]
    print(f"mesh: bumpy torus, {len(f)} faces, R = {args.resolution}; voxels: ours {ours['voxels']}, "
          f"reference {ref['voxels']}")
    print(f"{'':12s}{'seconds':>10s}{'peak MiB':>10s}")
    for name, row in (("reference", ref), ("ours", ours)):
        print(f"{name:12s}{row['seconds']:10.2f}{row['peak_mib']:10.0f}")
    print(f"{'ours/ref':12s}{ours['seconds'] / ref['seconds']:10.2f}{ours['peak_mib'] / max(ref['peak_mib'], 1):10.2f}")
    if args.json:
        args.json.write_text(json.dumps({"faces": len(f), "resolution": args.resolution, **rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
