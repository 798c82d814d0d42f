"""Side by side on one CPU: this project's remesh + simplify against ComfyUI's pure-PyTorch/SciPy narrow-band
dual-contouring remesh + QEM decimation, on the same decoded surface.

    python scripts/bench_export_comfy.py --voxels 1000000 --target 330000 --cache /work/cache/fields_1M.npz \
        [--comfy /work/refs/comfy] [--pairs 1] [--timeout 3600] [--out benchmarks/export_comfy.md]

The shape is ``scripts/bench_export.py``'s synthetic one (``load_or_make``: ``--voxels``, ``--resolution``,
``--seed``, ``--cache``). The decoded surface is built once, as the export builds it (``_extract``, then
``_reference`` with the default ``ExportSettings``), and both sides start from it:

- ours: ``remesh_slabs.remesh_presimplified(resolution=R, band=1, target=T)`` then
  ``simplify.simplify_mesh(T, voxel_size=1/R)`` (the export's remesh and simplify steps at the release setting);
- ComfyUI: ``remesh_narrow_band_dc`` at TRELLIS.2 ``to_glb``'s CuMesh call (resolution R, band 1, project_back 0,
  centre 0, scale (R + 3·band)/R), its other arguments at their defaults (qef, sign_mode "udf", the three
  component filters), then ``qem_simplify(T)`` with the default ``QEMConfig``. float32 vertices, int64 faces.

Each side runs in a fresh child process (``--child``), the sides alternating, ``--pairs`` times. Per step: wall
seconds and the child's own peak RSS (``VmHWM``, reset before the step through ``/proc/self/clear_refs``); per run:
the largest peak of any process the child forked and waited for (``RUSAGE_CHILDREN.ru_maxrss``: our remesh's slab
workers) and the whole process tree's summed RSS sampled by the parent at 10 Hz (an upper bound: pages a fork
shares copy-on-write count once per process). Quality is our own metric code on both outputs against the same
decoded surface: ``mesh_quality(..., SurfaceDistance(reference), R, samples)`` (Hausdorff and Chamfer in decode
voxels, boundary and non-manifold edges, components). Writes a markdown table to ``--out`` and the raw numbers
beside it as JSON.

ComfyUI's code is not part of this repository and is never copied into it. ``--comfy DIR`` must hold
``comfy_extras/mesh3d/postprocess/remesh.py`` (ComfyUI commit 22e5e90f542722d0379f80434dffc88abdcd8322) and
``comfy_extras/mesh3d/postprocess/qem_decimate.py`` (commit f1479a8541a1d967d9004e98d2ac5221f33693f3), with empty
``__init__.py`` files in ``comfy_extras/``, ``comfy_extras/mesh3d/`` and ``comfy_extras/mesh3d/postprocess/``: e.g.

    git clone https://github.com/Comfy-Org/ComfyUI && mkdir -p DIR/comfy_extras/mesh3d/postprocess
    git -C ComfyUI show 22e5e90f5427:comfy_extras/mesh3d/postprocess/remesh.py > DIR/comfy_extras/mesh3d/postprocess/remesh.py
    git -C ComfyUI show f1479a8541a1:comfy_extras/mesh3d/postprocess/qem_decimate.py > DIR/comfy_extras/mesh3d/postprocess/qem_decimate.py
    touch DIR/comfy_extras/__init__.py DIR/comfy_extras/mesh3d/__init__.py DIR/comfy_extras/mesh3d/postprocess/__init__.py

The two files import three ComfyUI modules. Where ``DIR/comfy/`` does not exist, this script writes minimal
stand-ins (``STANDINS`` below) into a temporary directory: ``comfy.quant_ops`` without comfy-kitchen's ``ck`` (so
``_kitchen_op`` answers None and the pure PyTorch/SciPy paths run), a no-op ``comfy.utils.ProgressBar``, and
``comfy.model_management`` with the CPU device and a no-op interrupt check. Their algorithms run untouched.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

GIB = 2**30
SIDES = ("ours", "comfy")
STEPS = ("remesh", "simplify")
COMFY_FILES = ("comfy_extras/mesh3d/postprocess/remesh.py", "comfy_extras/mesh3d/postprocess/qem_decimate.py")
COMFY_COMMITS = {
    "comfy_extras/mesh3d/postprocess/remesh.py": "22e5e90f542722d0379f80434dffc88abdcd8322",
    "comfy_extras/mesh3d/postprocess/qem_decimate.py": "f1479a8541a1d967d9004e98d2ac5221f33693f3",
}
STANDINS = {
    "comfy/__init__.py": '"""Stand-in for ComfyUI\'s comfy package (bench_export_comfy.py)."""\n',
    "comfy/quant_ops.py": '"""Stand-in: no comfy-kitchen `ck`, so the pure PyTorch/SciPy paths run."""\n',
    "comfy/utils.py": (
        '"""Stand-in: a ProgressBar that does nothing."""\n\n\n'
        "class ProgressBar:\n"
        "    def __init__(self, total, node_id=None):\n"
        "        self.total, self.current = total, 0\n\n"
        "    def update_absolute(self, value, total=None, preview=None):\n"
        "        self.total = self.total if total is None else total\n"
        "        self.current = value\n\n"
        "    def update(self, value):\n"
        "        self.update_absolute(self.current + value)\n"
    ),
    "comfy/model_management.py": (
        '"""Stand-in: the CPU device, no interrupt."""\n'
        "import torch\n\n\n"
        "def get_torch_device():\n"
        '    return torch.device("cpu")\n\n\n'
        "def throw_exception_if_processing_interrupted():\n"
        "    return None\n"
    ),
}


