"""Time and peak memory of ``pixal3d.mesh.voxelize.mesh_to_dual_grid`` against TRELLIS.2's C++ converter
(``tests/support/trellis2_voxelize.py`` builds it), on one mesh, in one run.

Each side runs in a fresh child process that loads the mesh from a .npy file; memory is the child's peak
resident set (``ru_maxrss``) above its resident set just before the call. Prints a table and, with
``--json``, writes the numbers.

    python scripts/bench_voxelize.py --resolution 1024 --faces 200000
    python scripts/bench_voxelize.py --resolution 1024 --faces 1020000 --tori 6   # 5.4M voxels
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
    minor = max(8, round((faces / 2 / 2.5) ** 0.5))
    major = max(8, round(faces / 2 / minor))
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


# Scale and centre of each torus of ``--tori``: nested and stacked rings, more surface (voxels) per face count.
TORI = ((1.0, (0, 0, 0)), (0.8, (0, 0, 0.12)), (0.6, (0, 0, -0.12)), (0.45, (0, 0, 0.22)), (0.45, (0, 0, -0.22)),
        (0.3, (0, 0, 0)))


def bumpy_tori(faces: int, tori: int) -> tuple[np.ndarray, np.ndarray]:
    """``tori`` bumpy tori of ``TORI`` in one mesh, about ``faces`` triangles in all."""
    vs, fs, offset = [], [], 0
    for scale, centre in TORI[:tori]:
        v, f = bumpy_torus(faces // tori)
        vs.append(np.clip(v * scale + centre, -0.5, 0.5))
        fs.append(f + offset)
        offset += len(v)
    return np.concatenate(vs), np.concatenate(fs)


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(which: str, mesh: str, resolution: int) -> None:
    """Run one side, print its numbers, save (coords, offsets, flags) beside the mesh for the comparison."""
    sys.path.insert(0, str(ROOT))
    data = np.load(mesh)
    v, f = data["v"], data["f"]
    if which == "ours":
        from pixal3d.mesh.voxelize import mesh_to_dual_grid

        def run():
            fields = mesh_to_dual_grid(v, f, resolution, progress=False)
            return fields.coords.numpy(), fields.dual_vertices.numpy(), fields.intersected.numpy()
    else:
        from tests.support.trellis2_voxelize import build, reference_dual_grid

        build()

        def run():
            coords, dual, flags = reference_dual_grid(v, f, resolution)
            return coords, dual * np.float32(resolution) - coords.astype(np.float32), flags  # the pipeline's feats
    base = _rss_mib()
    t = time.perf_counter()
    coords, offsets, flags = run()
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    np.savez(f"{mesh}.{which}.npz", coords=coords, offsets=offsets, flags=flags)
    print(json.dumps({"which": which, "voxels": len(coords), "seconds": seconds, "peak_mib": peak - base}))


def qef_excess(v, f, resolution, coords, ours, reference) -> float:
    """Largest ``E(ours) − E(reference)`` over voxels, E the float64 value of each voxel's regularised QEF."""
    sys.path.insert(0, str(ROOT))
    from pixal3d.mesh import voxelize as vz

    q = vz.accumulate_qefs(v, f, resolution).matrices(1e-2).astype(np.float64)

    def err(offsets):
        p = (coords + offsets.astype(np.float64)) / resolution
        ph = np.concatenate([p, np.ones((len(p), 1))], axis=1)
        return np.einsum("ni,nij,nj->n", ph, q, ph)

    return float(np.max(err(ours) - err(reference)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--faces", type=int, default=200_000)
    ap.add_argument("--tori", type=int, default=1, choices=range(1, len(TORI) + 1),
                    help="tori in the mesh (more voxels for the same faces)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", choices=["ours", "reference"], help=argparse.SUPPRESS)
    ap.add_argument("--mesh", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.mesh, args.resolution)
    v, f = bumpy_tori(args.faces, args.tori)
    with tempfile.TemporaryDirectory() as tmp:
        mesh = os.path.join(tmp, "mesh.npz")
        np.savez(mesh, v=v, f=f)
        rows = {}
        for which in ("reference", "ours"):
            out = subprocess.run([sys.executable, __file__, "--child", which, "--mesh", mesh,
                                  "--resolution", str(args.resolution)], capture_output=True, text=True, check=True)
            rows[which] = json.loads(out.stdout.strip().splitlines()[-1])
        a, b = np.load(f"{mesh}.ours.npz"), np.load(f"{mesh}.reference.npz")
        same = bool(np.array_equal(a["coords"], b["coords"]) and np.array_equal(a["flags"], b["flags"]))
        diff = np.abs(a["offsets"].astype(np.float64) - b["offsets"]).max(axis=1) if same else np.full(1, np.nan)
        excess = qef_excess(v, f, args.resolution, a["coords"], a["offsets"], b["offsets"]) if same else np.nan
    ours, ref = rows["ours"], rows["reference"]
    rows["parity"] = {"coords_and_flags_identical": same, "offset_diff_max_voxels": float(diff.max()),
                      "offset_diff_p99_voxels": float(np.quantile(diff, 0.99)),
                      "qef_error_ours_minus_reference_max": float(excess)}
    print(f"mesh: {args.tori} bumpy tori, {len(f)} faces, R = {args.resolution}; voxels: ours {ours['voxels']}, "
          f"reference {ref['voxels']}")
    print(f"coords, order and flags identical: {same}; dual vertex offsets |ours - reference|: max "
          f"{diff.max():.4f}, p99 {np.quantile(diff, 0.99):.5f} voxels; QEF error ours − reference, max over "
          f"voxels: {excess:.3g} (≤ 1e-13, float64 rounding: ours never worse)")
    print(f"{'':12s}{'seconds':>10s}{'peak MiB':>10s}")
    for name, row in (("reference", ref), ("ours", ours)):
        print(f"{name:12s}{row['seconds']:10.2f}{row['peak_mib']:10.0f}")
    print(f"{'ours/ref':12s}{ours['seconds'] / ref['seconds']:10.2f}{ours['peak_mib'] / max(ref['peak_mib'], 1):10.2f}")
    if args.json:
        args.json.write_text(json.dumps({"faces": len(f), "tori": args.tori, "resolution": args.resolution, **rows},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
