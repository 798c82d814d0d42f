"""Full-work peak process memory of every stage of the 1024 cascade at the reference's sizes (CPU).

Each stage runs in a fresh process, with its models loaded from the real-size random checkpoints of
``scripts/write_random_checkpoints.py`` (every page touched, so the weights are resident as after a
real load) and inputs at the reference's counts:

- structure: DINOv3 at 512 px, the SS flow on 16³ = 4096 dense tokens, one sampler step inside the
  guidance interval (both CFG branches + rescale), the SS decoder to 64³ logits and the coords;
- shape_512: DINOv3 512 px + NAF (T=512) + projection on 4000 LR tokens, one CFG step (2 forwards);
- upsample: the shape decoder's 4 predicted subdivisions of the 4000 LR tokens, quantised to HR tokens;
- shape_1024: DINOv3 at 1024 px + NAF (T=512) on 20000 HR tokens, one CFG step (2 forwards);
- texture: DINOv3 at 1024 px + NAF (T=1024) on 20000 HR tokens, one step (its guidance is 1: 1 forward);
- decode: both decoders on 20000 latent tokens → ~9M voxels at 1024³ (untiled, or tiled with ``--budget``);
- export: ``scripts/bench_export.py`` on as many voxels (1M faces, 4096² texture).

Cuts, all memory-neutral, printed with the results: flows keep all 30 blocks loaded but run the first
``--flow-blocks`` (a block frees its activations, so the working set does not depend on depth:
benchmarks/working_set.md measured 1 vs 2 blocks); decoders likewise run ``--decoder-blocks`` ConvNeXt
blocks per stage (every block of a stage has the same shapes); one sampler step per flow stage (steps
repeat the same forwards). fp16 decoder torsos run in bf16 (same bytes; CPU fp16 GEMMs are ~400× slower).

Structure of the decode: random weights would keep each child with probability ~1/2 (×3.9 per level, and
scattered); instead each shape-decoder C2S block keeps the children whose centres lie within a band
around the sphere the tokens sit on, the band sized so that every level grows ×4.6 (the reference's
20k → 9M): a thin closed surface at 1024³, as a real object gives.

    python scripts/bench_full_work.py --out benchmarks/full_work.json                    # all stages, untiled
    python scripts/bench_full_work.py --only decode --budget 8G --out /tmp/after.json   # bounded decode
    python scripts/bench_full_work.py --only decode_ratio                                # tiled vs untiled time
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

from pixal3d.telemetry import linux
from scripts.bench_memory import prefault
from scripts.calibrate_working_set import _hwm, _image, _rss, _settle, shell_coords

logger = logging.getLogger("bench_full_work")
REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "assets" / "checkpoints.json"
DEFAULT_CACHE = Path(os.environ.get("PIXAL3D_BENCH_CACHE", Path.home() / ".cache" / "pixal3d" / "bench"))
GIB = 2**30
GROWTH = 4.6  # voxels kept per voxel per level: the reference's ~20k tokens -> ~9M voxels over 4 levels
LR_TOKENS, HR_TOKENS = 4000, 20000  # ~0.12·32³ LR tokens; ~20k HR tokens at 64³ (reference §7.4)
STAGES = ("structure", "shape_512", "upsample", "shape_1024", "texture", "decode", "export")


# -- models ------------------------------------------------------------------------------------

def _manifest() -> dict[str, Any]:
    return json.loads(MANIFEST.read_text())["models"]


def load(name: str, cache: Path) -> nn.Module:
    from pixal3d.models.loading import load_model

    return load_model(cache / _manifest()[name]["file"]).eval().requires_grad_(False)


def cut_flow(model: nn.Module, blocks: int) -> nn.Module:
    """Run only the first ``blocks`` blocks; the others stay loaded (held on ``model._all_blocks``)."""
    model._all_blocks = model.blocks
    model.blocks = nn.ModuleList(list(model.blocks)[:blocks])
    return model


def half_to_bf16(model: nn.Module) -> nn.Module:
    """Switch an fp16 torso to bf16 (same element size; CPU fp16 GEMMs are ~400× slower)."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dtype == torch.float16:
                setattr(module, name, nn.Parameter(param.detach().to(torch.bfloat16), requires_grad=False))
    if getattr(model, "dtype", None) == torch.float16:
        model.dtype = torch.bfloat16
    return model


