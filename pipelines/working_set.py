"""Working-set estimates of the cascade's stages: bytes a stage needs beyond its models' weights.

Measured on CPU at real model widths (benchmarks/working_set.md; reproduce with
``python scripts/calibrate_working_set.py --out benchmarks/working_set.json``): peak RSS above the resident
weights and inputs, one fresh process per point, linear fits rounded up slightly. Token counts are the
reference's typical sizes (§7.4): ~12 % of the coords grid occupied at LR (3.9k tokens at 32³), ~20k HR
tokens and ~9M decoded voxels at 1024, scaled with the area of the decode resolution. A guide for
choosing a policy, not a measurement: the memory meter measures. Each stage calls these from its own
``working_set()``.
"""
from __future__ import annotations

FLOW_BYTES_PER_TOKEN = 36_000         # flow forward, any depth: 0.43/0.55/0.91 GiB at 6k/12k/20k tokens
FLOW_FIXED_BYTES = 210_000_000        # ... its intercept (chunked attention scores, rope, modulation)
COND_BYTES_PER_CHANNEL = 2 * 4        # proj condition and its CFG negative, fp32, held while sampling
DINOV3_BYTES_PER_PATCH = 95_000       # ViT-L/16 forward: 99 MiB at 512 px, 368 MiB at 1024 px
NAF_BYTES_PER_TOKEN = 22_700          # frugal NAF + projection: 426 MiB at 4k (T=512), 773 MiB at 20k (T=1024)
NAF_FIXED_BYTES = 355_000_000
UPSAMPLE_BYTES_PER_LR_TOKEN = 268_000  # shape decoder levels 0-3 on 4096 LR tokens: 1.02 GiB (upper bound)
DECODE_BYTES_PER_VOXEL = 1_030        # texture decoder 999 B/decoded voxel (fit 65k-1M voxels) + held fields
DECODE_FIXED_BYTES = 375_000_000
EXPORT_BYTES_PER_VOXEL = 360          # bench_export: 3.36 GiB at 8M voxels, 4096² texture, 1M faces

LR_OCCUPANCY = 0.12                   # occupied fraction of the coords grid
HR_TOKENS_AT_1024 = 20_000
VOXELS_AT_1024 = 9e6


def lr_tokens(coords_resolution: int) -> float:
    """Typical LR token count on a ``coords_resolution``³ grid."""
    return LR_OCCUPANCY * coords_resolution ** 3


def hr_scale(hr_resolution: int) -> float:
    """HR tokens and decoded voxels scale with the area of the decode resolution."""
    return (hr_resolution / 1024) ** 2


def flow_stage_bytes(tokens: float, image_size: int, proj_channels: int, *, naf: bool) -> int:
    """Peak of a flow stage: the backbone, then NAF (if any), then sampling with the condition held."""
    sampling = tokens * (FLOW_BYTES_PER_TOKEN + proj_channels * COND_BYTES_PER_CHANNEL) + FLOW_FIXED_BYTES
    backbone = (image_size / 16) ** 2 * DINOV3_BYTES_PER_PATCH
    upsampler = tokens * NAF_BYTES_PER_TOKEN + NAF_FIXED_BYTES if naf else 0
    return int(max(sampling, backbone, upsampler))


def hr_flow_stage_bytes(hr_resolution: int, image_size: int) -> int:
    """A flow stage on the HR tokens (shape 1024, texture): NAF conditioning at 2 × 1024 channels."""
    return flow_stage_bytes(HR_TOKENS_AT_1024 * hr_scale(hr_resolution), image_size, 2048, naf=True)


def upsample_bytes(coords_resolution: int) -> int:
    """The shape decoder's subdivision levels over the LR tokens."""
    return int(lr_tokens(coords_resolution) * UPSAMPLE_BYTES_PER_LR_TOKEN)


def decode_bytes(hr_resolution: int) -> int:
    """Both decoders over the decoded voxels, fields held."""
    return int(VOXELS_AT_1024 * hr_scale(hr_resolution) * DECODE_BYTES_PER_VOXEL + DECODE_FIXED_BYTES)


def export_bytes(hr_resolution: int, decimation_target: int, texture_size: int) -> int:
    """Mesh extraction, simplification and the baked textures."""
    voxels = VOXELS_AT_1024 * hr_scale(hr_resolution)
    return int(voxels * EXPORT_BYTES_PER_VOXEL + decimation_target * 200 + texture_size ** 2 * 4 * 8)
