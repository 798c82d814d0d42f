"""The export side by side: this checkout against another one (e.g. main at an earlier commit), alternating.

    python scripts/bench_export_ab.py --baseline /path/to/main-checkout --voxels 1000000 --target 330000 \\
        --texture-size 2048 --pairs 2 --out benchmarks/export_speed.md

Each run is a fresh process over the same cached synthetic fields (scripts/bench_export.py's blobby shape, the
fields made once and kept in ``--cache``), release settings (remesh at the decode resolution), exact per-step
peak RSS; runs alternate baseline, this, baseline, this, ... so that the load of a shared machine falls on both.
This checkout runs without the shading maps (the same work as the baseline) and, with ``--maps``, once more
with them. Prints every run's per-step table; writes the markdown table (per step: each side's median seconds and
the ratio) and the raw reports as JSON beside it, with the command.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
CHILD = """
import argparse, dataclasses, json, sys, time
sys.path.insert(0, {tree!r}); sys.path.insert(0, {tree!r} + "/scripts")
from bench_export import load_or_make, _color
from pixal3d.mesh.export import ExportSettings, export_mesh
from pixal3d.mesh.synthetic import pbr_from_function
fields = load_or_make(argparse.Namespace(voxels={voxels}, resolution=1024, seed=0, cache={cache!r}))
pbr = pbr_from_function(fields, _color)
known = {{f.name for f in dataclasses.fields(ExportSettings)}}
extra = {{k: v for k, v in {{"normal_map": {maps}, "occlusion_map": {maps}}}.items() if k in known}}
settings = ExportSettings(decimation_target={target}, texture_size={texture}, remesh=True, **extra)
cpu = time.process_time()
report = export_mesh(fields, pbr, settings=settings, progress=False, exact_peak_rss=True).report
print(report.table(), file=sys.stderr)
print(json.dumps(report.to_dict() | {{"cpu_seconds": time.process_time() - cpu}}))
"""


def run(tree: str, args, maps: bool) -> dict:
    code = CHILD.format(tree=tree, voxels=args.voxels, cache=args.cache, target=args.target,
                        texture=args.texture_size, maps=maps)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                          env={"PYTHONPATH": tree, "PATH": "/usr/bin:/bin"})
    if done.returncode != 0:
        raise RuntimeError(f"{tree} failed:\n{done.stderr[-3000:]}")
    print(done.stderr.strip(), flush=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(runs: dict[str, list[dict]]) -> str:
    steps = [s["name"] for s in runs["this"][0]["steps"]]
    names = list(runs)
    head = ["step", *(f"{n} s (median)" for n in names), "baseline / this"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def seconds(name: str, step: str) -> float:
        values = [next((s["seconds"] for s in r["steps"] if s["name"] == step), 0.0) for r in runs[name]]
        return statistics.median(values)

    for step in [*steps, "total"]:
        cells = []
        for n in names:
            cells.append(statistics.median(r["seconds"] for r in runs[n]) if step == "total" else seconds(n, step))
        ratio = cells[0] / cells[1] if cells[1] > 0 else float("nan")
        rows.append("| " + " | ".join([step, *(f"{c:.1f}" for c in cells), f"{ratio:.2f}"]) + " |")
    quality = ["| side | faces | boundary edges | non-manifold | Hausdorff vox | Chamfer vox | coverage | peak GiB |",
               "|---|---|---|---|---|---|---|---|"]
    for n in names:
        r = runs[n][-1]
        q = r["quality"]
        quality.append(f"| {n} | {q['faces']:,} | {q['boundary_edges']} | {q['non_manifold_edges']} | "
                       f"{q['hausdorff_vox']:.3f} | {q['chamfer_vox']:.3f} | {r['coverage']:.3f} | "
                       f"{r['peak_rss'] / 2**30:.2f} |")
    return "\n".join(rows) + "\n\nQuality of each side's last run:\n\n" + "\n".join(quality)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="another checkout of this repository")
    parser.add_argument("--voxels", type=int, default=1_000_000)
    parser.add_argument("--target", type=int, default=330_000)
    parser.add_argument("--texture-size", type=int, default=2048)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--maps", action="store_true", help="also run this checkout with its shading maps")
    parser.add_argument("--cache", default="/tmp/bench_export_ab_fields.npz")
    parser.add_argument("--out", default="benchmarks/export_speed.md")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"baseline": [], "this": []}
    for _ in range(args.pairs):
        runs["baseline"].append(run(args.baseline, args, maps=False))
        runs["this"].append(run(str(HERE), args, maps=False))
        if args.maps:
            runs.setdefault("this + maps", []).append(run(str(HERE), args, maps=True))
    command = "python scripts/bench_export_ab.py " + " ".join(sys.argv[1:])
    text = (f"# Export side by side: baseline checkout vs this one\n\n    {command}\n\n"
            f"{args.voxels:,} voxels at 1024³ → {args.target:,} faces, {args.texture_size}², remesh (release "
            f"setting); runs alternate; medians over {args.pairs} runs each.\n\n{table(runs)}\n")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "runs": runs}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