def cut_decoder(model: nn.Module, blocks: int | None) -> nn.Module:
    """Keep ``blocks`` ConvNeXt blocks per stage (the C2S block always); the others stay loaded."""
    if blocks is None:
        return model
    model._all_blocks = nn.ModuleList([nn.ModuleList(list(stage)) for stage in model.blocks])  # counted, held
    for i, stage in enumerate(model.blocks):
        convnext = list(stage[:-1]) if i < model.num_upsamplings else list(stage)
        tail = [stage[-1]] if i < model.num_upsamplings else []
        model.blocks[i] = nn.ModuleList(convnext[:blocks] + tail)
    return model


class ShellSubdivision(nn.Module):
    """Subdivision logits from coordinates: keep a child whose centre lies within ``half_width`` (child
    voxels) of the sphere of radius 0.4·``child_resolution`` around the grid centre."""

    def __init__(self, child_resolution: int, half_width: float, dtype: torch.dtype):
        super().__init__()
        self.child_resolution, self.half_width, self.dtype = child_resolution, half_width, dtype

    def distance(self, coords: torch.Tensor) -> torch.Tensor:
        """``[N, 8]`` distance of each child's centre to the sphere, in child voxels."""
        from pixal3d.nn.sparse_ops import child_offsets

        res = self.child_resolution
        centres = coords[:, None, 1:].float() * 2 + child_offsets(coords.device).float() + 0.5  # [N, 8, 3]
        return ((centres - res / 2).norm(dim=-1) - 0.4 * res).abs()

    def forward(self, x):
        keep = self.distance(x.coords) <= self.half_width
        return x.replace(torch.where(keep, 1.0, -1.0).to(self.dtype))


def shell_decoder(model: nn.Module, coords: torch.Tensor, base_resolution: int, levels: int,
                  growth: float = GROWTH) -> list[int]:
    """Give the first ``levels`` C2S blocks of ``model`` a ``ShellSubdivision`` whose band makes each level
    ×``growth`` from ``coords``; returns the voxel count per level (level 0 = ``coords``)."""
    counts = [len(coords)]
    current = coords
    for level in range(levels):
        oracle = ShellSubdivision(base_resolution * 2 ** (level + 1), 0.0, model.dtype)
        dist = oracle.distance(current)
        target = min(dist.numel(), round(len(coords) * growth ** (level + 1)))
        oracle.half_width = float(dist.reshape(-1).kthvalue(target).values)
        model.blocks[level][-1].to_subdiv = oracle
        from pixal3d.nn.sparse_ops import subdivide

        current, _ = subdivide(current, dist <= oracle.half_width)
        counts.append(len(current))
        del dist
    return counts


# -- stages: each returns (run, info); run() does the stage's work once -------------------------

def _camera():
    from pixal3d.models.camera import FALLBACK_FOV, camera_from_fov

    return camera_from_fov(FALLBACK_FOV)


def _sampler(stage: str) -> dict[str, Any]:
    from pixal3d.config import load_config
    from pixal3d.pipeline_json import published_samplers, resolve_samplers

    # 1024_cascade reads its guidance intervals from pipeline.json: here, the published ones
    config = resolve_samplers(load_config(REPO / "configs" / "1024_cascade.yaml"), {"args": published_samplers()})
    params = dataclasses.asdict(getattr(config, stage).sampler)
    params.update(steps=1, guidance_interval=tuple(params["guidance_interval"]))
    return params


