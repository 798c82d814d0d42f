"""Working-set estimates of the cascade's stages: bytes a stage needs beyond its models' weights.

The per-token and per-voxel costs are measured on CPU at the released models' widths, whole stage at the
reference's counts (``pixal3d.memory_budget``; ``scripts/bench_full_work.py``, benchmarks/full_work.md).
Token counts come from the config: ~12 % of the coords grid occupied at LR (3.9k tokens at 32³), ~20k HR
tokens at 1024, scaled with the area of the decode resolution, and ~4.6 decoded voxels per voxel per
decoder level (20k tokens → ~9M voxels). A guide for the plan, not a measurement: the meter measures.
Each stage calls these from its own ``working_set()``.
"""
from __future__ import annotations

from pixal3d.memory_budget import (
    DECODE_COSTS,
    DINOV3_BYTES_PER_PATCH,
    FLOW_BYTES_PER_TOKEN,
    FLOW_FIXED_BYTES,
    REFERENCE_GROWTH,
    STRUCTURE_BYTES,
    UPSAMPLE_BYTES_PER_VOXEL,
    decoded_voxels,
    export_estimate,
)
from pixal3d.models.conditioning import naf_peak_bytes
from pixal3d.nn.attention import fp32_chunked_scratch_bytes

LR_OCCUPANCY = 0.12                   # occupied fraction of the coords grid
HR_TOKENS_AT_1024 = 20_000
FLOW_HEADS, FLOW_HEAD_DIM = 12, 128   # every released flow model (1536 channels; checkpoints.json)
DINOV3_WIDTH = 1024                   # ViT-L/16's token width


def lr_tokens(coords_resolution: int) -> int:
    """Typical LR token count on a ``coords_resolution``³ grid."""
    return int(LR_OCCUPANCY * coords_resolution ** 3)


def hr_tokens(hr_resolution: int) -> int:
    """Typical HR token count: ~20k at 1024, with the area of the decode resolution."""
    return int(HR_TOKENS_AT_1024 * (hr_resolution / 1024) ** 2)


def structure_bytes(noise_resolution: int, *, views: int = 1, image_size: int = 512) -> int:
    """The structure stage (the dense flow with CFG, the structure decoder); with several posed views, what they
    hold (``views_extra_bytes``) on top."""
    base = STRUCTURE_BYTES * max(1.0, noise_resolution ** 3 / 16 ** 3)
    return int(base + views_extra_bytes(views, noise_resolution ** 3, image_size, naf=False))


def flow_stage_bytes(tokens: int, image_size: int, *, naf_size: int | None, naf_mode: str, views: int = 1) -> int:
    """A sparse flow stage: the measured whole-stage line (frugal NAF, sampling with the condition and its CFG
    negative held; measured with the backbone's forward in the stage, which now runs in the features stage),
    or NAF's ``full`` mode if that is larger (it runs before the sampling, its maps freed when it ends). ``views`` > 1 (the multi-view cascade): the views' tokens ride
    along and one view's projected features are held while they are added to the sum (``views_extra_bytes``)."""
    stage = tokens * FLOW_BYTES_PER_TOKEN + FLOW_FIXED_BYTES + views_extra_bytes(views, tokens, image_size,
                                                                                  naf=naf_size is not None)
    naf = naf_peak_bytes("full", image_size, naf_size, points=tokens) if naf_size and naf_mode == "full" else 0
    return int(max(stage, naf))


