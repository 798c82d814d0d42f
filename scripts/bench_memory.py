"""Memory benchmark at real model sizes: eager vs staged vs resident, each in its own process.

What it does, in order:

1. Writes (once, then reuses) real-size checkpoints with deterministic random weights into a cache
   folder (``scripts/write_random_checkpoints.py``): the seven Pixal3D checkpoints at their published
   configs and stored dtypes, a DINOv3 ViT-L/16 and NAF, plus a ``pipeline.json``.
2. Reads the same files sequentially, page cache cold (evicted with ``posix_fadvise``) then warm:
   the raw-read throughput the loads are compared with.
3. Runs the real cascade (``pipelines.Pixal3D`` on ``configs/1024_cascade.yaml``, weights
   pointed at the cache) once per policy, each in a fresh subprocess with the memory meter attached
   and the checkpoint files evicted first. The work is reduced so a 2-core CPU gets through it (see
   ``CPU_WORK``); the loads, releases and resident weights are exactly the cascade's own.
4. Writes the per-stage table, load throughput, goal checks (``benchmarks/*.md``, ``*.json``), the
   traces and one PNG comparing the policies over time.

    python scripts/bench_memory.py                       # everything (about 10 minutes on 2 cores)
    python scripts/bench_memory.py --policies staged     # one policy
    python scripts/bench_memory.py --child staged --result r.json --trace t.jsonl   # one run, no report

On CPU, safetensors maps the files: a loaded weight *is* the page-cache page, and pages are read on
first touch. The benchmark's loaders touch every page right after ``load_model`` returns (one byte
per 4 KiB), so a load's seconds include reading it from disk and "loaded" means resident, as it does
for the reference (which copies every tensor into RAM).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts import bench_io
from scripts import write_random_checkpoints as wrc

logger = logging.getLogger("bench_memory")

REPO = Path(__file__).resolve().parents[1]
POLICIES = ("eager", "staged", "resident")
FOV_DEG = 49.1
@dataclass(frozen=True)
class Work:
    """How much of each stage runs. ``None`` sizes mean "as the cascade would" (full latent, all tokens)."""

    lr_tokens: int              # synthetic structure: voxels at 32^3
    hr_tokens: int              # synthetic HR coords: voxels at 64^3
    run_ss_flow: bool           # run the sparse-structure flow (4096 dense tokens per forward)
    ss_decoder_crop: int | None  # the dense SS decoder runs on a crop^3 corner of the latent
    upsample_tokens: int | None  # LR tokens the shape decoder's upsample runs on
    decode_tokens: int | None    # HR tokens both decoders run on
    steps: int | None           # sampler steps per flow stage (None: the config's)
    guidance: bool              # keep the config's guidance (CFG pairs); False: strength 1, one forward
    reference_condition: bool   # keep the 1024 px conditioning of shape_1024/texture; False: 512 px

    def describe(self) -> dict[str, str]:
        """What was cut, per stage, in words (goes into the trace meta and the report)."""
        steps = "the config's step counts" if self.steps is None else f"{self.steps} Euler step(s) per flow stage"
        guidance = "guidance as configured" if self.guidance else "guidance_strength 1 (one forward per step)"
        return {
            "sampler": f"{steps}, {guidance}",
            "conditioning": "DINOv3/NAF at the reference sizes" if self.reference_condition else
                            "DINOv3 and NAF at 512 px for every stage (reference: 1024 px for shape_1024 and "
                            "texture): one backbone forward per run",
            "structure": ("SS flow run" if self.run_ss_flow else
                          "SS flow loaded, its forward skipped (4096 dense tokens: 1.5-5 min per forward on a "
                          "shared 2-core CPU)")
                         + ("; SS decoder on the full latent" if self.ss_decoder_crop is None else
                            f"; SS decoder on a {self.ss_decoder_crop}^3 corner of the latent (fp16 conv3d at "
                            "16^3 -> 64^3 takes over 10 min on that CPU)")
                         + f"; coords replaced by a synthetic sphere shell of {self.lr_tokens} voxels at 32^3 "
                           "(random weights give a random occupancy)",
            "upsample": ("shape decoder upsample on all LR tokens" if self.upsample_tokens is None else
                         f"shape decoder upsample on the first {self.upsample_tokens} LR tokens")
                        + f"; HR coords replaced by a synthetic sphere shell of {self.hr_tokens} voxels at 64^3",
            "decode": "both decoders on all HR tokens" if self.decode_tokens is None else
                      f"both decoders on the first {self.decode_tokens} HR tokens",
            "export": "skipped (no model; mesh processing of random-weight fields measures nothing here)",
        }


CPU_WORK = Work(lr_tokens=64, hr_tokens=128, run_ss_flow=False, ss_decoder_crop=2, upsample_tokens=2,
                decode_tokens=2, steps=1, guidance=False, reference_condition=False)
CUDA_WORK = Work(lr_tokens=4096, hr_tokens=20000, run_ss_flow=True, ss_decoder_crop=None, upsample_tokens=None,
                 decode_tokens=None, steps=None, guidance=True, reference_condition=True)


# -- reduced-work stages (the cascade's own stages with the expensive parts cut) ------------------

def shell_coords(resolution: int, tokens: int) -> torch.Tensor:
    """Coords ``[N, 4]`` int32 (b=0, x, y, z), lexicographic: the ``tokens`` voxels nearest a sphere of
    radius 0.4·resolution around the grid centre (a hollow ball, like an object's surface)."""
    axis = torch.arange(resolution, dtype=torch.float32)
    grid = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), dim=-1).reshape(-1, 3)
    off = ((grid - (resolution - 1) / 2).norm(dim=1) - 0.4 * resolution).abs()
    keep = torch.sort(torch.argsort(off, stable=True)[:min(tokens, len(grid))]).values
    shell = grid[keep].int()
    return torch.cat([torch.zeros(len(shell), 1, dtype=torch.int32), shell], dim=1)


