"""The memory plan of a cascade run, from safetensors headers and the config (no weight is read).

Weight bytes come from ``pixal3d.hub.planned_sizes`` (safetensors headers, on disk or from the Hub;
file sizes for other formats). The
working set of each stage is a coarse estimate from the config's token counts, using the typical
sizes the reference reports (§7.4: ~3.9k LR tokens at 32³, ~20k HR tokens and ~9M decoded voxels at
1024): a guide for choosing a policy, not a measurement — the memory meter measures.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from pixal3d.config import CascadeConfig
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


def memory_plan(config: CascadeConfig, model_bytes: Mapping[str, int],
                stages: Mapping[str, Sequence[str]]) -> MemoryPlan:
    """Per-stage weights and working-set estimates for ``stages`` (name → needs)."""
    working = {name: bytes_ for name, bytes_ in working_set_estimate(config).items() if name in stages}
    return MemoryPlan.build(model_bytes, stages, working)