def _sample(flow, noise, cond, stage: str, **kwargs):
    from pixal3d.models.conditioning import negative_condition
    from pixal3d.samplers import sample_flow_euler

    return sample_flow_euler(flow, noise, cond=cond, neg_cond=negative_condition(cond), progress=False,
                             **_sampler(stage), **kwargs)


def setup_structure(cache: Path, flow_blocks: int, **_) -> tuple[Callable[[], dict], dict]:
    from pixal3d.models.conditioning import (
        ExtractorConfig,
        backbone_features,
        condition,
    )
    from pixal3d.models.dinov3 import load_dinov3

    backbone = load_dinov3(cache / "dinov3-vitl16")
    flow = cut_flow(load("sparse_structure_flow_model", cache), flow_blocks)
    decoder = half_to_bf16(load("sparse_structure_decoder", cache))
    weights = sum(prefault(m) for m in (backbone, flow, decoder))
    image, camera = _image(), _camera()

    def run() -> dict:
        cond = condition(ExtractorConfig("ss", 512, 16), backbone_features(backbone, image, 512), camera)
        noise = torch.randn(1, 8, 16, 16, 16)
        latent = _sample(flow, noise, cond, "structure")
        logits = decoder(latent)
        pooled = torch.nn.functional.max_pool3d(logits, 2, 2)
        return {"tokens": 4096, "logits": list(logits.shape), "coords": int((pooled > 0).sum())}
    return run, {"weights": weights}


def _flow_stage(cache: Path, flow_blocks: int, flow_name: str, extractor, tokens: int, grid: int, stage: str,
                concat: bool = False, naf_mode: str = "frugal") -> tuple[Callable[[], dict], dict]:
    from pixal3d.models.conditioning import backbone_features, condition
    from pixal3d.models.dinov3 import load_dinov3
    from pixal3d.models.naf import load_naf
    from pixal3d.nn.sparse_tensor import SparseTensor

    backbone = load_dinov3(cache / "dinov3-vitl16")
    naf = load_naf(cache / "naf" / "naf_release.safetensors")
    flow = cut_flow(load(flow_name, cache), flow_blocks)
    weights = sum(prefault(m) for m in (backbone, naf, flow))
    image, camera = _image(), _camera()
    coords = shell_coords(grid, tokens)
    shape_latent = SparseTensor(torch.randn(len(coords), 32), coords) if concat else None
    flow.rope_phases(SparseTensor(torch.zeros(len(coords), 1), coords))  # as the coords' cache would hold

    def run() -> dict:
        cond = condition(extractor, backbone_features(backbone, image, extractor.image_size), camera, coords,
                         naf=naf, naf_mode=naf_mode)
        noise = SparseTensor(torch.randn(len(coords), 32), coords)
        model = flow if shape_latent is None else (lambda x, t, c: flow(x, t, c, concat_cond=shape_latent))
        out = _sample(model, noise, cond, stage)
        return {"tokens": len(coords), "out": list(out.feats.shape), "naf_mode": naf_mode}
    return run, {"weights": weights}


def setup_shape_512(cache: Path, flow_blocks: int, naf_mode: str = "frugal", **_):
    from pixal3d.models.conditioning import ExtractorConfig

    return _flow_stage(cache, flow_blocks, "shape_slat_flow_model_512", ExtractorConfig("shape_512", 512, 32, 512),
                       LR_TOKENS, 32, "shape_512", naf_mode=naf_mode)


def setup_shape_1024(cache: Path, flow_blocks: int, naf_mode: str = "frugal", **_):
    from pixal3d.models.conditioning import ExtractorConfig

    return _flow_stage(cache, flow_blocks, "shape_slat_flow_model_1024",
                       ExtractorConfig("shape_1024", 1024, 64, 512), HR_TOKENS, 64, "shape_1024", naf_mode=naf_mode)


