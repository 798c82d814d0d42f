"""The 1024 cascade within a memory budget under the ``stream`` policy, at real widths, weights copied into process
memory as onto a device (``runtime.cpu_weights: copied``): per-stage peaks against the plan, the time streaming
costs, and the whole cascade inside a kernel-enforced memory limit (a cgroup) with and without the budget.

Modes (each measurement in a fresh process; real-size random weights from ``scripts/write_random_checkpoints.py``
in ``--cache``):

- ``plan``: the plan ``--plan --memory-budget`` prints for the 1024 cascade on these checkpoints (their headers are the
  released files' sizes), the config's own 12 steps.
- ``stages``: every stage of the 4 GiB plan (``Pixal3D.plan(..., memory_budget=...)``), the plan's own fitted
  stage objects and loaders, run once on synthetic inputs at the reference's counts (4096 dense structure tokens,
  4000 LR and 20,000 HR tokens, the shape decoder's subdivisions made to grow ×4.6 per level: ~9M decoded voxels,
  the export of a 9M-voxel shape to 1M faces and 4096²). Cuts (all printed): one sampler step per flow stage; the
  flows run their first ``--flow-blocks`` blocks and the decoders ``--decoder-blocks`` ConvNeXt blocks per level
  (streamed: the window of two blocks is the same whatever the count); fp16 decoder torsos run in bf16 (same
  bytes; the CPU's fp16 GEMMs are ~400x slower). Peak: the process's ``VmHWM`` (exact) and its anonymous memory
  sampled every 2 ms (what a device holds: the mapped checkpoint's pages are page cache, reclaimable).
  ``camera`` (MoGe-2) needs ``<cache>/moge-2-vitl/model.pt`` (``scripts/bench_camera.py`` writes it) and runs on a
  1024² image; ``--until`` plans only the stages up to one (``--until features``: camera and features, whose plan
  at 2.5 GiB does not depend on the export's).
- ``ratio``: a flow forward at real width, resident (copied) against streamed, alternating in one process;
  ``--model moge`` / ``--model dinov3``: MoGe-2's ``infer`` (float32, 3600 tokens) / DINOv3's tokens at 1024 px
  the same way.
- ``cascade``: the whole cascade at real widths on reduced work (see ``CascadeWork``), one run, its fingerprints;
  ``cgroup`` runs it inside a new memory cgroup (v2 ``memory.max`` where mounted, else v1
  ``memory.limit_in_bytes``; root): with ``--memory-budget`` (``budgeted``), ``auto`` without a budget (the
  policy reads the cgroup's limit), whole models per stage without a budget (``staged``: the plan refuses it when
  a stage's weights exceed what the group has free) and the same with that refusal turned off (``control``: what
  a run without streaming or tiles holds, for the kernel to stop), and outside it a resident run of the budget's stage choices (NAF mode,
  decode tiles, chunks; whole models kept loaded, no budget) for the fingerprints (``resident``); ``--runs``
  picks some of them, keeping the others from the ``--out`` report of an earlier run.

    python scripts/bench_stream.py plan --budget 4G
    python scripts/bench_stream.py stages --budget 4G --out benchmarks/stream_stages.json
    python scripts/bench_stream.py ratio --tokens 1000 --repeats 3 --out benchmarks/stream_ratio.json
    python scripts/bench_stream.py stages --budget 2.5G --until features --only camera features --out cf.json
    python scripts/bench_stream.py ratio --model moge --repeats 2 --out moge_ratio.json
    python scripts/bench_stream.py cgroup --limit 4G --budget 4G --out benchmarks/stream_cgroup.json
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

from scripts.bench_memory import _status

logger = logging.getLogger("bench_stream")
REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
DEFAULT_CACHE = Path(os.environ.get("PIXAL3D_BENCH_CACHE", "/work/realsize/bench"))
DEFAULT_FIELDS = Path(os.environ.get("PIXAL3D_BENCH_FIELDS", "/work/realsize/export/fields9M.npz"))
STAGES = ("camera", "features", "structure", "shape_512", "upsample", "shape_1024", "texture", "decode", "export")
LR_TOKENS, HR_TOKENS, GROWTH = 4000, 20_000, 4.6


# -- memory ----------------------------------------------------------------------------------------

class AnonPeak:
    """The largest ``RssAnon`` (anonymous memory: what a device would hold) seen every ``interval`` seconds."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _status()["RssAnon"])
            self._stop.wait(self.interval)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status()["RssAnon"])


