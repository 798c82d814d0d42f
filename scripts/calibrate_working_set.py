"""Measure each stage's working set at real model widths on this machine (CPU), to calibrate
the stages' working-set estimates (``pipelines/working_set.py``).

Working set = peak resident memory during the stage's heavy computation minus what the process held
just before it (weights and inputs already resident). Every measurement runs in a fresh subprocess:
it builds the model(s) with random weights and the inputs, collects garbage and trims malloc, resets
the peak (``/proc/self/clear_refs`` "5"), runs the computation under ``torch.no_grad`` and reads
``VmHWM``. Measurements:

- ``flow``: the sparse flow transformer (width 1536, 12 heads, MLP 8192, proj 2048, bf16) with 1 or
  2 blocks at N tokens (activations are freed block by block, so 2 blocks ≈ 1 block shows the depth
  does not matter and 30 blocks cost what 2 do);
- ``ss``: the dense sparse-structure flow (same width, 16³ = 4096 tokens);
- ``dinov3``: the ViT-L/16 backbone (random weights from ``write_random_checkpoints.py``) at S px;
- ``naf``: one extractor's ``condition()`` (frugal NAF + projection) at N voxels, backbone tokens cached;
- ``shape_decoder`` / ``tex_decoder``: the decoders at their manifest config on N latent tokens
  (64³ shell), with per-level peaks. CPU fp16 GEMMs are ~400× slower than bf16 here, so the fp16
  torso runs in bf16 (same element size, same tensors).

    python scripts/calibrate_working_set.py --out benchmarks/working_set.json     # ~15 min on 2 cores
    python scripts/calibrate_working_set.py --quick                                # plumbing check

Prints one line per measurement and the fitted bytes per token / voxel.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from pixal3d.telemetry import linux

logger = logging.getLogger("calibrate_working_set")
REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "assets" / "checkpoints.json"  # the published configs (decoder args)
CACHE = Path.home() / ".cache" / "pixal3d" / "bench"
MIB = 2**20

# (kind, params): the full calibration run.
FULL_PLAN: list[tuple[str, dict[str, Any]]] = [
    ("flow", {"tokens": 1000, "blocks": 1}),
    ("flow", {"tokens": 1000, "blocks": 2}),
    ("flow", {"tokens": 3000, "blocks": 2}),
    ("flow", {"tokens": 6000, "blocks": 2}),
    ("flow", {"tokens": 12000, "blocks": 2}),
    ("flow", {"tokens": 20000, "blocks": 2}),
    ("ss", {"blocks": 2}),
    ("dinov3", {"size": 512}),
    ("dinov3", {"size": 1024}),
    ("naf", {"extractor": "shape_512", "tokens": 4000}),
    ("naf", {"extractor": "tex_1024", "tokens": 20000}),
    ("shape_decoder", {"tokens": 1024}),
    ("shape_decoder", {"tokens": 256}),
    ("shape_decoder", {"tokens": 4096}),
    ("tex_decoder", {"tokens": 1024}),
    ("tex_decoder", {"tokens": 256}),
    ("tex_decoder", {"tokens": 4096}),
]
QUICK_PLAN: list[tuple[str, dict[str, Any]]] = [
    ("flow", {"tokens": 64, "blocks": 1, "width": 256}),
    ("flow", {"tokens": 128, "blocks": 1, "width": 256}),
]


# -- inside the child --------------------------------------------------------------------------

def _rss() -> int:
    return linux.process_memory()[0] or 0


def _hwm() -> int:
    return linux.process_memory()[1] or 0


def _settle() -> int:
    """Free garbage, hand freed heap back to the OS, reset the peak; returns the resident bytes."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    if not linux.reset_peak():
        raise SystemExit("cannot reset VmHWM through /proc/self/clear_refs on this machine")
    return _rss()


def shell_coords(resolution: int, tokens: int) -> torch.Tensor:
    """``[N, 4]`` int32 (b=0, x, y, z): the ``tokens`` voxels nearest a sphere of radius 0.4·resolution."""
    axis = torch.arange(resolution, dtype=torch.float32)
    grid = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), dim=-1).reshape(-1, 3)
    off = ((grid - (resolution - 1) / 2).norm(dim=1) - 0.4 * resolution).abs()
    keep = torch.sort(torch.argsort(off, stable=True)[:min(tokens, len(grid))]).values
    return torch.cat([torch.zeros(len(keep), 1, dtype=torch.int32), grid[keep].int()], dim=1)