def setup_texture(cache: Path, flow_blocks: int, naf_mode: str = "frugal", **_):
    from pixal3d.models.conditioning import ExtractorConfig

    return _flow_stage(cache, flow_blocks, "tex_slat_flow_model_1024", ExtractorConfig("tex_1024", 1024, 64, 1024),
                       HR_TOKENS, 64, "texture", concat=True, naf_mode=naf_mode)


def setup_upsample(cache: Path, decoder_blocks: int | None, **_):
    from pixal3d.nn.sparse_tensor import SparseTensor

    decoder = cut_decoder(half_to_bf16(load("shape_slat_decoder", cache)), decoder_blocks)
    weights = prefault(decoder)
    coords = shell_coords(32, LR_TOKENS)
    counts = shell_decoder(decoder, coords, 32, 4)
    latent = SparseTensor(torch.randn(len(coords), 32), coords)

    def run() -> dict:
        fine = decoder.upsample(latent, times=4)  # [M, 4] at 512³
        xyz = ((fine[:, 1:].float() + 0.5) / 512 * 63).round().int()
        hr = torch.unique(torch.cat([fine[:, :1], xyz], dim=1), dim=0)
        return {"tokens": len(coords), "fine_coords": len(fine), "hr_tokens": len(hr)}
    return run, {"weights": weights, "level_voxels": counts}


def _decoders(cache: Path, decoder_blocks: int | None, tokens: int):
    from pixal3d.nn.sparse_tensor import SparseTensor

    shape = cut_decoder(half_to_bf16(load("shape_slat_decoder", cache)), decoder_blocks)
    tex = cut_decoder(half_to_bf16(load("tex_slat_decoder", cache)), decoder_blocks)
    shape.set_resolution(1024)
    weights = prefault(shape) + prefault(tex)
    coords = shell_coords(64, tokens)
    counts = shell_decoder(shape, coords, 64, 4)
    shape_latent = SparseTensor(torch.randn(len(coords), 32), coords)
    tex_latent = SparseTensor(torch.randn(len(coords), 32), coords)
    return shape, tex, shape_latent, tex_latent, weights, counts


def _level_probe(model, levels: list[dict], tag: str) -> None:
    """Record each stage's voxels and peak RSS (``model._stage`` wrapped; VmHWM reset around it)."""
    stage = model._stage

    def probed(i, h, subdiv=None):
        levels.append({"decoder": tag, "level": i, "voxels_in": len(h), "hwm_before": _hwm()})
        linux.reset_peak()
        out = stage(i, h, subdiv)
        levels[-1].update(voxels_out=len(out[0]), peak=_hwm())
        return out
    model._stage = probed


def setup_decode(cache: Path, decoder_blocks: int | None, budget: str | None = None, tokens: int = HR_TOKENS,
                 **_):
    from pixal3d.memory_budget import parse_budget, plan_decode
    from pixal3d.models.decoder_tiling import decode_tiled

    shape, tex, shape_latent, tex_latent, weights, counts = _decoders(cache, decoder_blocks, tokens)
    info: dict[str, Any] = {"weights": weights, "level_voxels": counts}
    levels: list[dict] = []

    def untiled() -> dict:
        _level_probe(shape, levels, "shape")
        _level_probe(tex, levels, "tex")
        fields, subs = shape.decode_fields(shape_latent)
        pbr = tex.decode_pbr(tex_latent, subs, 1024)
        return {"tokens": len(shape_latent), "decoded_voxels": len(pbr.coords), "levels": levels}

    def tiled() -> dict:
        plan = plan_decode(parse_budget(budget), latent_tokens=len(shape_latent), weight_bytes=weights)
        fields, pbr, report = decode_tiled(shape, shape_latent, plan, tex_decoder=tex, tex_latent=tex_latent,
                                           resolution=1024)
        return {"tokens": len(shape_latent), "decoded_voxels": len(pbr.coords), "plan": dataclasses.asdict(plan),
                "tiles": dataclasses.asdict(report)}
    return (untiled if budget is None else tiled), info