def _settle() -> dict[str, int]:
    """Collect garbage, return freed heap to the OS, reset VmHWM; what is resident now."""
    import ctypes

    from pixal3d.telemetry import linux

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    if not linux.reset_peak():
        raise SystemExit("cannot reset VmHWM through /proc/self/clear_refs on this machine")
    return _status()


# -- the plan and its models -----------------------------------------------------------------------

def bench_config(cache: Path, *, steps: int = 1, guidance: bool = True, copied: bool = True, moge: bool = False):
    """``configs/1024_cascade.yaml`` on the real-size random weights of ``cache``, a fixed field of view (or with
    ``moge``, MoGe-2's estimate from ``<cache>/moge-2-vitl``: ``scripts/bench_camera.py`` writes it), ``steps``
    sampler steps, weights copied into process memory."""
    from pixal3d.config import (
        CameraConfig,
        WeightsConfig,
        WeightSource,
        load_config,
        with_sampler_steps,
    )

    config = with_sampler_steps(load_config(REPO / "configs" / "1024_cascade.yaml"), steps)
    weights = WeightsConfig(pixal3d=WeightSource(local=str(cache)),
                            dinov3=WeightSource(local=str(cache / "dinov3-vitl16")),
                            naf=WeightSource(local=str(cache / "naf"), files=("naf_release.safetensors",)),
                            rembg=None, moge=WeightSource(local=str(cache / "moge-2-vitl")) if moge else None)
    changes: dict[str, Any] = {"weights": weights, "camera": CameraConfig() if moge else CameraConfig(fov_deg=49.1),
                               "runtime": dataclasses.replace(config.runtime,
                                                              cpu_weights="copied" if copied else "mapped")}
    if not guidance:
        for name in ("structure", "shape_512", "shape_1024", "texture"):
            cfg = getattr(config, name)
            changes[name] = dataclasses.replace(cfg, sampler=dataclasses.replace(cfg.sampler, guidance_strength=1.0))
    return dataclasses.replace(config, **changes)


def cut_streamed(model: nn.Module, keep: int) -> nn.Module:
    """Run fewer streamed blocks: a flow keeps its first ``keep`` blocks, a decoder its first ``keep`` ConvNeXt
    blocks per stage and every stage's C2S block (as ``bench_full_work.cut_decoder``). The others are never
    copied; the window of two blocks on the device is the same."""
    from pixal3d.staging.stream import StreamedList

    lists = [(name, module) for name, module in model.named_modules() if isinstance(module, StreamedList)]
    last = len(lists) - 1
    for index, (name, module) in enumerate(lists):
        units, children = list(module.units), list(module.children())
        decoder_stage = name != "blocks"
        tail = [len(units) - 1] if decoder_stage and index < last else []
        chosen = [i for i in range(len(units)) if i < keep and i not in tail] + tail
        if len(chosen) == len(units):
            continue
        parent_path, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, attr, StreamedList([children[i] for i in chosen], [units[i] for i in chosen], module.stream))
    units = [u for m in model.modules() if isinstance(m, StreamedList) for u in m.units]
    for before, after in zip(units, units[1:] + units[:1]):
        before.next = after
    return model


def bf16_streamed(model: nn.Module) -> nn.Module:
    """An fp16 torso in bf16 (same bytes; the CPU's fp16 GEMMs are ~400x slower), streamed blocks included."""
    from pixal3d.staging.stream import StreamedList

    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dtype == torch.float16:
                setattr(module, name, nn.Parameter(param.detach().to(torch.bfloat16), requires_grad=False))
        if isinstance(module, StreamedList):
            for unit in module.units:
                unit.tensors = tuple(dataclasses.replace(t, dtype=torch.bfloat16) if t.dtype == torch.float16 else t
                                     for t in unit.tensors)
    if getattr(model, "dtype", None) == torch.float16:
        model.dtype = torch.bfloat16
    return model


def shell_subdivisions(decoder: nn.Module, coords: torch.Tensor, base: int, levels: int) -> list[int]:
    """Give the decoder's C2S blocks subdivision rules (``bench_full_work.ShellSubdivision``) that grow each level
    ×4.6 around a sphere, as an object's surface does; the voxels per level."""
    from scripts.bench_full_work import shell_decoder

    return shell_decoder(decoder, coords, base, levels, GROWTH)