def _flow_args(width: int, blocks: int) -> dict[str, Any]:
    heads = 12 if width == 1536 else max(2, width // 128)
    return {"in_channels": 32, "out_channels": 32, "model_channels": width, "cond_channels": 1024,
            "num_blocks": blocks, "num_heads": heads, "mlp_ratio": 5.3334, "pe_mode": "rope", "share_mod": True,
            "qk_rms_norm": True, "qk_rms_norm_cross": True, "image_attn_mode": "proj", "dtype": "bfloat16"}


def setup_flow(tokens: int, blocks: int, width: int = 1536) -> Callable[[], dict]:
    from pixal3d.models.slat_flow import SLatFlowModel
    from pixal3d.nn.sparse_tensor import SparseTensor

    torch.manual_seed(0)
    model = SLatFlowModel(resolution=64, proj_in_channels=2048, **_flow_args(width, blocks)).eval()
    coords = shell_coords(64, tokens)
    x = SparseTensor(torch.randn(len(coords), 32), coords)
    cond = {"global": torch.randn(1, 5, 1024), "proj": x.replace(torch.randn(len(coords), 2048))}
    t = torch.tensor([500.0])
    model.rope_phases(x)  # cached on the coords like the sampler's first step

    def run() -> dict:
        out = model(x, t, cond)
        return {"tokens": len(coords), "out_rows": int(out.feats.shape[0])}
    return run


def setup_ss(blocks: int) -> Callable[[], dict]:
    from pixal3d.models.sparse_structure_flow import SparseStructureFlowModel

    torch.manual_seed(0)
    args = _flow_args(1536, blocks) | {"in_channels": 8, "out_channels": 8}
    model = SparseStructureFlowModel(resolution=16, **args).eval()
    x = torch.randn(1, 8, 16, 16, 16)
    cond = {"global": torch.randn(1, 5, 1024), "proj": torch.randn(1, 4096, 1024)}
    t = torch.tensor([500.0])

    def run() -> dict:
        model(x, t, cond)
        return {"tokens": 4096}
    return run


def _image():
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    pixels = (torch.rand(1024, 1024, 3, generator=gen) * 255).to(torch.uint8).numpy()
    return Image.fromarray(pixels, "RGB")


def setup_dinov3(size: int) -> Callable[[], dict]:
    from pixal3d.models.conditioning import backbone_features
    from pixal3d.models.dinov3 import load_dinov3

    backbone = load_dinov3(CACHE / "dinov3-vitl16")
    image = _image()
    backbone_features(backbone, image, 64)  # fault the (memory-mapped) weights in: they are not working set

    def run() -> dict:
        feats = backbone_features(backbone, image, size)
        return {"tokens": int(feats.tokens.shape[1])}
    return run


def setup_naf(extractor: str, tokens: int) -> Callable[[], dict]:
    from pixal3d.models.camera import FALLBACK_FOV, camera_from_fov
    from pixal3d.models.conditioning import EXTRACTORS, backbone_features, condition
    from pixal3d.models.dinov3 import load_dinov3
    from pixal3d.models.naf import load_naf

    ex = EXTRACTORS[extractor]
    backbone = load_dinov3(CACHE / "dinov3-vitl16")
    naf = load_naf(CACHE / "naf" / "naf_release.safetensors").eval()
    image = _image()
    features = backbone_features(backbone, image, ex.image_size)  # the features stage's forward: `dinov3`
    coords = shell_coords(ex.grid_resolution, tokens)
    camera = camera_from_fov(FALLBACK_FOV)

    def run() -> dict:
        cond = condition(ex, features, camera, coords, naf=naf)
        return {"tokens": len(coords), "proj_channels": int(cond["proj"].feats.shape[1])}
    return run


def _decoder(name: str):
    """The manifest's decoder ``name`` with random weights, its fp16 torso switched to bf16 (see module doc)."""
    from torch import nn

    from pixal3d.models import sparse_unet_vae
    from pixal3d.nn.sparse_conv import SparseConv3d

    spec = json.loads(MANIFEST.read_text())["models"][name]
    torch.manual_seed(0)
    model = getattr(sparse_unet_vae, spec["class"])(**{k: v for k, v in spec["args"].items()
                                                       if k not in ("use_checkpoint",)}).eval()
    for module in model.modules():
        if isinstance(module, (SparseConv3d, nn.Linear)) and module.weight.dtype == torch.float16:
            module.to(torch.bfloat16)
    model.dtype = torch.bfloat16
    return model


def _level_probe(model, levels: list[dict], base: int) -> None:
    """Wrap ``model._stage`` so each decoder level records its voxels and its peak above ``base``."""
    stage = model._stage

    def probed(i, h, subdiv=None):
        linux.reset_peak()
        out = stage(i, h, subdiv)
        levels.append({"level": i, "voxels_in": int(h.feats.shape[0]), "voxels_out": int(out[0].feats.shape[0]),
                       "channels_in": int(h.feats.shape[1]), "peak_above_start": _hwm() - base})
        linux.reset_peak()
        return out
    model._stage = probed


def setup_decoder(which: str, tokens: int) -> Callable[[], dict]:
    from pixal3d.nn.sparse_tensor import SparseTensor

    coords = shell_coords(64, tokens)
    latent = SparseTensor(torch.randn(len(coords), 32), coords)
    shape = _decoder("shape_slat_decoder")
    shape.set_resolution(1024)
    model, subs = shape, None
    if which == "tex":
        with torch.no_grad():
            _, subs = shape.decode_fields(latent)
        del shape
        model = _decoder("tex_slat_decoder")
    levels: list[dict] = []

    def run() -> dict:
        base = _rss()
        _level_probe(model, levels, base)
        if which == "shape":
            fields, _ = model.decode_fields(latent)
            voxels = int(fields.coords.shape[0])
        else:
            voxels = int(model.decode_pbr(latent, subs, 1024).coords.shape[0])
        return {"tokens": len(coords), "decoded_voxels": voxels, "levels": levels,
                "level_peak_max": max(lv["peak_above_start"] for lv in levels), "tail_peak": _hwm() - base}
    return run


SETUPS: dict[str, Callable[..., Callable[[], dict]]] = {
    "flow": setup_flow, "ss": setup_ss, "dinov3": setup_dinov3, "naf": setup_naf,
    "shape_decoder": lambda tokens: setup_decoder("shape", tokens),
    "tex_decoder": lambda tokens: setup_decoder("tex", tokens),
}


def child(kind: str, params: dict[str, Any]) -> dict[str, Any]:
    """Build, settle, run once; the working set is the peak above the settled resident bytes."""
    torch.set_grad_enabled(False)
    run = SETUPS[kind](**params)
    base = _settle()
    start = time.perf_counter()
    extra = run()
    seconds = time.perf_counter() - start
    peak = max(_hwm() - base, extra.pop("level_peak_max", 0), extra.pop("tail_peak", 0))
    return {"kind": kind, "params": params, "resident_before": base, "working_set": peak,
            "seconds": round(seconds, 2), **extra}


# -- in the parent -----------------------------------------------------------------------------

def measure(kind: str, params: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter and return its result dict."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps([kind, params])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} {params} failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of ``y = slope·x + intercept``."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return slope, my - slope * mx


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Fits: flow bytes/token (2-block runs past the attention chunking), decoders bytes/decoded voxel."""
    fits: dict[str, Any] = {}
    flow = [(r["tokens"], r["working_set"]) for r in results
            if r["kind"] == "flow" and r["params"].get("blocks") == 2 and r["tokens"] >= 6000]
    if len(flow) >= 2:
        fits["flow"] = dict(zip(("bytes_per_token", "intercept"), fit_line(flow)))
    for kind in ("shape_decoder", "tex_decoder"):
        rows = [(r["decoded_voxels"], r["working_set"]) for r in results if r["kind"] == kind]
        if len(rows) >= 2:
            fits[kind] = dict(zip(("bytes_per_voxel", "intercept"), fit_line(rows)))
        if rows:
            fits.setdefault(kind, {})["ratio_at_largest"] = max(rows)[1] / max(rows)[0]
    return fits


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="two tiny measurements (plumbing check)")
    parser.add_argument("--only", nargs="*", help="kinds to run (default: all)")
    parser.add_argument("--out", type=Path, help="write the results and fits as JSON here")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per measurement")
    args = parser.parse_args(argv)
    if args.child:
        kind, params = json.loads(args.child)
        print(json.dumps(child(kind, params)))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    plan = QUICK_PLAN if args.quick else [m for m in FULL_PLAN if not args.only or m[0] in args.only]
    results = []
    for kind, params in plan:
        result = measure(kind, params, args.timeout)
        results.append(result)
        per = result.get("decoded_voxels") or result.get("tokens") or 1
        logger.info("%-14s %-40s working set %8.1f MiB (%7.0f B per %s) resident before %6.0f MiB, %.1f s",
                    kind, json.dumps(params), result["working_set"] / MIB, result["working_set"] / per,
                    "voxel" if "decoded_voxels" in result else "token", result["resident_before"] / MIB,
                    result["seconds"])
        for level in result.get("levels", []):
            logger.info("    level %d: %8d -> %8d voxels (%4d ch in), peak %8.1f MiB", level["level"],
                        level["voxels_in"], level["voxels_out"], level["channels_in"],
                        level["peak_above_start"] / MIB)
    fits = summarise(results)
    for name, fit in fits.items():
        logger.info("fit %s: %s", name, {k: round(v, 1) for k, v in fit.items()})
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "results": results, "fits": fits},
                                       indent=1) + "\n")
        logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
