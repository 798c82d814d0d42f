"""Memory and time per extra view of the multi-view cascade, at the released widths (CPU).

Only two parts of a run grow with the number of views V; the flows, the decoders and the export do not:

- ``features``: the features stage, DINOv3 ViT-L/16 on the V views as one batch at 512 and at 1024 px
  (``multiview.view_features``; upstream batches them, and batched and one-by-one forwards differ in the last bits);
- ``texture``: the heaviest condition, the texture stage's extractor (1024 px, the 64³ grid, NAF to 1024², the
  ``full`` mode, the reference's values) on 20,000 HR tokens (a shell, as an object's surface), every view
  projected and added to the sum (``multiview.condition_views``): one view's NAF at a time. Its input features are
  the views' pixels and random tokens of DINOv3's shapes (the features part measures the backbone; NAF's and the
  projection's cost do not depend on the tokens' values).

Each (part, V) runs in a fresh process with DINOv3 and NAF at their released sizes (random weights:
``python scripts/write_random_checkpoints.py --only dinov3 naf``), every page of the weights touched; the peak is
VmHWM above the resident memory before the part, the seconds are wall time. The views are the example folder's
(assets/views_example), repeated up to V. "Per extra view" is the slope between V = 1 and the largest V.

    python scripts/bench_views.py --views 1 2 4 --out benchmarks/views.json
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from scripts.bench_memory import prefault
from scripts.calibrate_working_set import _hwm, _settle, shell_coords

logger = logging.getLogger("bench_views")
REPO = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = Path(os.environ.get("PIXAL3D_BENCH_CACHE", Path.home() / ".cache" / "pixal3d" / "bench"))
EXAMPLE = REPO / "assets" / "views_example"
HR_TOKENS = 20_000
GIB = 2**30
PARTS = ("features", "texture")


def posed_views(count: int):
    """The example folder's views and cameras, repeated up to ``count``."""
    from pixal3d.models.multiview import PosedViews
    from pixal3d.models.views import load_view, read_views

    views = read_views(EXAMPLE)
    frames = [views.frames[i % views.count] for i in range(count)]
    return PosedViews(tuple(load_view(f) for f in frames), torch.tensor([f.transform for f in frames]),
                      torch.tensor([f.fov for f in frames]), views.mesh_scale, tuple(f"v{i}" for i in range(count)))


def child(part: str, count: int, cache: Path) -> dict[str, Any]:
    """Load DINOv3 (and NAF), settle, run ``part`` on ``count`` views once; its peak above the settled memory."""
    from pixal3d.models.conditioning import BackboneFeatures, ExtractorConfig
    from pixal3d.models.dinov3 import load_dinov3
    from pixal3d.models.multiview import condition_views, view_features, view_pixels
    from pixal3d.models.naf import load_naf

    torch.set_grad_enabled(False)
    views = posed_views(count)
    if part == "features":
        backbone = load_dinov3(cache / "dinov3-vitl16")
        weights = prefault(backbone)
        before = _settle()
        start = time.perf_counter()
        features = view_features(backbone, views, (512, 1024))
        seconds = time.perf_counter() - start
        return {"part": part, "views": count, "weights": weights, "peak": _hwm() - before,
                "seconds": round(seconds, 1), "kept": sum(f.tokens.nbytes + f.image.nbytes
                                                          for f in features.by_size.values())}
    pixels = torch.stack([view_pixels(image, 1024) for image in views.images])  # [V, 3, 1024, 1024]
    tokens = torch.randn(count, 5 + 64 * 64, 1024, generator=torch.Generator().manual_seed(0))
    features = BackboneFeatures(tokens=tokens, image=pixels, num_global=5)
    naf = load_naf(cache / "naf" / "naf_release.safetensors")
    weights = prefault(naf)
    coords = shell_coords(64, HR_TOKENS)
    extractor = ExtractorConfig("tex_1024", 1024, 64, 1024)
    before = _settle()
    start = time.perf_counter()
    cond = condition_views(extractor, features, views, coords, naf=naf, naf_mode="full")
    seconds = time.perf_counter() - start
    return {"part": part, "views": count, "weights": weights, "peak": _hwm() - before, "seconds": round(seconds, 1),
            "tokens": int(cond["proj"].feats.shape[0]), "channels": int(cond["proj"].feats.shape[1])}


def measure(part: str, count: int, cache: Path, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps([part, count, str(cache)])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{part} with {count} views failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| part | views | peak above before (GiB) | seconds |", "|---|---|---|---|"]
    rows += [f"| {r['part']} | {r['views']} | {r['peak'] / GIB:.2f} | {r['seconds']} |" for r in results]
    for part in PARTS:
        mine = sorted((r for r in results if r["part"] == part), key=lambda r: r["views"])
        if len(mine) > 1:
            first, last = mine[0], mine[-1]
            steps = last["views"] - first["views"]
            rows.append(f"| {part}: per extra view | | {(last['peak'] - first['peak']) / steps / GIB:.2f} | "
                        f"{(last['seconds'] - first['seconds']) / steps:.1f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--views", type=int, nargs="+", default=[1, 2, 4], help="view counts (default 1 2 4)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="the real-size random checkpoints")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of each measuring process")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.child:
        part, count, cache = json.loads(args.child)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
        print(json.dumps(child(part, count, Path(cache))))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    results = []
    for part in args.parts:
        for count in args.views:
            result = measure(part, count, args.cache.expanduser(), args.timeout)
            logger.info("%s, %d views: %s", part, count, json.dumps(result))
            results.append(result)
    print(table(results))
    if args.out is not None:
        args.out.write_text(json.dumps({"command": "python scripts/bench_views.py " + " ".join(argv or sys.argv[1:]),
                                        "threads": args.threads, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