def _first(latent: Any, count: int | None) -> Any:
    """The first ``count`` tokens of a SparseTensor (all when None)."""
    from pixal3d.nn.sparse_tensor import SparseTensor

    return latent if count is None else SparseTensor(latent.feats[:count], latent.coords[:count])


def reduced_stages(config: Any, work: Work, info: dict, *, sync: Callable[[], None] | None = None) -> dict:
    """Stage name → replacement for ``Pixal3D(replace=...)``: structure, upsample and decode cut to ``work``
    (the run stops after decode); ``sync`` (e.g. ``torch.cuda.synchronize``) runs at the end of every stage
    so its time is its own."""
    from pipelines.build import build_stages
    from pipelines.decode import DecodeStage
    from pipelines.flow_stage import draw_noise, extractor, sample, stage_condition
    from pipelines.structure import StructureStage
    from pipelines.upsample import UpsampleStage

    class BenchStructure(StructureStage):
        def run(self, state, models):
            cfg = self.config
            cond = stage_condition(state, models, extractor("ss", cfg.condition, cfg.noise_resolution), None)
            flow = models["sparse_structure_flow_model"]  # loaded (and resident) as in the real stage
            r = cfg.noise_resolution
            state.ss_noise = draw_noise(state.generator, 1, cfg.latent_channels, r, r, r)
            noise = state.ss_noise.to(state.device)
            state.ss_latent = (sample(flow, noise, cond, cfg.sampler, state=state, stage=self.name)
                               if work.run_ss_flow else noise)
            crop = work.ss_decoder_crop or r
            logits = models["sparse_structure_decoder"](state.ss_latent[..., :crop, :crop, :crop])
            info["ss_decoder_logits"] = list(logits.shape)
            state.coords_lr = shell_coords(cfg.coords_resolution, work.lr_tokens).to(state.device)
            info["lr_tokens"] = int(state.coords_lr.shape[0])

    class BenchUpsample(UpsampleStage):
        def run(self, state, models):
            cfg = self.config
            fine = models["shape_slat_decoder"].upsample(_first(state.lr_latent, work.upsample_tokens),
                                                         times=cfg.times)
            info["upsample_fine_coords"] = int(fine.shape[0])
            state.coords_hr = shell_coords(cfg.hr_resolution // 2 ** cfg.times, work.hr_tokens).to(state.device)
            state.hr_resolution = cfg.hr_resolution
            info["hr_tokens"] = int(state.coords_hr.shape[0])

    class BenchDecode(DecodeStage):
        def run(self, state, models):
            shape_decoder = models["shape_slat_decoder"]
            shape_decoder.set_resolution(state.hr_resolution)
            fields, subs = shape_decoder.decode_fields(_first(state.shape_latent, work.decode_tokens))
            pbr = models["tex_slat_decoder"].decode_pbr(_first(state.tex_latent, work.decode_tokens), subs,
                                                        state.hr_resolution)
            state.fields, state.pbr = fields, pbr
            info["decoded_voxels"] = int(pbr.coords.shape[0])

    replaced = {"structure": BenchStructure, "upsample": BenchUpsample, "decode": BenchDecode}
    out = {}
    for stage in build_stages(config, until="decode"):
        if stage.name in replaced:
            stage = replaced[stage.name].from_config(config)
        if sync is not None:
            stage.run = _synced(stage.run, sync)
        out[stage.name] = stage
    return out


def _synced(run: Callable[..., None], sync: Callable[[], None]) -> Callable[..., None]:
    def synced_run(state: Any, models: Any) -> None:
        run(state, models)
        sync()
    return synced_run


def bench_config(cache: Path, work: Work):
    """``configs/1024_cascade.yaml`` with weights from ``cache``, a fixed field of view and ``work``'s sampling."""
    from pixal3d.config import CameraConfig, WeightsConfig, WeightSource, load_config, with_sampler_steps

    config = load_config(REPO / "configs" / "1024_cascade.yaml")
    if work.steps is not None:
        config = with_sampler_steps(config, work.steps)
    weights = WeightsConfig(pixal3d=WeightSource(local=str(cache)),
                            dinov3=WeightSource(local=str(cache / "dinov3-vitl16")),
                            naf=WeightSource(local=str(cache / "naf"), files=("naf_release.safetensors",)),
                            rembg=None, moge=None)
    changes: dict[str, Any] = {"weights": weights, "camera": CameraConfig(fov_deg=FOV_DEG)}
    for name in ("structure", "shape_512", "shape_1024", "texture"):
        cfg = getattr(config, name)
        cond, sampler = cfg.condition, cfg.sampler
        if name in ("shape_1024", "texture") and not work.reference_condition:
            cond = dataclasses.replace(cond, image_size=512, naf_size=512)
        if not work.guidance:
            sampler = dataclasses.replace(sampler, guidance_strength=1.0)
        changes[name] = dataclasses.replace(cfg, condition=cond, sampler=sampler)
    return dataclasses.replace(config, **changes)


# -- loads: touch every page, record what memory did around each load -----------------------------

def _status() -> dict[str, int]:
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                values[key] = int(rest.split()[0]) * 1024
    return values


def prefault(module: torch.nn.Module) -> int:
    """Read one byte of every 4 KiB page of every CPU parameter/buffer, in address order (= file order
    for a mapped safetensors file, so the kernel's readahead sees a sequential read); return the bytes."""
    tensors = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device.type == "cpu" and not tensor.is_meta and tensor.numel():
            tensors.setdefault(tensor.untyped_storage().data_ptr(), tensor)
    total = 0
    for _, tensor in sorted(tensors.items()):
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        flat[::4096].sum()
        total += flat.numel()
    return total


class LoadRecorder:
    """Wraps loaders: time each load (build + read), touch its pages, and record RSS before/after and
    the exact peak during it (Linux VmHWM reset through clear_refs just before the load)."""

    def __init__(self, touch: bool):
        self.touch = touch
        self.records: list[dict[str, Any]] = []

    def wrap(self, name: str, loader: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
        def load() -> torch.nn.Module:
            from pixal3d.staging.release import module_nbytes
            from pixal3d.telemetry import linux

            before = _status() if linux.is_linux() else {}
            reset = linux.reset_peak()
            start = time.perf_counter()
            module = loader()
            built = time.perf_counter()
            touched = prefault(module) if self.touch else 0
            done = time.perf_counter()
            after = _status() if linux.is_linux() else {}
            self.records.append({
                "model": name, "bytes": module_nbytes(module), "touched": touched,
                "build_seconds": round(built - start, 3), "seconds": round(done - start, 3),
                "rss_before": before.get("VmRSS"), "hwm_before": before.get("VmHWM"),
                "rss_after": after.get("VmRSS"), "peak_during": after.get("VmHWM") if reset else None,
                "anon_before": before.get("RssAnon"), "anon_after": after.get("RssAnon"), "time": time.time()})
            return module
        return load


# -- one policy, in this process ------------------------------------------------------------------

def run_child(policy: str, cache: Path, trace: Path, result: Path, work: Work, *,
              device: str = "cpu") -> dict[str, Any]:
    """Run the reduced cascade under ``policy`` with the meter attached; write the result JSON."""
    from pipelines import Pixal3D
    from pixal3d.telemetry import read_trace, summarize

    torch.set_grad_enabled(False)
    dev = torch.device(device)
    config = bench_config(cache, work)
    info: dict[str, Any] = {}
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    recorder = LoadRecorder(touch=dev.type == "cpu")
    pipe = Pixal3D.from_config(config, policy=policy, device=dev, replace=reduced_stages(config, work, info, sync=sync),
                               until="decode", wrap_loader=recorder.wrap)
    weights = pipe.weights
    baseline = _status()
    meta = {"policy": policy, "bench": "scripts/bench_memory.py", "device": str(dev),
            "reduced_work": work.describe(), "work": dataclasses.asdict(work), "torch": torch.__version__}
    start = time.perf_counter()
    # The run's own meter (Pixal3D.run) is the only one: two would reset each other's peaks.
    with pipe:
        run = pipe.run(REPO / "assets" / "example.png", trace=trace, trace_meta=meta)
    records = run.stages
    summary = summarize(read_trace(trace))
    out = {
        "policy": policy, "device": str(dev), "seconds": round(time.perf_counter() - start, 2),
        "baseline": baseline, "work": dataclasses.asdict(work), "reduced_work": work.describe(),
        "stages": [{"stage": r.stage, "seconds": round(r.seconds, 3), "used": r.used} for r in records],
        "loads": recorder.records, "info": info, "summary": summary.to_dict(),
        "weights": {k: str(v) for k, v in weights.safetensors().items()},
    }
    result.parent.mkdir(parents=True, exist_ok=True)
    result.write_text(json.dumps(out, indent=1) + "\n")
    return out


# -- the whole benchmark ----------------------------------------------------------------------------

def touching(name: str, loader: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    """A ``wrap_loader`` whose loads touch every page of the model they load (``prefault``), so that a load's
    seconds include reading it from disk."""
    def load() -> torch.nn.Module:
        module = loader()
        prefault(module)
        return module
    return load


def weight_files(cache: Path) -> list[Path]:
    """Every safetensors file the cascade reads, in the cache."""
    return sorted(cache.rglob("*.safetensors"))


def run_policies(policies: Sequence[str], cache: Path, traces: Path, work: Work, *, device: str,
                 label: str) -> dict[str, dict[str, Any]]:
    """Each policy in a fresh subprocess, checkpoint files evicted from the page cache first."""
    files = weight_files(cache)
    results = {}
    for policy in policies:
        for path in files:
            bench_io.evict(path)
        cached = bench_io.mean_cached_fraction(files)
        trace, result = traces / f"{label}-{policy}.jsonl", traces / f"{label}-{policy}.result.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--child", policy, "--cache", str(cache),
                   "--trace", str(trace), "--result", str(result), "--device", device,
                   "--work", json.dumps(dataclasses.asdict(work))]
        logger.info("policy %s (%.0f%% of the weights cached): %s", policy, 100 * cached, " ".join(command))
        start = time.perf_counter()
        proc = subprocess.run(command, cwd=REPO, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"policy {policy} failed with exit code {proc.returncode}; see {trace}")
        results[policy] = json.loads(result.read_text())
        results[policy]["cached_before"] = cached
        logger.info("policy %s done in %.0f s", policy, time.perf_counter() - start)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=wrc.DEFAULT_CACHE)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--lr-tokens", type=int, default=CPU_WORK.lr_tokens, help="synthetic LR structure size")
    parser.add_argument("--hr-tokens", type=int, default=CPU_WORK.hr_tokens, help="synthetic HR structure size")
    parser.add_argument("--report-only", action="store_true",
                        help="rebuild the report from the results and traces already under --out")
    parser.add_argument("--child", choices=(*POLICIES, "offload"), help=argparse.SUPPRESS)
    parser.add_argument("--trace", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    cache = args.cache.expanduser()
    if args.child:
        work = Work(**json.loads(args.work)) if args.work else CPU_WORK
        run_child(args.child, cache, args.trace, args.result, work, device=args.device)
        return 0

    from scripts import bench_report

    traces = args.out / "traces"
    raw_path = traces / "cpu-raw-read.json"
    command = " ".join(["python scripts/bench_memory.py", *(argv if argv is not None else sys.argv[1:])])
    if args.report_only:
        raw = json.loads(raw_path.read_text())
        results = {p: json.loads((traces / f"cpu-{p}.result.json").read_text()) for p in args.policies}
        command = raw.pop("command", command)
        bench_report.write_cpu_report(args.out, results, raw, command_line=command)
        return 0
    work = dataclasses.replace(CPU_WORK, lr_tokens=args.lr_tokens, hr_tokens=args.hr_tokens)
    wrc.write_all(cache)
    wrc.write_pipeline_json(cache)
    raw = bench_io.cold_and_warm(weight_files(cache))
    logger.info("raw read: cold %.2f GB/s (%.0f%% cached before), warm %.2f GB/s",
                raw["cold"].gb_per_s, 100 * raw["cold"].cached_before, raw["warm"].gb_per_s)
    traces.mkdir(parents=True, exist_ok=True)
    raw_path.write_text(json.dumps({"command": command, **{k: v.to_dict() for k, v in raw.items()}}, indent=1))
    results = run_policies(args.policies, cache, traces, work, device="cpu", label="cpu")
    bench_report.write_cpu_report(args.out, results, raw, command_line=command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