def setup_decode_ratio(cache: Path, decoder_blocks: int | None, budget: str | None = None, tokens: int = 4096,
                       tile_voxels: int | None = None, start_level: int = 2, repeats: int = 2, **_):
    """Untiled and tiled decode alternately in one process, ``repeats`` times each (time ratio of the
    fastest of each; outputs compared bit for bit)."""
    from pixal3d.models.decoder_tiling import TilePlan, decode_tiled

    shape, tex, shape_latent, tex_latent, weights, counts = _decoders(cache, decoder_blocks, tokens)
    plan = TilePlan(start_level=start_level, tile_voxels=tile_voxels or max(1, counts[-1] // 3))

    def untiled():
        fields, subs = shape.decode_fields(shape_latent)
        return fields, tex.decode_pbr(tex_latent, subs, 1024), None

    def tiled():
        return decode_tiled(shape, shape_latent, plan, tex_decoder=tex, tex_latent=tex_latent, resolution=1024)

    def run() -> dict:
        times: dict[str, list[float]] = {"untiled": [], "tiled": []}
        outputs = {}
        for _ in range(repeats):
            for name, fn in (("untiled", untiled), ("tiled", tiled)):
                t0 = time.perf_counter()
                outputs[name] = fn()
                times[name].append(round(time.perf_counter() - t0, 1))
                if name == "tiled":
                    report = outputs[name][2]
        (fields, pbr, _), (fields2, pbr2, _) = outputs["untiled"], outputs["tiled"]
        equal = all(torch.equal(a, b) for a, b in ((fields.coords, fields2.coords),
                                                    (fields.dual_vertices, fields2.dual_vertices),
                                                    (fields.intersected, fields2.intersected),
                                                    (fields.split_weight, fields2.split_weight),
                                                    (pbr.attrs, pbr2.attrs)))
        return {"tokens": len(shape_latent), "decoded_voxels": len(pbr.coords), "untiled_s": times["untiled"],
                "tiled_s": times["tiled"], "ratio": round(min(times["tiled"]) / min(times["untiled"]), 3),
                "bitwise_equal": equal, "plan": dataclasses.asdict(plan), "tiles": dataclasses.asdict(report)}
    return run, {"weights": weights, "level_voxels": counts}


SETUPS: dict[str, Callable[..., tuple[Callable[[], dict], dict]]] = {
    "structure": setup_structure, "shape_512": setup_shape_512, "upsample": setup_upsample,
    "shape_1024": setup_shape_1024, "texture": setup_texture, "decode": setup_decode,
    "decode_ratio": setup_decode_ratio,
}


def child(stage: str, params: dict[str, Any]) -> dict[str, Any]:
    """Load, settle, run the stage once; peak = VmHWM over the run (levels probed in between)."""
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    process = _rss()
    run, info = SETUPS[stage](**params)
    before = _settle()
    start = time.perf_counter()
    extra = run()
    seconds = time.perf_counter() - start
    levels = extra.get("levels", [])
    peak = max([_hwm()] + [lv["peak"] for lv in levels] + [lv["hwm_before"] for lv in levels])  # between stages too
    for lv in levels:
        lv["peak_above_before"] = lv.pop("peak") - before
        lv.pop("hwm_before")
    return {"stage": stage, "params": {k: v for k, v in params.items() if k != "cache"}, "process_start": process,
            "rss_before": before, "peak": peak, "working_set": peak - before, "seconds": round(seconds, 1),
            **info, **extra}


def export_child(voxels: int) -> dict[str, Any]:
    """``scripts/bench_export.py`` on ``voxels`` voxels (its own process); its exact peak and time."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        cmd = [sys.executable, str(REPO / "scripts" / "bench_export.py"), "--voxels", str(voxels),
               "--out", str(Path(tmp) / "bench.glb"), "--json", str(out)]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
        if proc.returncode:
            raise RuntimeError(f"bench_export failed:\n{proc.stderr[-2000:]}")
        report = json.loads(out.read_text())
    return {"stage": "export", "params": {"voxels": voxels}, "report": report,
            "seconds": round(time.perf_counter() - start, 1), "stdout": proc.stdout[-3000:]}


# -- parent ------------------------------------------------------------------------------------

def measure(stage: str, params: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps([stage, params])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{stage} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gib(n: float | None) -> str:
    return "–" if n is None else f"{n / GIB:.2f}"


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| stage | work | weights | peak (process) | working set | s |", "|---|---|---|---|---|---|"]
    for r in results:
        if r["stage"] == "export":
            peak = r["report"].get("peak_rss") or r["report"].get("peak_rss_bytes")
            rows.append(f"| export | {r['params']['voxels']:,} voxels, 1M faces, 4096² | – | {_gib(peak)} | – "
                        f"| {r['seconds']} |")
            continue
        work = {k: v for k, v in r.items() if k in ("tokens", "decoded_voxels", "hr_tokens", "fine_coords")}
        if "tiles" in r:
            work["tiles"] = r["tiles"]["tiles"]
        rows.append(f"| {r['stage']} | {work} | {_gib(r['weights'])} | {_gib(r['peak'])} | {_gib(r['working_set'])} "
                    f"| {r['seconds']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", default=list(STAGES), help=f"stages (default all: {STAGES}; "
                        "also decode_ratio)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="real-size random checkpoints")
    parser.add_argument("--flow-blocks", type=int, default=2)
    parser.add_argument("--decoder-blocks", type=int, default=None, help="ConvNeXt blocks run per decoder stage "
                        "(default: all)")
    parser.add_argument("--budget", help="decode tiled within this budget (e.g. 8G); default untiled")
    parser.add_argument("--ratio-tokens", type=int, default=4096)
    parser.add_argument("--ratio-tile-voxels", type=int)
    parser.add_argument("--ratio-start-level", type=int, default=2)
    parser.add_argument("--ratio-repeats", type=int, default=2)
    parser.add_argument("--export-voxels", type=int, default=9_000_000)
    parser.add_argument("--naf-mode", choices=("frugal", "full"), default="frugal",
                        help="NAF mode of the flow stages (default frugal, the mode of the committed before/after "
                        "runs; full = the reference's values, what auto picks when the budget allows)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--timeout", type=float, default=3600.0)
    args = parser.parse_args(argv)
    if args.child:
        stage, params = json.loads(args.child)
        params["cache"] = Path(params["cache"])
        print(json.dumps(child(stage, params)))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    results = []
    for stage in args.only:
        params: dict[str, Any] = {"cache": str(args.cache.expanduser()), "flow_blocks": args.flow_blocks,
                                  "decoder_blocks": args.decoder_blocks}
        if stage in ("shape_512", "shape_1024", "texture"):
            params["naf_mode"] = args.naf_mode
        if stage == "decode" and args.budget:
            params["budget"] = args.budget
        if stage == "decode_ratio":
            params.update(tokens=args.ratio_tokens, tile_voxels=args.ratio_tile_voxels,
                          start_level=args.ratio_start_level, repeats=args.ratio_repeats)
        result = export_child(args.export_voxels) if stage == "export" else measure(stage, params, args.timeout)
        results.append(result)
        logger.info("%s: %s", stage, json.dumps({k: v for k, v in result.items()
                                                   if k not in ("stdout", "levels", "report")}))
        for level in result.get("levels", []):
            logger.info("    %-5s level %d: %9d -> %9d voxels, peak %.2f GiB above before", level["decoder"],
                        level["level"], level["voxels_in"], level["voxels_out"], level["peak_above_before"] / GIB)
        if args.out:
            args.out.write_text(json.dumps({"command": " ".join(sys.argv), "torch": torch.__version__,
                                            "threads": torch.get_num_threads(), "results": results}, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