# -- the child: one side, timed step by step ------------------------------------------------------------------

def _status() -> dict[str, int]:
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024
    return values


def comfy_path(comfy_dir: Path, scratch: Path) -> list[str]:
    """sys.path entries that import ComfyUI's two files from ``comfy_dir``, with the stand-ins where it has no comfy/."""
    missing = [name for name in COMFY_FILES if not (comfy_dir / name).is_file()]
    if missing:
        raise SystemExit(f"--comfy {comfy_dir}: missing {', '.join(missing)} (see this script's docstring)")
    if (comfy_dir / "comfy").is_dir():
        return [str(comfy_dir)]
    for name, text in STANDINS.items():
        (scratch / name).parent.mkdir(parents=True, exist_ok=True)
        (scratch / name).write_text(text)
    return [str(comfy_dir), str(scratch)]


def _steps_ours(v: np.ndarray, f: np.ndarray, target: int, resolution: int):
    from pixal3d.mesh.remesh_slabs import remesh_presimplified
    from pixal3d.mesh.simplify import simplify_mesh

    def remesh(v, f):
        (v, f), detail = remesh_presimplified(v, f, resolution=resolution, band=1.0, target=target)
        return v, f, detail

    def simplify(v, f):
        v, f = simplify_mesh(v, f, target, voxel_size=1.0 / resolution)
        return v, f, {}

    return {"remesh": remesh, "simplify": simplify}


def _steps_comfy(v: np.ndarray, f: np.ndarray, target: int, resolution: int, comfy_dir: Path, scratch: Path):
    sys.path[:0] = comfy_path(comfy_dir, scratch)
    import torch
    from comfy_extras.mesh3d.postprocess.qem_decimate import qem_simplify
    from comfy_extras.mesh3d.postprocess.remesh import remesh_narrow_band_dc

    band = 1.0

    def remesh(v, f):
        out_v, out_f, _ = remesh_narrow_band_dc(
            torch.from_numpy(np.ascontiguousarray(v, np.float32)), torch.from_numpy(f.astype(np.int64)),
            resolution=resolution, band=band, project_back=0.0,
            center=torch.zeros(3), scale=(resolution + 3 * band) / resolution)
        return out_v, out_f, {}

    def simplify(v, f):
        out_v, out_f, _ = qem_simplify(v, f, target)
        return out_v, out_f, {}

    return {"remesh": remesh, "simplify": simplify}


