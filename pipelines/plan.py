"""The memory plan of a cascade run, from safetensors headers and the config (no weight is read).

Weight bytes come from ``pixal3d.hub.planned_sizes`` (safetensors headers, on disk or from the Hub;
file sizes for other formats). The
working set of each stage is estimated from the config's token counts (the reference's typical sizes,
§7.4: ~3.9k LR tokens at 32³, ~20k HR tokens and ~9M decoded voxels at 1024) times bytes per token
measured at real model widths on CPU (``scripts/calibrate_working_set.py``, benchmarks/working_set.md):
a guide for choosing a policy, not a measurement — the memory meter measures.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from pixal3d.config import CascadeConfig
from pixal3d.staging.policy import MemoryPlan

# Working sets measured on CPU at real widths (benchmarks/working_set.md; reproduce with
# `python scripts/calibrate_working_set.py --out benchmarks/working_set.json`). Peak RSS above the
# resident weights and inputs, one fresh process per point; linear fits, rounded up slightly.
_FLOW_BYTES_PER_TOKEN = 36_000        # flow forward, any depth: 0.43/0.55/0.91 GiB at 6k/12k/20k tokens
_FLOW_FIXED_BYTES = 210_000_000       # ... its intercept (chunked attention scores, rope, modulation)
_COND_BYTES_PER_CHANNEL = 2 * 4       # proj condition and its CFG negative, fp32, held while sampling
_DINOV3_BYTES_PER_PATCH = 95_000      # ViT-L/16 forward: 99 MiB at 512 px, 368 MiB at 1024 px
_NAF_BYTES_PER_TOKEN = 22_700         # frugal NAF + projection: 426 MiB at 4k (T=512), 773 MiB at 20k (T=1024)
_NAF_FIXED_BYTES = 355_000_000
_UPSAMPLE_BYTES_PER_LR_TOKEN = 268_000  # shape decoder levels 0-3 on 4096 LR tokens: 1.02 GiB (upper bound)
_DECODE_BYTES_PER_VOXEL = 1_030       # texture decoder 999 B/decoded voxel (fit 65k-1M voxels) + held fields
_DECODE_FIXED_BYTES = 375_000_000
_EXPORT_BYTES_PER_VOXEL = 360         # bench_export: 3.36 GiB at 8M voxels, 4096² texture, 1M faces


def _flow_stage(tokens: float, image_size: int, proj_channels: int, naf: bool) -> float:
    """Peak of a flow stage: the backbone, then NAF (if any), then sampling with the condition held."""
    sampling = tokens * (_FLOW_BYTES_PER_TOKEN + proj_channels * _COND_BYTES_PER_CHANNEL) + _FLOW_FIXED_BYTES
    backbone = (image_size / 16) ** 2 * _DINOV3_BYTES_PER_PATCH
    upsampler = tokens * _NAF_BYTES_PER_TOKEN + _NAF_FIXED_BYTES if naf else 0
    return max(sampling, backbone, upsampler)


def working_set_estimate(config: CascadeConfig) -> dict[str, int]:
    """Stage → working-set bytes beyond the stage's weights (activations, conditioning, mesh buffers),
    from measured bytes per token/voxel (module constants) at the config's token counts."""
    hr_scale = (config.upsample.hr_resolution / 1024) ** 2
    lr_tokens = 0.12 * config.structure.coords_resolution ** 3
    hr_tokens = 20_000 * hr_scale
    voxels = 9e6 * hr_scale
    export = config.export.decimation_target * 200 + config.export.texture_size ** 2 * 4 * 8
    ss_tokens = config.structure.noise_resolution ** 3
    return {
        "structure": int(_flow_stage(ss_tokens, config.structure.condition.image_size, 1024, naf=False)),
        "shape_512": int(_flow_stage(lr_tokens, config.shape_512.condition.image_size, 2048, naf=True)),
        "upsample": int(lr_tokens * _UPSAMPLE_BYTES_PER_LR_TOKEN),
        "shape_1024": int(_flow_stage(hr_tokens, config.shape_1024.condition.image_size, 2048, naf=True)),
        "texture": int(_flow_stage(hr_tokens, config.texture.condition.image_size, 2048, naf=True)),
        "decode": int(voxels * _DECODE_BYTES_PER_VOXEL + _DECODE_FIXED_BYTES),
        "export": int(voxels * _EXPORT_BYTES_PER_VOXEL + export),
    }


def memory_plan(config: CascadeConfig, model_bytes: Mapping[str, int],
                stages: Mapping[str, Sequence[str]]) -> MemoryPlan:
    """Per-stage weights and working-set estimates for ``stages`` (name → needs)."""
    working = {name: bytes_ for name, bytes_ in working_set_estimate(config).items() if name in stages}
    return MemoryPlan.build(model_bytes, stages, working)