# -- one stage ----------------------------------------------------------------------------------------

def _features(sizes: tuple[int, ...], device: torch.device):
    from pixal3d.models.conditioning import BackboneFeatures, ImageFeatures

    g = torch.Generator().manual_seed(0)
    return ImageFeatures({s: BackboneFeatures(torch.randn(1, 5 + (s // 16) ** 2, 1024, generator=g).to(device),
                                              torch.rand(1, 3, s, s, generator=g).to(device), 5) for s in sizes})


def _image():
    from PIL import Image

    pixels = (torch.rand(1024, 1024, 3, generator=torch.Generator().manual_seed(0)) * 255).to(torch.uint8).numpy()
    return Image.fromarray(pixels, "RGB")


def _export_inputs(fields_npz: Path):
    import numpy as np

    from pixal3d.mesh.fields import DualGridFields
    from pixal3d.mesh.synthetic import pbr_from_function
    from scripts.bench_export import _color

    data = np.load(fields_npz)
    fields = DualGridFields(*(torch.from_numpy(data[k]) for k in ("coords", "dual_vertices", "intersected",
                                                                 "split_weight")), resolution=int(data["resolution"]))
    return fields, pbr_from_function(fields, _color)


def stage_child(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """Plan the cascade within ``params['budget']``, then run stage ``name`` alone through the plan's fitted stage,
    its loaders (copied weights, streamed blocks) and the runner, on synthetic inputs; its peaks against the plan."""
    from pipelines import Pixal3D
    from pipelines.loaders import model_loaders
    from pipelines.shape_512 import Shape512Stage  # noqa: F401  (the plan's classes)
    from pipelines.state import RunState
    from pixal3d.memory_budget import PROCESS_BYTES
    from pixal3d.models.camera import camera_from_fov
    from pixal3d.nn.sparse_tensor import SparseTensor
    from pixal3d.staging import StageRunner, WeightStream
    from scripts.calibrate_working_set import shell_coords

    torch.set_grad_enabled(False)
    start_status = _status()
    cache = Path(params["cache"])
    config = bench_config(cache, moge=name == "camera")
    plan = Pixal3D.plan(config, device="cpu", memory_budget=params["budget"], policy=params["policy"],
                        until=params.get("until"))
    stage = next(s for s in plan.stages if s.name == name)
    row = next(r for r in plan.memory.stages if r.name == name)
    weights = plan.resolved_weights()
    stream = WeightStream("cpu", copy=True) if plan.memory.streamed else None
    loaders = model_loaders(weights, torch.device("cpu"), moge=name == "camera", stream=stream,
                            streamed=tuple(plan.memory.streamed), copied=True)
    info: dict[str, Any] = {"policy": plan.policy.value, "choices": stage.choices() if hasattr(stage, "choices") else {}}
    flow_blocks, decoder_blocks = params["flow_blocks"], params["decoder_blocks"]
    coords_hr = shell_coords(64, HR_TOKENS)
    coords_lr = shell_coords(32, LR_TOKENS)

    def wrap(model_name: str, load: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        def loader() -> nn.Module:
            model = load()
            if model_name.endswith("flow_model") or "flow_model_" in model_name:
                cut_streamed(model, flow_blocks)
            if model_name in ("shape_slat_decoder", "tex_slat_decoder"):
                model = bf16_streamed(cut_streamed(model, decoder_blocks))
                if model_name == "shape_slat_decoder":
                    model.set_resolution(1024)
                    base, source = (32, coords_lr) if name == "upsample" else (64, coords_hr)
                    info["level_voxels"] = shell_subdivisions(model, source, base, 4)
            if model_name == "sparse_structure_decoder":
                from scripts.bench_full_work import half_to_bf16
                model = half_to_bf16(model)
            return model
        return loader

    loaders = {k: wrap(k, v) for k, v in loaders.items()}
    device = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    values: dict[str, Any] = {"device": device, "generator": torch.Generator().manual_seed(42), "progress": False,
                              "callback": None, "parallel": None, "fov_deg": None if name == "camera" else 49.1,
                              "shape_normalization": weights.shape_normalization,
                              "tex_normalization": weights.tex_normalization, "camera": camera_from_fov(0.857)}
    if name in ("camera", "features"):
        values["image"] = _image()
    else:
        values["features"] = _features((512, 1024), device)
    values["coords_lr"] = coords_lr
    values["lr_latent"] = SparseTensor(torch.randn(len(coords_lr), 32, generator=g), coords_lr)
    values["coords_hr"], values["hr_resolution"] = coords_hr, 1024
    values["shape_latent"] = SparseTensor(torch.randn(len(coords_hr), 32, generator=g), coords_hr)
    values["tex_latent"] = SparseTensor(torch.randn(len(coords_hr), 32, generator=g), coords_hr)
    if name == "export":
        values["fields"], values["pbr"] = _export_inputs(Path(params["fields"]))
        info["voxels"] = len(values["fields"].coords)
    state = RunState(input_image=None, **{k: v for k, v in values.items() if k in RunState.__dataclass_fields__})
    runner = StageRunner([stage], loaders, provides=tuple(stage.inputs), state_type=RunState, policy=plan.policy)
    before = _settle()
    start = time.perf_counter()
    with AnonPeak() as anon:
        record = runner.run_stage(stage, state)
    seconds = time.perf_counter() - start
    after = _status()
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # a step run in a forked child
    peak = max(anon.peak, children)  # the child's RSS counts the pages it shares with this process once
    planned = row.total_bytes + PROCESS_BYTES
    out = {"stage": name, "budget": params["budget"], "planned_process": planned, "planned_weights": row.weight_bytes,
           "planned_work": row.working_bytes, "streamed_per_pass": row.streamed_bytes,
           "process_start": start_status["VmRSS"], "rss_before": before["VmRSS"], "anon_before": before["RssAnon"],
           "peak_hwm": after["VmHWM"], "peak_anon": anon.peak, "peak_children": children, "peak": peak,
           "seconds": round(seconds, 1), "within_plan": peak <= planned, "within_budget": peak <= params["budget_bytes"],
           "stream": stream.stats.to_dict() if stream is not None else None, "used": record.used,
           "cuts": {"sampler_steps": 1, "flow_blocks": flow_blocks, "decoder_blocks": decoder_blocks}, **info}
    if name in ("shape_512", "shape_1024", "texture", "structure"):
        out["tokens"] = {"structure": 4096, "shape_512": len(coords_lr)}.get(name, len(coords_hr))
    if name == "decode":
        out["decoded_voxels"] = len(state.pbr.coords)
    if name == "camera":
        out["fov_deg"] = round(math.degrees(state.camera.fov), 4)
    runner.close()
    if stream is not None:
        stream.close()
    return out


# -- streamed vs resident time ---------------------------------------------------------------------

def backbone_ratio_child(params: dict[str, Any]) -> dict[str, Any]:
    """MoGe-2's ``infer`` (float32, as ``auto`` runs it on the CPU) or DINOv3's tokens at 1024 px at real width,
    whole (copied) and streamed (copied blocks), alternating: seconds, the ratio of the fastest of each, and whether
    the outputs are bitwise equal. MoGe-2 also whole with its convs in row bands (``whole_banded``), and streamed
    with them (as the camera stage runs under a budget): ``streamed`` / ``whole`` is what both cost together."""
    from pixal3d.memory_budget import CAMERA_BAND_ROWS
    from pixal3d.models.loading import in_process_memory
    from pixal3d.staging import WeightStream

    torch.set_grad_enabled(False)
    cache, stream = Path(params["cache"]), WeightStream("cpu", copy=True)
    g = torch.Generator().manual_seed(0)
    if params["model"] == "moge":
        from pixal3d.models.moge import load_moge, load_moge_streamed

        path = cache / "moge-2-vitl" / "model.pt"
        whole, streamed = in_process_memory(load_moge(path)), load_moge_streamed(path, stream)
        image = torch.rand(3, 1024, 1024, generator=g)
        runs = {"whole": lambda: whole.infer(image, use_fp16=False).points,
                "whole_banded": lambda: whole.infer(image, use_fp16=False, band_rows=CAMERA_BAND_ROWS).points,
                "streamed": lambda: streamed.infer(image, use_fp16=False, band_rows=CAMERA_BAND_ROWS).points}
    else:
        from pixal3d.models.dinov3 import (
            extract_tokens,
            load_dinov3,
            load_dinov3_streamed,
        )

        folder = cache / "dinov3-vitl16"
        whole, streamed = in_process_memory(load_dinov3(folder)), load_dinov3_streamed(folder, stream)
        pixels = torch.randn(1, 3, 1024, 1024, generator=g)
        runs = {"whole": lambda: extract_tokens(whole, pixels), "streamed": lambda: extract_tokens(streamed, pixels)}
    times: dict[str, list[float]] = {label: [] for label in runs}
    outputs = {}
    for _ in range(params["repeats"]):
        for label, run in runs.items():
            start = time.perf_counter()
            outputs[label] = run()
            times[label].append(round(time.perf_counter() - start, 2))
    stats = stream.stats.to_dict()
    stream.close()

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    return {"model": params["model"], "times": times,
            "ratio": {k: round(min(v) / min(times["whole"]), 3) for k, v in times.items() if k != "whole"},
            "median_ratio": {k: round(median(v) / median(times["whole"]), 3) for k, v in times.items()
                             if k != "whole"},
            "bitwise_equal": {k: bool(torch.equal(outputs["whole"], v)) for k, v in outputs.items() if k != "whole"},
            "stream": stats, "threads": torch.get_num_threads(), "band_rows": CAMERA_BAND_ROWS}


def ratio_child(params: dict[str, Any]) -> dict[str, Any]:
    """A flow forward at real width, resident (copied) and streamed (copied blocks), alternating: seconds, the
    ratio of the fastest of each, and whether the outputs are bitwise equal."""
    from pixal3d.models.loading import in_process_memory, load_model, load_streamed
    from pixal3d.nn.sparse_tensor import SparseTensor
    from pixal3d.staging import WeightStream
    from scripts.calibrate_working_set import shell_coords

    torch.set_grad_enabled(False)
    stem = Path(params["cache"]) / "ckpts" / "slat_flow_img2shape_dit_1_3B_1024_bf16"
    resident = in_process_memory(load_model(stem))
    stream = WeightStream("cpu", copy=True)
    streamed = load_streamed(stem, stream)
    coords = shell_coords(64, params["tokens"])
    g = torch.Generator().manual_seed(0)
    x = SparseTensor(torch.randn(len(coords), 32, generator=g), coords)
    cond = {"global": torch.randn(1, 4101, 1024, generator=g),
            "proj": SparseTensor(torch.randn(len(coords), resident.proj_channels, generator=g), coords)}
    t = torch.tensor([1000.0])
    times: dict[str, list[float]] = {"resident": [], "streamed": []}
    outputs = {}
    for _ in range(params["repeats"]):
        for label, model in (("resident", resident), ("streamed", streamed)):
            start = time.perf_counter()
            outputs[label] = model(x, t, cond).feats
            times[label].append(round(time.perf_counter() - start, 2))
    stats = stream.stats.to_dict()
    stream.close()
    return {"tokens": len(coords), "blocks": len(resident.blocks), "times": times,
            "ratio": round(min(times["streamed"]) / min(times["resident"]), 3),
            "bitwise_equal": bool(torch.equal(outputs["resident"], outputs["streamed"])), "stream": stats,
            "threads": torch.get_num_threads()}


# -- the whole cascade --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CascadeWork:
    """The reduced work of a whole-cascade run at real widths: the tokens the flows run on, sampler steps, how many
    HR tokens the decoders decode (fp16 on the CPU), the SS decoder's crop."""

    lr_tokens: int = 1024
    hr_tokens: int = 2048
    steps: int = 1
    decode_tokens: int = 48
    ss_decoder_crop: int = 2

    def describe(self) -> str:
        return (f"every stage of the cascade's own classes, real-size random weights, 1 step per flow stage with "
                f"guidance strength 1 (one forward: all 30 blocks), the structure's coords a sphere shell of "
                f"{self.lr_tokens} voxels at 32³ after the SS flow and its decoder (on a {self.ss_decoder_crop}³ corner: "
                f"fp16 conv3d on the CPU), HR coords a shell of {self.hr_tokens} voxels at 64³, both decoders on "
                f"the first {self.decode_tokens} HR tokens, the export on what they decode; field of view fixed")


def cascade_stages(config: Any, work: CascadeWork) -> dict[str, Any]:
    """The cascade's stages with the cuts of ``work`` (``Pixal3D(replace=...)``)."""
    from pipelines.build import build_stages
    from pipelines.decode import DecodeStage
    from pipelines.structure import StructureStage
    from pipelines.upsample import UpsampleStage
    from scripts.bench_memory import _first
    from scripts.calibrate_working_set import shell_coords

    class Structure(StructureStage):
        def run(self, state, models):
            cfg = self.config
            from pipelines.flow_stage import (
                draw_noise,
                extractor,
                sample,
                stage_condition,
            )

            cond = stage_condition(state, models, extractor("ss", cfg.condition, cfg.noise_resolution), None)
            r = cfg.noise_resolution
            state.ss_noise = draw_noise(state.generator, 1, cfg.latent_channels, r, r, r)
            state.ss_latent = sample(models[self.flow_model], state.ss_noise.to(state.device), cond, cfg.sampler,
                                     state=state, stage=self.name)
            crop = work.ss_decoder_crop
            models["sparse_structure_decoder"](state.ss_latent[..., :crop, :crop, :crop])
            state.coords_lr = shell_coords(cfg.coords_resolution, work.lr_tokens).to(state.device)

    class Upsample(UpsampleStage):
        def run(self, state, models):
            models["shape_slat_decoder"].upsample(_first(state.lr_latent, 2), times=self.config.times)
            state.coords_hr = shell_coords(self.config.hr_resolution // 2 ** self.config.times,
                                           work.hr_tokens).to(state.device)
            state.hr_resolution = self.config.hr_resolution

    class Decode(DecodeStage):
        def run(self, state, models):
            state.shape_latent, keep = _first(state.shape_latent, work.decode_tokens), state.shape_latent
            state.tex_latent, keep_tex = _first(state.tex_latent, work.decode_tokens), state.tex_latent
            super().run(state, models)
            state.shape_latent, state.tex_latent = keep, keep_tex

    replaced = {"structure": Structure, "upsample": Upsample, "decode": Decode}
    out = {}
    for stage in build_stages(config):
        out[stage.name] = replaced[stage.name].from_config(config) if stage.name in replaced else stage
    return out


def cascade_child(params: dict[str, Any]) -> dict[str, Any]:
    """The whole cascade once (``Pixal3D``: plan, registry, executor) on ``CascadeWork``; fingerprints, policy,
    per-stage seconds and peaks from the run's own meter, and the anonymous-memory peak."""
    from pipelines import Pixal3D

    torch.set_grad_enabled(False)
    work = CascadeWork(**params.get("work", {}))
    config = bench_config(Path(params["cache"]), steps=work.steps, guidance=False, copied=params["copied"])
    stages = cascade_stages(config, work)
    if params.get("unchecked"):  # the control of the cgroup runs: no refusal from the plan, the kernel's verdict
        import pipelines.plan

        pipelines.plan.check_memory = lambda *args, **kwargs: None
    if params.get("choices_of"):  # the stages as that budget fits them (NAF mode, tiles, chunks), planned without it
        fitted = Pixal3D.plan(config, device="cpu", memory_budget=params["choices_of"], replace=stages)
        stages = {s.name: s for s in fitted.stages}
    plan = Pixal3D.plan(config, device="cpu", policy=params["policy"], memory_budget=params.get("budget"),
                        replace=stages)
    logger.info("plan:\n%s", plan.table())
    start = time.perf_counter()
    with AnonPeak() as anon, Pixal3D.from_plan(plan) as pipe:
        result = pipe.run(REPO / "assets" / "example.png", seed=42)
        stats = pipe._stream.stats.to_dict() if pipe._stream is not None else None
    return {"policy": plan.policy.value, "budget": params.get("budget"), "seconds": round(time.perf_counter() - start),
            "peak_anon": anon.peak, "peak_hwm": _status()["VmHWM"], "fingerprints": result.fingerprints(),
            "stages": [{"stage": r.stage, "seconds": round(r.seconds, 1), "peak": r.peak_process_bytes,
                        "used": r.used} for r in result.stages],
            "glb_bytes": len(result.mesh.glb), "stream": stats, "work": work.describe(), "choices": plan.choices(),
            "threads": torch.get_num_threads()}


# -- cgroups -----------------------------------------------------------------------------------------

class MemoryCgroup:
    """A new memory cgroup limited to ``limit`` bytes (v2 ``memory.max`` when the unified hierarchy has the memory
    controller, else v1 ``memory.limit_in_bytes`` with swap off for it); root only."""

    def __init__(self, name: str, limit: int):
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        if v2.is_file() and "memory" in v2.read_text().split():
            self.version, self.path = 2, Path("/sys/fs/cgroup") / name
        else:
            self.version, self.path = 1, Path("/sys/fs/cgroup/memory") / name
        self.path.mkdir(exist_ok=True)
        if self.version == 2:
            (self.path / "memory.max").write_text(str(limit))
            (self.path / "memory.swap.max").write_text("0")
        else:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            swappiness = self.path / "memory.swappiness"
            if swappiness.exists():
                swappiness.write_text("0")
        self.limit = limit

    def report(self) -> dict[str, Any]:
        """What the kernel counted: the peak, and how many times it killed for memory."""
        if self.version == 2:
            events = dict(line.split() for line in (self.path / "memory.events").read_text().splitlines())
            peak_file = self.path / "memory.peak"
            return {"version": 2, "limit": self.limit, "oom_kill": int(events.get("oom_kill", 0)),
                    "peak": int(peak_file.read_text()) if peak_file.exists() else None}
        control = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
        return {"version": 1, "limit": self.limit, "oom_kill": int(control.get("oom_kill", 0)),
                "peak": int((self.path / "memory.max_usage_in_bytes").read_text()),
                "failcnt": int((self.path / "memory.failcnt").read_text())}

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError as err:
            logger.warning("could not remove %s: %s", self.path, err)


def run_in_cgroup(command: list[str], limit: int, name: str, timeout: float) -> dict[str, Any]:
    """``command`` in a fresh memory cgroup of ``limit`` bytes; its exit status and what the kernel reports."""
    group = MemoryCgroup(name, limit)
    start = time.perf_counter()
    # the shell joins the group, then becomes the command: everything it allocates is charged there
    joined = ["sh", "-c", f'echo $$ > "{group.path / "cgroup.procs"}" && exec "$@"', "sh", *command]
    proc = subprocess.Popen(joined, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    report = {"returncode": proc.returncode, "seconds": round(time.perf_counter() - start),
              "signal": signal.Signals(-proc.returncode).name if proc.returncode < 0 else None,
              "cgroup": group.report(), "stderr_tail": err[-2000:]}
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    report["result"] = json.loads(lines[-1]) if lines else None
    group.remove()
    return report


# -- the parent ----------------------------------------------------------------------------------------

def child(mode: str, params: dict[str, Any], timeout: float) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps([mode, params])]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["log"] = [line for line in proc.stderr.splitlines() if "tiled decode" in line or "export " in line]
    return result


def _save(path: Path | None, data: dict[str, Any]) -> None:
    if path is not None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)


def main(argv: list[str] | None = None) -> None:
    from pixal3d.memory_budget import parse_budget

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", choices=("plan", "stages", "ratio", "cascade", "cgroup"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--fields", type=Path, default=DEFAULT_FIELDS, help="bench_export.py --cache npz (9M voxels)")
    parser.add_argument("--budget", default="4G")
    parser.add_argument("--policy", default="auto")
    parser.add_argument("--only", nargs="*", default=list(STAGES))
    parser.add_argument("--flow-blocks", type=int, default=30)
    parser.add_argument("--decoder-blocks", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--until", help="stages: plan the stages up to this one only (e.g. features)")
    parser.add_argument("--model", choices=("flow", "moge", "dinov3"), default="flow", help="ratio: what to time")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--limit", default="4G", help="cgroup memory limit")
    parser.add_argument("--runs", nargs="*", default=[*CGROUP_RUNS, "resident"],
                        choices=[*CGROUP_RUNS, "resident"], help="cgroup: which runs (default: all)")
    parser.add_argument("--timeout", type=float, default=7200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.child:
        mode, params = json.loads(args.child)
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s",
                            datefmt="%H:%M:%S")
        result = {"stage": lambda: stage_child(params.pop("stage"), params),
                  "ratio": lambda: (ratio_child(params) if params.get("model", "flow") == "flow"
                                    else backbone_ratio_child(params)),
                  "cascade": lambda: cascade_child(params)}[mode]()
        print(json.dumps(result))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    command = " ".join(["python scripts/bench_stream.py", *(argv if argv is not None else sys.argv[1:])])
    data: dict[str, Any] = {"command": command, "torch": torch.__version__, "results": []}
    cache = str(args.cache.expanduser())
    if args.mode == "plan":
        from pipelines import Pixal3D

        plan = Pixal3D.plan(bench_config(args.cache.expanduser(), steps=12), device="cpu", policy=args.policy,
                            memory_budget=args.budget)
        print(plan.table())
        return
    if args.mode == "stages":
        for name in args.only:
            params = {"stage": name, "cache": cache, "budget": args.budget, "budget_bytes": parse_budget(args.budget),
                      "policy": args.policy, "flow_blocks": args.flow_blocks, "decoder_blocks": args.decoder_blocks,
                      "fields": str(args.fields), "until": args.until}
            result = child("stage", params, args.timeout)
            data["results"].append(result)
            logger.info("%s: planned %.2f GiB, peak %.2f GiB (anonymous %.2f, VmHWM %.2f, a forked child %.2f), %s s",
                        name, result["planned_process"] / GIB, result["peak"] / GIB, result["peak_anon"] / GIB,
                        result["peak_hwm"] / GIB, result["peak_children"] / GIB, result["seconds"])
            _save(args.out, data)
    elif args.mode == "ratio":
        data["results"].append(child("ratio", {"cache": cache, "tokens": args.tokens, "repeats": args.repeats,
                                               "model": args.model}, args.timeout))
        _save(args.out, data)
    elif args.mode == "cascade":
        data["results"].append(child("cascade", {"cache": cache, "policy": args.policy, "budget": args.budget,
                                                 "copied": True}, args.timeout))
        _save(args.out, data)
    elif args.mode == "cgroup":
        cgroup_mode(args, data, cache)


CGROUP_RUNS = {
    "budgeted": {"policy": "auto", "budget": None},  # the budget: --budget
    "auto": {"policy": "auto"},  # no budget: auto reads the cgroup's limit as the machine's memory
    "staged": {"policy": "staged"},  # whole models per stage, no budget: the plan refuses what cannot load
    # the control: the same with the plan's refusal turned off, so that the models load and the kernel decides
    "control": {"policy": "staged", "unchecked": True},
}


def cgroup_mode(args: argparse.Namespace, data: dict[str, Any], cache: str) -> None:
    """The runs of ``--runs`` inside a ``--limit`` cgroup, then (``resident`` in them) the comparison outside it.
    With ``--out`` naming an earlier report of this mode, the runs not asked for again are kept from it (one
    report of every run, the ones measured earlier marked with their command)."""
    from pixal3d.memory_budget import parse_budget

    limit = parse_budget(args.limit)
    earlier = json.loads(args.out.read_text()) if args.out is not None and args.out.exists() else {}
    kept = [r for r in earlier.get("results", []) if r.get("label") not in args.runs]
    for report in kept:
        report.setdefault("command", earlier.get("command"))
    data["results"] = kept
    for label in (name for name in CGROUP_RUNS if name in args.runs):
        extra = dict(CGROUP_RUNS[label], **({"budget": args.budget} if label == "budgeted" else {}))
        params = {"cache": cache, "copied": True, **extra}
        command_line = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(["cascade", params])]
        report = run_in_cgroup(command_line, limit, f"pixal3d-bench-{label}", args.timeout)
        report["label"] = label
        data["results"].append(report)
        logger.info("%s: rc %s (%s), cgroup %s", label, report["returncode"], report["signal"], report["cgroup"])
        _save(args.out, data)
    if "resident" not in args.runs:
        for key in ("resident", "choices_equal", "fingerprints_equal"):
            if key in earlier:
                data[key] = earlier[key]
        _save(args.out, data)
        return
    # the budget's stage choices (NAF mode, decode tiles, chunks) with whole models kept loaded and no budget
    # (a resident plan within the budget is refused), outside the cgroup: the streamed run's fingerprints must be these
    resident = child("cascade", {"cache": cache, "policy": "resident", "choices_of": args.budget, "copied": False},
                     args.timeout)
    data["resident"] = resident
    budgeted = next((r.get("result") or {} for r in data["results"] if r["label"] == "budgeted"), {})
    data["choices_equal"] = budgeted.get("choices") == resident["choices"]
    data["fingerprints_equal"] = budgeted.get("fingerprints") == resident["fingerprints"]
    _save(args.out, data)
    logger.info("fingerprints of the budgeted (streamed) run equal the resident run's: %s",
                data["fingerprints_equal"])

if __name__ == "__main__":
    main()
