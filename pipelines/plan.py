"""The memory plan of a cascade run, from safetensors headers and the config (no weight is read).

Weight bytes come from each model's file header (``pixal3d.staging.policy``); models stored in other
formats (NAF's ``.pth``, MoGe's ``model.pt``, the rembg ONNX file) count their file size. The
working set of each stage is a coarse estimate from the config's token counts, using the typical
sizes the reference reports (§7.4: ~3.9k LR tokens at 32³, ~20k HR tokens and ~9M decoded voxels at
1024): a guide for choosing a policy, not a measurement — the memory meter measures.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

from pixal3d.config import CascadeConfig
from pixal3d.hub import ResolvedWeights
from pixal3d.staging.policy import MemoryPlan

_FLOW_BYTES_PER_TOKEN = 8192 * 2 * 4   # MLP hidden (bf16) and a few live copies per token
_DECODE_BYTES_PER_VOXEL = 64 * 2 * 8  # last decoder stage (64 ch, fp16) and its live tensors


def working_set_estimate(config: CascadeConfig) -> dict[str, int]:
    """Stage → rough working-set bytes (activations, conditioning, mesh buffers)."""
    hr_scale = (config.upsample.hr_resolution / 1024) ** 2
    lr_tokens = 0.12 * config.structure.coords_resolution ** 3
    hr_tokens = 20_000 * hr_scale
    voxels = 9e6 * hr_scale
    export = config.export.decimation_target * 200 + config.export.texture_size ** 2 * 4 * 8
    return {
        "structure": int(config.structure.noise_resolution ** 3 * _FLOW_BYTES_PER_TOKEN),
        "shape_512": int(lr_tokens * _FLOW_BYTES_PER_TOKEN),
        "upsample": int(lr_tokens * 16 ** 2 * 256 * 2 * 2),
        "shape_1024": int(hr_tokens * _FLOW_BYTES_PER_TOKEN),
        "texture": int(hr_tokens * _FLOW_BYTES_PER_TOKEN),
        "decode": int(voxels * _DECODE_BYTES_PER_VOXEL),
        "export": int(voxels * 64 + export),
    }


def memory_plan(config: CascadeConfig, weights: ResolvedWeights, stages: Mapping[str, Sequence[str]]) -> MemoryPlan:
    """Per-stage weights (from file headers) and working-set estimates for ``stages`` (name → needs)."""
    needed = {m for needs in stages.values() for m in needs}
    safetensors = {name: path for name, path in weights.safetensors().items() if name in needed}
    other: dict[str, int] = {}
    if "naf" in needed and "naf" not in safetensors:
        other["naf"] = weights.naf.stat().st_size
    if "moge" in needed and weights.moge is not None:
        other["moge"] = sum(p.stat().st_size for p in Path(weights.moge).glob("*.pt"))
    if "rembg" in needed:
        other["rembg"] = _rembg_file_size(weights.rembg)
    working = {name: bytes_ for name, bytes_ in working_set_estimate(config).items() if name in stages}
    return MemoryPlan.from_files(safetensors, stages, working, extra_model_bytes=other)


def _rembg_file_size(model_name: str | None) -> int:
    """Size of rembg's cached ONNX model (0 when it has not been downloaded yet)."""
    if model_name is None:
        return 0
    home = Path(os.environ.get("U2NET_HOME", Path.home() / ".u2net"))
    path = home / f"{model_name}.onnx"
    return path.stat().st_size if path.is_file() else 0