def features_bytes(sizes: tuple[int, ...], *, width: int = DINOV3_WIDTH, patch: int = 16, views: int = 1) -> int:
    """The features stage: DINOv3's forward at the largest size (``DINOV3_BYTES_PER_PATCH``), beside the tokens
    and guide images of every size it keeps (fp32); ``views`` posed views go through it as one batch (the
    reference's), so both grow with them."""
    kept = sum((5 + (s // patch) ** 2) * width * 4 + 3 * s * s * 4 for s in sizes)
    forward = max(((s / patch) ** 2 * DINOV3_BYTES_PER_PATCH for s in sizes), default=0)
    return int(views * (forward + kept))


def views_extra_bytes(views: int, points: int, image_size: int, *, naf: bool, width: int = DINOV3_WIDTH) -> int:
    """What conditioning on ``views`` posed views holds beyond one image's: every view's tokens (fp32, at the
    released backbone's ``width``; kept from the features stage) and, from the second view on, one view's
    projected features at ``points`` (``width``, doubled with NAF) while it is added to the sum. 0 for one view."""
    if views <= 1:
        return 0
    tokens = views * int((image_size / 16) ** 2 + 5) * width * 4
    return tokens + points * width * (2 if naf else 1) * 4


def upsample_bytes(coords_resolution: int, times: int) -> int:
    """The shape decoder's subdivision levels over the LR tokens (its last level's voxels set the peak)."""
    return int(UPSAMPLE_BYTES_PER_VOXEL * lr_tokens(coords_resolution) * REFERENCE_GROWTH ** max(0, times - 1))


def decode_bytes(hr_resolution: int, times: int) -> int:
    """Both decoders over the decoded voxels, untiled, their outputs held."""
    voxels = decoded_voxels(hr_tokens(hr_resolution), times)
    return int(DECODE_COSTS.fixed_bytes + (DECODE_COSTS.voxel_bytes + DECODE_COSTS.output_bytes) * voxels)


def export_bytes(hr_resolution: int, times: int, decimation_target: int, texture_size: int, *,
                 normal_map: bool = False, occlusion_map: bool = False, forked: bool = True) -> int:
    """Mesh extraction, simplification and the baked textures, with the shading maps asked for
    (``memory_budget.export_estimate``: the larger of the export's measured line, with the slab remesh's
    workers ``forked`` or its slabs one at a time, and the bake with its maps)."""
    return export_estimate(decoded_voxels(hr_tokens(hr_resolution), times), decimation_target, texture_size,
                           normal_map=normal_map, occlusion_map=occlusion_map, forked=forked)


def attention_route_bytes(route: str, tokens: int, score_elements: int) -> int:
    """Scratch of one self-attention over ``tokens`` on the resolved ``route`` beyond the measured stage
    lines (made with ``sdpa``): the ``fp32_chunked`` route's fp32 copies and chunks (``score_elements``
    scores a chunk); 0 for ``sdpa``."""
    if route != "fp32_chunked":
        return 0
    return fp32_chunked_scratch_bytes(1, FLOW_HEADS, tokens, tokens, FLOW_HEAD_DIM, budget=score_elements)


ENCODE_BYTES_PER_VOXEL = 1536
"""The shape encoder's working set per voxel of the mesh's 1024 grid, whole (its first level sets the peak): 1.45 KB
measured at its released width on 100k voxels (``scripts/bench_mesh_encode.py``, benchmarks/mesh_encode.json)."""
ENCODE_HELD_BYTES_PER_VOXEL = 31 + 24   # the dual grid the stage holds (coords, offsets, flags, split) and its input
ENCODE_LEVEL_SHRINK = 4.0               # voxels per voxel one level down, on a surface (100k -> 368 tokens: 4.07)
ENCODE_WIDTHS = (64, 128, 256, 512, 1024)  # the released encoder's channels per level


def mesh_encode_bytes(hr_resolution: int, times: int, levels: int = 0, tile_voxels: int = 0, radius: int = 0) -> int:
    """``mesh_encode``'s working set at the reference's voxel count (the decode's: ~9M at 1024): the whole encoder
    (``levels`` 0), or its first ``levels`` stages over tiles of ``tile_voxels`` (their halo ``radius`` on a surface
    patch's border) and the rest whole with its blocks' MLPs in row chunks (~12 bytes per channel per voxel there,
    beside the folded outputs the tiles left, 4 bytes per channel)."""
    voxels = decoded_voxels(hr_tokens(hr_resolution), times)
    held = ENCODE_HELD_BYTES_PER_VOXEL * voxels
    if levels == 0:
        return int(held + ENCODE_BYTES_PER_VOXEL * voxels)
    side = (tile_voxels / 1.6) ** 0.5  # a surface patch of that many voxels, and its halo band
    head = ENCODE_BYTES_PER_VOXEL * tile_voxels * ((side + 2 * radius) / side) ** 2
    width = ENCODE_WIDTHS[min(levels, len(ENCODE_WIDTHS) - 1)]
    tail = (12 + 4) * width * voxels / ENCODE_LEVEL_SHRINK ** levels
    return int(held + max(head, tail))
