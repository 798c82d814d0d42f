"""The camera stage at real width on the CPU: MoGe-2 ViT-L estimating the field of view of a preprocessed image.

The network is the released one (``assets/moge_checkpoint.json``: model_config and every tensor of
Ruicheng/moge-2-vitl) with deterministic random weights, written once as a real-size ``model.pt``
(float32, 1.30 GB) into the bench cache and loaded by the cascade's own loader (``load_moge``). Each case
runs in a fresh process: load, touch every weight page (resident as after a real load), collect garbage,
trim the heap, reset ``VmHWM``, then the camera stage itself (``CameraStage.run``: MoGe-2 ``infer`` with
the reference's defaults, 3600 tokens at resolution level 9, focal recovery, the fov) on a square RGB image
of the given side (the preprocessed crop is square: up to ``int(1.1 · 1024)`` = 1126 px). Reported: load
seconds, stage seconds, peak process memory, working set (= peak − resident bytes just before the stage).
``--precisions`` chooses the cases: ``float16`` (MoGe's float16 autocast, the reference's on its GPUs) and
``float32`` (``camera.moge_precision: auto`` on the CPU).

Random weights: the time and memory of a forward do not depend on the values (the least-squares focal fit
takes a few milliseconds either way).

    python scripts/bench_camera.py --out benchmarks/camera.json        # writes camera.md beside it
    python scripts/bench_camera.py --precisions float32 --out benchmarks/camera.json --append   # a further run
    python scripts/bench_camera.py --out benchmarks/camera.json --report-only   # the page from the JSON
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

logger = logging.getLogger("bench_camera")
REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "assets" / "moge_checkpoint.json"
DEFAULT_CACHE = Path(os.environ.get("PIXAL3D_BENCH_CACHE", Path.home() / ".cache" / "pixal3d" / "bench"))
GIB = 2**30


def random_checkpoint(cache: Path) -> Path:
    """``<cache>/moge-2-vitl/model.pt`` at the released config, deterministic uniform fan-in weights (written once)."""
    from pixal3d.files import atomic_path
    from pixal3d.models.moge import build_moge

    path = cache / "moge-2-vitl" / "model.pt"
    if path.is_file():
        return path
    config = json.loads(MANIFEST.read_text())["model_config"]
    model = build_moge(config, device="meta")
    state = {}
    for key, t in model.state_dict().items():
        rng = np.random.Generator(np.random.PCG64(zlib.crc32(key.encode())))
        fan_in = max(1, t.numel() // t.shape[0]) if t.dim() >= 2 else 0
        if fan_in:
            values = (rng.random(t.numel(), dtype=np.float32) * 2 - 1) * np.float32((3.0 / fan_in) ** 0.5)
        else:
            values = np.ones(t.numel(), np.float32) if key.endswith(("weight", "gamma", "image_std")) else \
                (rng.random(t.numel(), dtype=np.float32) * 2 - 1) * np.float32(0.02)
        state[key] = torch.from_numpy(values).reshape(t.shape)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save({"model_config": config, "model": state}, tmp)
    logger.info("wrote %s (%.2f GB)", path, path.stat().st_size / 1e9)
    return path


def measure(path: Path, side: int, fp16: bool) -> dict[str, Any]:
    """One case, in this process: load, touch, settle, run the camera stage; the figures."""
    import math

    from PIL import Image

    from pipelines.camera import CameraStage
    from pipelines.state import RunState
    from pixal3d.models.moge import load_moge
    from pixal3d.models.preprocess import load_image, preprocess_image
    from scripts.bench_memory import prefault
    from scripts.calibrate_working_set import _hwm, _rss, _settle

    start = time.perf_counter()
    model = load_moge(path)
    weights = prefault(model)
    load_seconds = time.perf_counter() - start
    image = preprocess_image(load_image(REPO / "assets" / "example.png")).resize((side, side), Image.LANCZOS)
    rss_before = _settle()
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    state = RunState(input_image=None, generator=torch.Generator(), device=torch.device("cpu"),
                     shape_normalization=None, tex_normalization=None)
    state.image = image
    CameraStage(None, use_moge=True, precision="float16" if fp16 else "float32").run(state, {"moge": model})
    camera = state.camera
    seconds = time.perf_counter() - start
    peak = _hwm()
    return {"side": side, "fp16": fp16, "weights": weights, "load_seconds": round(load_seconds, 1),
            "seconds": round(seconds, 1), "rss_before": rss_before, "peak": peak, "working_set": peak - rss_before,
            "rss_after": _rss(), "fov_deg": round(math.degrees(camera.fov), 4), "threads": torch.get_num_threads(),
            "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def _cpu() -> str:
    """The CPU's model name (Linux), else the platform's word for it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def report(results: list[dict[str, Any]], commands: list[str]) -> str:
    """The markdown page: each command numbered, its rows tagged with that number; ratios only within one run."""
    rows = "\n".join(
        f"| {r['run']} | {r['side']} | {'float16 autocast (reference)' if r['fp16'] else 'float32'} "
        f"| {r['weights'] / GIB:.2f} | {r['load_seconds']:.1f} | {r['seconds']:.1f} | {r['peak'] / GIB:.2f} "
        f"| {r['working_set'] / GIB:.2f} "
        f"| {' → '.join(f'{x:.1f}' for x in r['load_average']) if 'load_average' in r else 'not recorded'} |"
        for r in results)
    pairs = {(r["run"], r["side"], r["fp16"]): r for r in results}
    both = sorted({(run, side) for run, side, _ in pairs if (run, side, True) in pairs and (run, side, False) in pairs})
    ratios = [f"run {run}, {side} px: float16 autocast / float32 stage time "
              f"{pairs[(run, side, True)]['seconds'] / pairs[(run, side, False)]['seconds']:.1f}" for run, side in both]
    listed = "".join(f"{i}. `{c}`\n" for i, c in enumerate(commands, 1))
    return (
        "# Camera stage at real width (CPU): MoGe-2 ViT-L\n\n"
        f"{listed}\n{_cpu()}, torch {torch.__version__}, {results[0]['threads']} threads; machine load: the "
        "1-minute load average before → after the stage (other jobs share the cores, so times vary between "
        "runs: compare within one run). Released model_config "
        "(`assets/moge_checkpoint.json`), deterministic random float32 weights in a real-size `model.pt`, loaded "
        "by `load_moge`; each case in a fresh process, weights touched before the stage; 3600 tokens "
        "(resolution level 9: a 60×60 grid, 840 px into the ViT, 960 px out of the neck) for any square image. "
        "See `scripts/bench_camera.py` for what one measurement is.\n\n"
        "| run | image side | precision | weights GiB | load s | stage s | peak GiB | working set GiB | machine load |\n"
        "|---|---|---|---|---|---|---|---|---|\n" + rows + "\n\n" + "".join(f"- {r}\n" for r in ratios))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--sides", type=int, nargs="+", default=[518, 1126])
    parser.add_argument("--precisions", nargs="+", choices=["float16", "float32"], default=["float16", "float32"],
                        help="MoGe-2's precision per case (default both; float16 takes ~45 min per case here)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here (and the .md beside it)")
    parser.add_argument("--append", action="store_true",
                        help="keep the runs already in --out and add this one as the next run")
    parser.add_argument("--report-only", action="store_true", help="rewrite the .md beside --out from its JSON")
    parser.add_argument("--case", nargs=3, metavar=("PATH", "SIDE", "FP16"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.case:  # a child process: one measurement, printed as JSON
        print(json.dumps(measure(Path(args.case[0]), int(args.case[1]), args.case[2] == "1")))
        return 0
    if args.report_only:
        if args.out is None or not args.out.is_file():
            parser.error("--report-only needs --out naming an existing results file")
        data = json.loads(args.out.read_text())
        args.out.with_suffix(".md").write_text(report(data["results"], data["commands"]))
        return 0
    path = random_checkpoint(args.cache)
    results = []
    for side in args.sides:
        for fp16 in [p == "float16" for p in args.precisions]:
            out = subprocess.run([sys.executable, __file__, "--case", str(path), str(side), "1" if fp16 else "0"],
                                 check=True, capture_output=True, text=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
            logger.info("%s", results[-1])
    commands = ["python scripts/bench_camera.py " + " ".join(argv if argv is not None else sys.argv[1:]).strip()]
    if args.append and args.out is not None and args.out.is_file():
        before = json.loads(args.out.read_text())
        commands = before["commands"] + commands
        results = before["results"] + [{**r, "run": len(commands)} for r in results]
    else:
        results = [{**r, "run": 1} for r in results]
    results.sort(key=lambda r: (r["run"], r["side"], not r["fp16"]))
    page = report(results, commands)
    print(page)
    if args.out is not None:
        args.out.write_text(json.dumps({"commands": commands, "results": results}, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
