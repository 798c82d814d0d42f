"""Export quality on decode-like shapes, per branch: no remesh / remesh / remesh exterior-only.

    python scripts/bench_export_quality.py [--resolution 512] [--target 200000] [--texture-size 2048]
        [--shapes holes thin_walls handle slits components] [--branches none remesh exterior]
        [--big-voxels 8000000 --big-branches remesh] [--big-target 1000000] [--big-texture-size 4096]
        [--out benchmarks/export_quality.md]

Each (shape, branch) runs ``export_glb`` in a fresh process (so that one run's memory does not count in
the next) with exact per-step peak RSS. Shapes: ``pixal3d.mesh.synthetic.DECODE_LIKE_SHAPES`` at
``--resolution`` (holes of 0.75–12 voxels plus pinpricks, 1–2-voxel walls, a handle, slits under
2 voxels, seven parts). The remesh runs at the decode resolution, as the reference's release call.
``--big-voxels`` adds one run per ``--big-branches`` on scripts/bench_export.py's blobby shape at
R = ``--big-resolution`` (default 1024) with about that many voxels at the release face budget and
texture size (the peak-memory check; the fields are cached in /tmp). Prints each row as it comes; the raw reports accumulate in the
JSON beside ``--out`` (a later invocation adds or replaces rows), and the markdown is rewritten from it
after every run.
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

BRANCHES = {
    "none": {"remesh": False},
    "remesh": {"remesh": True},
    "exterior": {"remesh": True, "exterior_only": True},
}
COLUMNS = ("faces", "boundary_edges", "non_manifold_edges", "components", "uv_charts", "hausdorff_vox",
           "chamfer_vox")


def _color(p):
    import numpy as np

    out = np.empty((len(p), 6), np.float32)
    out[:, 0:3] = 0.5 + 0.45 * np.sin(p * np.array([17.0, 23.0, 29.0]))
    out[:, 3], out[:, 4], out[:, 5] = 0.2, 0.6, 1.0
    return out


def run_one(args) -> None:
    """Child process: build the fields, export once, print the report as JSON on the last line."""
    from pixal3d.mesh.export import ExportSettings, export_glb
    from pixal3d.mesh.synthetic import DECODE_LIKE_SHAPES, pbr_from_function

    start = time.perf_counter()
    if args.shape.startswith("big"):
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_export import load_or_make

        voxels, _, resolution = args.shape[3:].partition("r")  # big<voxels>, or big<voxels>r<R> at R != 1024
        fields = load_or_make(argparse.Namespace(voxels=int(voxels), resolution=int(resolution or 1024), seed=0,
                                                 cache=f"/tmp/bench_quality_{args.shape}.npz"))
    else:
        fields = DECODE_LIKE_SHAPES[args.shape](args.resolution)
    pbr = pbr_from_function(fields, _color)
    made = time.perf_counter() - start
    settings = ExportSettings(decimation_target=args.target, texture_size=args.texture_size, **BRANCHES[args.branch])
    cpu = time.process_time()
    report = export_glb(fields, pbr, f"/tmp/bench_quality_{args.shape}_{args.branch}.glb", settings=settings,
                        progress=False, exact_peak_rss=True)
    cpu = time.process_time() - cpu  # all threads: less sensitive to other load than wall time
    print(report.table(), file=sys.stderr)
    print(json.dumps(report.to_dict() | {"voxels": len(fields.coords), "resolution": fields.resolution,
                                         "fields_seconds": made, "cpu_seconds": cpu}))


def run_child(shape: str, branch: str, args) -> dict:
    big = shape.startswith("big")
    cmd = [sys.executable, __file__, "--one", shape, branch, "--resolution", str(args.resolution),
           "--target", str(args.big_target if big else args.target),
           "--texture-size", str(args.big_texture_size if big else args.texture_size)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{shape}/{branch} failed:\n{done.stderr[-3000:]}")
    print(done.stderr.strip(), flush=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def row(shape: str, branch: str, report: dict) -> list[str]:
    q = report["quality"]
    remesh_s = next(s["seconds"] for s in report["steps"] if s["name"] == "remesh")
    quality_s = next(s["seconds"] for s in report["steps"] if s["name"] == "quality")
    return [shape, f"{report['voxels']:,}", str(report["resolution"]), str(report["texture_size"]), branch, *[f"{q[c]:,}" if isinstance(q[c], int) else f"{q[c]:.3f}"
                                                     for c in COLUMNS],
            f"{report['seconds'] - quality_s:.1f}", f"{report['cpu_seconds']:.1f}", f"{remesh_s:.1f}",
            f"{report['peak_rss'] / 2**30:.2f}"]


HEADER = ["shape", "voxels", "R", "texture", "branch", "faces", "boundary edges", "non-manifold edges", "components",
          "UV charts", "Hausdorff (vox)", "Chamfer (vox)", "export s", "CPU s", "of which remesh s", "peak RSS GiB"]


def table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--target", type=int, default=200_000)
    parser.add_argument("--texture-size", type=int, default=2048)
    parser.add_argument("--shapes", nargs="*", default=["holes", "thin_walls", "handle", "slits", "components"])
    parser.add_argument("--branches", nargs="+", default=list(BRANCHES), choices=list(BRANCHES))
    parser.add_argument("--big-voxels", type=int, default=0)
    parser.add_argument("--big-branches", nargs="+", default=["remesh"], choices=list(BRANCHES))
    parser.add_argument("--big-target", type=int, default=1_000_000)
    parser.add_argument("--big-texture-size", type=int, default=4096)
    parser.add_argument("--big-resolution", type=int, default=1024, help="grid of the big shape (1536: the "
                        "1536 cascade's decode; rows are then named big<voxels>r1536)")
    parser.add_argument("--out", default="benchmarks/export_quality.md")
    parser.add_argument("--one", nargs=2, metavar=("SHAPE", "BRANCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        args.shape, args.branch = args.one
        run_one(args)
        return
    out = Path(args.out)
    store = out.with_suffix(".json")
    saved = json.loads(store.read_text()) if store.exists() else {"commands": [], "reports": {}}
    saved["commands"].append("python scripts/bench_export_quality.py " + " ".join(sys.argv[1:]))
    runs = [(s, b) for s in args.shapes for b in args.branches]
    big = f"big{args.big_voxels}" + (f"r{args.big_resolution}" if args.big_resolution != 1024 else "")
    runs += [(big, b) for b in args.big_branches] if args.big_voxels else []
    for shape, branch in runs:
        report = run_child(shape, branch, args)
        saved["reports"][f"{shape}/{branch}"] = report
        print(table([row(shape, branch, report)]), flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        store.write_text(json.dumps(saved, indent=1))
        out.write_text(markdown(saved))
    print(markdown(saved))


def markdown(saved: dict) -> str:
    rows = [row(*key.split("/"), report) for key, report in saved["reports"].items()]
    commands = "\n".join(f"    {c}" for c in saved["commands"])
    return ("# Export quality per branch: no remesh / remesh / remesh exterior-only\n\n"
            f"Commands (rows from later runs replace earlier ones):\n\n{commands}\n\n"
            "Distances in decode voxels (two-sided, 100k samples per surface); export seconds (wall) exclude the "
            "quality step; CPU seconds (all threads, quality step included) are less sensitive to other load on "
            "the machine; peak RSS is the largest per-step kernel high-water mark.\n\n" + table(rows) + "\n")


if __name__ == "__main__":
    main()