def run_child(args) -> None:
    """One side on the surface in ``args.surface``: the steps in order, each timed; the result mesh and a JSON
    report go to ``args.result`` / ``args.result + '.json'``; a progress line per step goes to stderr."""
    from pixal3d.telemetry import linux

    data = np.load(args.surface)
    v, f, resolution = data["vertices"], data["faces"], int(data["resolution"])
    with tempfile.TemporaryDirectory() as scratch:
        steps = (_steps_ours(v, f, args.target, resolution) if args.child == "ours"
                 else _steps_comfy(v, f, args.target, resolution, Path(args.comfy), Path(scratch)))
        report = {"side": args.child, "base_rss": _status()["VmRSS"], "steps": {}}
        for name in STEPS:
            linux.reset_peak()
            start = time.perf_counter()
            v, f, detail = steps[name](v, f)
            seconds = time.perf_counter() - start
            report["steps"][name] = {"seconds": seconds, "peak_rss": _status()["VmHWM"], "vertices": len(v),
                                     "faces": len(f)} | detail
            print(f"[{args.child}] {name}: {seconds:.1f} s, {len(f):,} faces", file=sys.stderr, flush=True)
    report["children_max_rss"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    v = np.asarray(v.numpy() if hasattr(v, "numpy") else v, np.float32)
    f = np.asarray(f.numpy() if hasattr(f, "numpy") else f, np.int64)
    np.savez(args.result, vertices=v, faces=f)
    Path(args.result + ".json").write_text(json.dumps(report))


# -- the parent: the surface, the runs, the quality, the report -----------------------------------------------

class TreePeak:
    """The largest summed RSS of a process and its descendants, sampled every ``interval`` seconds."""

    def __init__(self, pid: int, interval: float = 0.1):
        import psutil

        self._proc, self.interval, self.peak = psutil.Process(pid), interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            total = 0
            try:
                for proc in [self._proc, *self._proc.children(recursive=True)]:
                    try:
                        total += proc.memory_info().rss
                    except psutil.Error:
                        pass
            except psutil.Error:
                break
            self.peak = max(self.peak, total)
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_side(side: str, args, surface: Path, scratch: Path, index: int) -> dict:
    """``side`` in a fresh child; its report, plus wall time, exit status and the tail of its stderr."""
    result = scratch / f"{side}_{index}.npz"
    log = scratch / f"{side}_{index}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", side, "--surface", str(surface),
           "--result", str(result), "--target", str(args.target), "--comfy", str(args.comfy)]
    start = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, start_new_session=True)
        with TreePeak(proc.pid) as tree:
            try:
                code = proc.wait(timeout=args.timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                code, timed_out = proc.wait(), True
    out = {"side": side, "wall_seconds": time.perf_counter() - start, "returncode": code, "timed_out": timed_out,
           "tree_peak_rss": tree.peak, "log_tail": log.read_text(errors="replace")[-3000:]}
    report = Path(str(result) + ".json")
    if code == 0 and report.exists():
        out |= json.loads(report.read_text())
        out["result"] = str(result)
    return out


def quality(result: str, reference, resolution: int, samples: int) -> dict:
    from pixal3d.mesh.quality import mesh_quality

    data = np.load(result)
    v, f = data["vertices"], data["faces"]
    q = mesh_quality(v, f, f, len(v), reference, resolution, samples=samples).to_dict()
    q.pop("uv_charts")  # no atlas here: the faces stand in for UV faces
    return q


def _gib(x) -> str:
    return "–" if x is None else f"{x / GIB:.2f}"


def write_report(out: Path, command: str, meta: dict, runs: list[dict]) -> None:
    """The markdown table of ``runs`` (and notes) to ``out``, all numbers as JSON beside it."""
    rows = [
        ("| run | side | remesh s | simplify s | total s | remesh peak RSS GiB | simplify peak RSS GiB | "
         "forked max GiB | tree peak GiB | remesh faces | faces | Hausdorff vox | Chamfer vox | boundary edges | "
         "non-manifold edges | components |"),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    failures = []
    for run in runs:
        steps = run.get("steps", {})
        r, s = steps.get("remesh", {}), steps.get("simplify", {})
        q = run.get("quality", {})
        total = r.get("seconds", 0) + s.get("seconds", 0) if s else None

        def cell(d, key, fmt="{:.1f}"):
            return fmt.format(d[key]) if key in d else "–"

        rows.append(" | ".join([
            f"| {run.get('pair', 0) + 1}", run["side"], cell(r, "seconds"), cell(s, "seconds"),
            "–" if total is None else f"{total:.1f}", _gib(r.get("peak_rss")), _gib(s.get("peak_rss")),
            _gib(run.get("children_max_rss")), _gib(run.get("tree_peak_rss")), cell(r, "faces", "{:,}"),
            cell(s, "faces", "{:,}"), cell(q, "hausdorff_vox", "{:.3f}"), cell(q, "chamfer_vox", "{:.3f}"),
            cell(q, "boundary_edges", "{:,}"), cell(q, "non_manifold_edges", "{:,}"), cell(q, "components", "{:,}"),
        ]) + " |")
        if run.get("returncode") != 0 or run.get("timed_out"):
            why = "timed out" if run.get("timed_out") else f"exit status {run.get('returncode')}"
            failures.append(f"- run {run.get('pair', 0) + 1}, {run['side']}: {why} after {run['wall_seconds']:.0f} s; "
                            f"its output ended with:\n\n```\n{run.get('log_tail', '').strip()[-1500:]}\n```")
    lines = [
        "# Export geometry side by side: ours vs ComfyUI's pure-PyTorch remesh + QEM (CPU)",
        "",
        "```",
        command,
        "```",
        "",
        (f"Decoded surface: {meta['voxels']:,} voxels at R={meta['resolution']} → {meta['surface_vertices']:,} "
         f"vertices, {meta['surface_faces']:,} faces (`_extract` + `_reference`, {meta['surface_seconds']:.1f} s, not "
         f"timed below). Target {meta['target']:,} faces. Machine: {meta['machine']}. Quality: our `mesh_quality` "
         f"against the decoded surface, {meta['samples']:,} samples each way, distances in decode voxels."),
        "",
        *rows,
        "",
        ("Peak RSS per step: the child's `VmHWM` (reset before the step). Forked max: the largest peak of the "
         "processes the child forked (our remesh's slab workers), `RUSAGE_CHILDREN.ru_maxrss`. Tree peak: the child "
         "and its descendants' summed RSS sampled at 10 Hz (an upper bound: copy-on-write pages count once per "
         "process)."),
        "",
        "ComfyUI files (never part of this repository): "
        + ", ".join(f"`{name}` @ `{commit}`" for name, commit in COMFY_COMMITS.items())
        + "; called as: " + meta["comfy_call"],
    ]
    if failures:
        lines += ["", "## Runs that did not finish", "", *failures]
    for note in meta.get("notes", []):
        lines += ["", note]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    clean = [{k: v for k, v in run.items() if k != "result"} for run in runs]
    out.with_suffix(".json").write_text(json.dumps({"command": command, "meta": meta, "runs": clean}, indent=1))


COMFY_CALL = ("`remesh_narrow_band_dc(v, f, resolution=R, band=1.0, project_back=0.0, center=zeros(3), "
              "scale=(R + 3)/R)` (other arguments default: target_faces=0, qef=True, sign_mode=\"udf\", "
              "drop_small_components=0.01, drop_inverted_components=True, drop_enclosed_components=True), then "
              "`qem_simplify(v, f, T)` with the default `QEMConfig`")


NOTES = [
    ("Not the same output by design: ours keeps both sheets of the thickened shell (`ExportSettings.exterior_only` "
     "False, the release setting), ComfyUI's `drop_enclosed_components=True` default drops the inner one, so the "
     "same face target goes to one sheet there and to two here (the components column). Neither side runs the "
     "export's later cleanup (ours: `remove_face_pairs`)."),
    ("Remesh faces are not comparable either: our remesh step includes the simplifier's pre-pass, slab by slab, to "
     "about 3 × target where the contour is large (`remesh_presimplified`, as the export runs it), so it hands the "
     "simplify step fewer faces; ComfyUI's remesh hands over its whole contour."),
    ("Not compared: ComfyUI's UV unwrap and bake (`comfy_extras/mesh3d/uv_unwrap/*`) are not in the code index this "
     "benchmark was built from, so only the remesh and the decimation run side by side."),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--voxels", type=int, default=1_000_000)
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--target", type=int, default=330_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", default=None, help="npz of the generated fields (scripts/bench_export.py)")
    parser.add_argument("--comfy", default="/work/refs/comfy", help="directory holding ComfyUI's two files")
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per child before it is killed")
    parser.add_argument("--out", default="benchmarks/export_comfy.md")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--surface", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args)
        return

    import platform

    from pixal3d.mesh.distance import SurfaceDistance
    from pixal3d.mesh.export import ExportSettings, _extract, _reference
    from scripts.bench_export import load_or_make

    command = "python " + " ".join(shlex.quote(a) for a in ["scripts/bench_export_comfy.py", *sys.argv[1:]])
    with tempfile.TemporaryDirectory() as scratch:  # fail early when the files are missing
        comfy_path(Path(args.comfy), Path(scratch))
    fields = load_or_make(args)
    start = time.perf_counter()
    (v, f), _ = _extract(fields)
    (rv, rf, _), _ = _reference(v, f, ExportSettings())
    meta = {"voxels": len(fields.coords), "resolution": fields.resolution, "target": args.target,
            "surface_vertices": len(rv), "surface_faces": len(rf), "surface_seconds": time.perf_counter() - start,
            "samples": args.samples, "comfy_call": COMFY_CALL, "comfy_commits": COMFY_COMMITS,
            "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}",
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "notes": NOTES}
    try:
        import torch

        meta["machine"] += f", torch {torch.__version__} ({torch.get_num_threads()} threads)"
    except ImportError:
        pass
    del fields, v, f
    reference = SurfaceDistance(rv, rf)
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        surface = scratch / "surface.npz"
        np.savez(surface, vertices=rv, faces=rf, resolution=meta["resolution"])
        for pair in range(args.pairs):
            for side in SIDES if pair % 2 == 0 else SIDES[::-1]:
                print(f"pair {pair + 1}: {side} ...", flush=True)
                run = run_side(side, args, surface, scratch, pair) | {"pair": pair}
                if "result" in run:
                    run["quality"] = quality(run["result"], reference, meta["resolution"], args.samples)
                print(json.dumps({k: v for k, v in run.items() if k != "log_tail"}), flush=True)
                runs.append(run)
                write_report(Path(args.out), command, meta, runs)  # after each run: a killed benchmark keeps its numbers
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()
