"""A memory budget per stage: what each stage's work needs at real widths, and the tile and chunk sizes
that keep it within a budget of process memory — or one clear error, before any load, when nothing can.

Everything here is a pure function of numbers (bytes, token and voxel counts) and of constants measured
at the released models' widths on the CPU (``scripts/bench_full_work.py``, benchmarks/full_work.md):

- ``working_sets(counts)``: per-stage bytes beyond the weights, at the given counts (for the plan);
- ``plan_decode(budget, ...)``: untiled when the decode fits, else the ``TilePlan`` (start level, voxels
  per tile) that does; ``MemoryBudgetError`` when even the smallest tile cannot;
- ``attention_score_elements`` / ``naf_chunk_elements``: chunk sizes of the two chunked kernels for the
  bytes left (the stage runs with them: ``pixal3d.nn.limits``);
- ``parse_budget("8G")``: binary units (G = GiB).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config import SettingError

if TYPE_CHECKING:
    from .models.decoder_tiling import TilePlan

GIB = 2**30
MIB = 2**20

# -- measured constants (benchmarks/full_work.md; CPU, torch 2.13, real widths) -----------------------------

ARRAY_MARGIN = 0.9  # a planned tensor stays a tenth below the device's array limit (clear of its edge)
PROCESS_BYTES = 450 * MIB  # interpreter + torch + transformers before any load (0.39-0.45 GiB measured)
REFERENCE_GROWTH = 4.6  # decoded voxels per voxel per decoder level: ~20k latent tokens -> ~9M voxels

# Flow stages, whole stage (backbone, NAF + projection, then sampling with the condition and its CFG
# negative held): linear in tokens through shape_512 at 4000 tokens (0.56 GiB) and shape_1024 at 20000
# (1.53 GiB; texture 1.37 GiB). The forward alone (any depth) is ~36 kB/token + 210 MB.
FLOW_BYTES_PER_TOKEN = 65_000
FLOW_FIXED_BYTES = 345_000_000
FLOW_FORWARD_BYTES_PER_TOKEN = 36_000  # one forward (the part the attention chunks sit in)
FLOW_FORWARD_FIXED_BYTES = 210_000_000
COND_BYTES_PER_CHANNEL = 2 * 4  # the proj condition and its CFG negative, fp32, held while sampling
DINOV3_BYTES_PER_PATCH = 95_000  # ViT-L/16 forward
NAF_BYTES_PER_TOKEN = 22_700  # frugal NAF + projection
NAF_FIXED_BYTES = 355_000_000
STRUCTURE_BYTES = 600_000_000  # structure stage at 16³ dense tokens: 0.42 GiB measured (DINOv3 512, SS flow, SS decoder)
UPSAMPLE_BYTES_PER_VOXEL = 3_300  # per level-3 voxel: the 128-channel blocks of the last level it runs
# MoGe-2 ViT-L infer (3600 tokens whatever the image size; benchmarks/camera.md, 518 and 1126 px): 1.39-1.44 GiB
# in float32; 2.00 GiB under float16 autocast, which keeps a float16 copy of the weights beside them
CAMERA_FLOAT32_BYTES = 1_650_000_000
CAMERA_FLOAT16_BYTES = 2_300_000_000
CAMERA_MEASURED_WEIGHT_BYTES = 1_304_836_908  # the released model.pt's tensors, the model those figures are of
# The same in float32 with the conv neck's and heads' 3×3 convs in row bands of CAMERA_BAND_ROWS (the same bits),
# its ViT blocks streamed: 1.13e9 and 1.31e9 bytes of anonymous memory over the stage's start at its peak in two
# runs (in the heads, no block in flight; glibc's heap is what varies), 1024² image (benchmarks/stream.md,
# bench_stream.py stages --only camera), the larger + 11 %
CAMERA_BAND_ROWS = 64
CAMERA_FLOAT32_BANDED_BYTES = 1_450_000_000


@dataclass(frozen=True)
class DecodeCosts:
    """Memory of the two decoders (shape + texture, released widths), per voxel; 9M-voxel decode measured.

    ``voxel_bytes``: working set per final-level voxel computed at once (the last C2S block and the head,
    both decoders, the shape output held while the texture decoder runs; 8.15 / 8.61 GiB at 8.96M voxels);
    ``fixed_bytes``: its intercept; ``output_bytes``: per decoded voxel kept (fields + PBR, and the raw
    outputs while a tiled decode reorders them); ``level_bytes``: peak of untiled stage ``i`` per voxel it
    produces (level ``i+1``; measured 7.7 / 3.7 / 1.9 / 0.98 kB, rounded up); ``channels``: the width of
    each level (the prefix's output is held as ``channels[s]`` bf16 values per voxel per decoder).
    """

    voxel_bytes: float = 1_030.0
    fixed_bytes: int = 200_000_000
    output_bytes: float = 140.0
    level_bytes: tuple[float, ...] = (9_300.0, 4_500.0, 2_300.0, 1_030.0)
    channels: tuple[int, ...] = (1024, 512, 256, 128, 64)

    def largest_tensor_bytes(self, level: int, levels: int) -> float:
        """Bytes per level-``level`` voxel of the largest single tensor that level makes: a ConvNeXt MLP's
        hidden features (4·C fp16), the C2S convolution's output (8·C_next fp16) or, at the last level, the
        head's fp32 input (benchmarks/mps_audit.md shows these rows at real size)."""
        if level == levels:
            return 4.0 * self.channels[level]
        return max(2 * 4.0 * self.channels[level], 2 * 8.0 * self.channels[level + 1])


DECODE_COSTS = DecodeCosts()
# CPU exporter, fields + PBR voxels in: 9.0M voxels -> 1M faces, 4096², remesh (the release setting), measured
# 3.41 GiB process peak above a 0.23 GiB interpreter with the simplifier in a child process (benchmarks/stream.md);
# 360 B before that (its retained buffers under the bake)
# Since the slab remesh (remesh_slabs.py, its workers forked): the group's anonymous memory peaked at 3.31 GiB in a
# 3800 MiB cgroup, the exporting process at 3.19 GiB in the bake (benchmarks/export_speed.md): still under this line.
# Since the export's steps were lightened (3c4a8a7+) the exporting process peaks at 2.42 GiB at 9M voxels, but this
# line stays: the slab remesh's two forked workers add their own memory to the process group, which was killed for
# memory in the remesh in 2600, 2734 and 3400 MiB cgroups (total_rss sampled at 2.43, 2.65 and 3.25 GiB;
# benchmarks/export_speed.md, "Memory at 9M voxels"). Since the remesh runs in a child and its steps were lightened
# (1210c11..76c1b67) the group peaks at 2.65 GiB with two forked workers (the remesh; 2.37 above the bench's 0.28 GiB
# interpreter, 201 B per voxel beside the face and texel terms): 210 counted (two slabs in flight vary more than one).
# Where it does not fit, the plan runs the slabs one at a time (below).
EXPORT_BYTES_PER_VOXEL = 210
# With the slab remesh's slabs one at a time (``ExportSettings.workers = 1``, what the plan sets when the line above
# does not fit: the remesh in a child process, each slab in a child of its own), at 9.0M voxels -> 1M faces, 4096²,
# the group's anonymous memory peaked at 2.29 GiB in the remesh (the bake 2.19, the metrics 1.97), 2.01 above the
# bench's 0.28 GiB interpreter (scripts/bench_export_cgroup.py --workers 1; benchmarks/export_speed.md): 158 B per
# voxel beside the face and texel terms, 160 counted. With PROCESS_BYTES (0.44 GiB, the bench's interpreter is 0.28)
# the plan's row is 2.47 GiB against the 2.29 measured.
EXPORT_SERIAL_BYTES_PER_VOXEL = 160
EXPORT_BYTES_PER_FACE = 200
EXPORT_BYTES_PER_TEXEL = 32
# The bake step's own peak with the shading maps (issue 46), counted from its structures (not yet measured at 9M
# voxels): the reference mesh (a float32 vertex and two int32 faces per voxel, 36 B) and the PBR voxels' brick
# index and attributes (~40 B), plus the normal map's field of the decoded surface (a float32 normal per voxel, on the
# reference's vertices and on the PBR voxels' rows, and an index per voxel, ~32 B); per texel the textures as before (32 B) plus the normal image and its gutter fill's
# nearest-texel indices (11 B); the occlusion grid (<= 256³ bools). The export's estimate is the larger of the
# measured line above (the simplifier's peak) and this one: at the release settings the simplifier's is larger.
EXPORT_BAKE_BYTES_PER_VOXEL = 76
EXPORT_MAPS_BYTES_PER_VOXEL = 32
EXPORT_MAPS_BYTES_PER_TEXEL = 11
EXPORT_OCCLUSION_BYTES = 256**3


def export_estimate(voxels: float, faces: int, texture_size: int, *, normal_map: bool, occlusion_map: bool,
                    forked: bool = True) -> int:
    """The export's working set: the larger of its measured line (the slab remesh's workers ``forked``, or its slabs
    one at a time) and the bake step with its maps."""
    texels = texture_size ** 2
    per_voxel = EXPORT_BYTES_PER_VOXEL if forked else EXPORT_SERIAL_BYTES_PER_VOXEL
    whole = voxels * per_voxel + faces * EXPORT_BYTES_PER_FACE + texels * EXPORT_BYTES_PER_TEXEL
    bake = (voxels * (EXPORT_BAKE_BYTES_PER_VOXEL + (EXPORT_MAPS_BYTES_PER_VOXEL if normal_map else 0))
            + faces * EXPORT_BYTES_PER_FACE + texels * (EXPORT_BYTES_PER_TEXEL + (EXPORT_MAPS_BYTES_PER_TEXEL
                                                                                  if normal_map else 0))
            + (EXPORT_OCCLUSION_BYTES if occlusion_map else 0))
    return int(max(whole, bake))


class MemoryBudgetError(ValueError):
    """A stage cannot run within the memory budget, whatever its tiles or chunks: ``stage`` names it, ``need`` is
    the process memory it needs at least (bytes), ``smallest`` the smallest budget the whole cascade plans within
    when the plan found it (else None)."""

    def __init__(self, message: str, *, stage: str = "", need: float = 0, smallest: int | None = None):
        super().__init__(message)
        self.stage, self.need, self.smallest = stage, need, smallest


_SHOWN_UNITS = (("TiB", 2**40, 2), ("GiB", GIB, 2), ("MiB", MIB, 1), ("KiB", 2**10, 1))


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit it reaches, so every size shows (``1.0 KiB``, ``450.0 MiB``,
    ``2.00 GiB``; ``512 B``), never a ``0.00 GiB`` that hides a kilobyte."""
    for unit, size, decimals in _SHOWN_UNITS:
        if abs(n) >= size:
            return f"{n / size:.{decimals}f} {unit}"
    return f"{int(n)} B"


def format_apart(larger: float, smaller: float) -> tuple[str, str]:
    """A need (``larger`` bytes, rounded up as the smallest budget is: a need is never shown below itself) and a
    budget (``smaller``, shown as ``format_bytes`` shows it), with more digits where they would read alike
    (``3.80 GiB`` against ``3.79 GiB``, not ``3.79 GiB`` twice for 3.7949 and 3.79)."""
    for unit, size, decimals in _SHOWN_UNITS:
        if abs(larger) >= size:
            break
    else:
        return format_bytes(larger), format_bytes(smaller)
    shown = format_bytes(smaller)
    for digits in range(decimals, decimals + 5):
        need = f"{math.ceil(larger / size * 10**digits) / 10**digits:.{digits}f} {unit}"
        if need != shown:
            return need, shown
        shown = f"{math.floor(smaller / size * 10**(digits + 1)) / 10**(digits + 1):.{digits + 1}f} {unit}"
    return need, shown


def budget_error(stage: str, need: float, budget: int, detail: str) -> MemoryBudgetError:
    """The one-line refusal: the stage, what the process needs at least for it (``need`` bytes of models and
    work, and the interpreter), the budget, and what to change. The need is rounded up, as the smallest budget
    is, with the digits that tell it from the budget (``format_apart``): a need shown equal to the budget reads
    as a refusal of what fits."""
    shown_need, shown_budget = format_apart(PROCESS_BYTES + need, budget)
    return MemoryBudgetError(f"stage {stage!r} needs at least {shown_need} ({detail}) but "
                             f"the memory budget is {shown_budget}; raise memory_budget or use a smaller "
                             f"config", stage=stage, need=PROCESS_BYTES + need)


_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": MIB, "MB": MIB, "MIB": MIB,
          "G": GIB, "GB": GIB, "GIB": GIB, "T": 2**40, "TB": 2**40, "TIB": 2**40}


def models_and_work(budget: int) -> int:
    """What a process budget leaves for models and work: the budget less the interpreter (``PROCESS_BYTES``;
    negative when not even the interpreter fits). The one place the interpreter is taken off a budget."""
    return budget - PROCESS_BYTES


def parse_budget(text: str | int) -> int:
    """``"8G"``, ``"8GiB"``, ``"7.5G"``, ``"6000M"`` or a byte count -> bytes (binary units: G = 2**30). A
    lower-case ``b`` is bits by convention (``8Gb`` = 1 GiB): refused with the spelling meant, not guessed."""
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise SettingError("memory_budget", f"memory budget {text!r} is not a size; write e.g. 8G, 7.5GiB or "
                                            f"6000M (a string), or a number of bytes")
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise SettingError("memory_budget", f"memory budget {text!r} is not a size; write e.g. 8G, 7.5GiB or "
                                                f"6000M")
        if match.group(2).endswith("b"):
            prefix = match.group(2)[:-1].upper()
            meant = match.group(1) + (prefix[0] + "iB" if prefix.endswith("I") else prefix + "B")
            raise SettingError("memory_budget", f"memory budget {text!r} ends in a lower-case b, which means bits; "
                                                f"sizes are in bytes: write {meant!r} (or {meant[:-1]!r})")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise SettingError("memory_budget", f"memory budget {text!r} must be positive")
    return value


# -- the decode -------------------------------------------------------------------------------------

def decoded_voxels(latent_tokens: int, levels: int = 4, growth: float = REFERENCE_GROWTH) -> float:
    return latent_tokens * growth ** levels


def _prefix_held(start: int, voxels_at: list[float], costs: DecodeCosts) -> float:
    """The untiled prefix's output, held for the tiles: level-``start`` features of both decoders, bf16."""
    return 0.0 if start == 0 else 2 * 2 * costs.channels[start] * voxels_at[start]


def decode_largest_tensor(latent_tokens: float, *, levels: int = 4, growth: float = REFERENCE_GROWTH,
                          costs: DecodeCosts = DECODE_COSTS, start: int = 0) -> float:
    """Bytes of the largest single tensor of the decode's levels ``start..levels`` (all of them: untiled)."""
    return max(costs.largest_tensor_bytes(i, levels) * latent_tokens * growth ** i for i in range(start, levels + 1))


def plan_decode(budget: int, *, latent_tokens: int, weight_bytes: int, levels: int = 4,
                growth: float = REFERENCE_GROWTH, costs: DecodeCosts = DECODE_COSTS,
                min_tile_voxels: int = 64, array_bytes: int | None = None) -> TilePlan | None:
    """The decode's ``TilePlan`` within ``budget`` bytes of process memory, or None when untiled fits.

    The deepest start level whose untiled prefix fits is chosen (the halo then costs least), and the
    largest tile that fits beside the weights, the outputs and the prefix's held features. ``array_bytes``
    (the device's largest single tensor: MPSGraph's 2**32 bytes on mps) also bounds every tensor of the
    prefix and of a tile (``decode_largest_tensor``). Raises ``MemoryBudgetError`` when no start level
    leaves room for a tile of ``min_tile_voxels`` start-level voxels.
    """
    from .models.decoder_tiling import TilePlan

    limit = models_and_work(budget)
    voxels_at = [latent_tokens * growth ** i for i in range(levels + 1)]
    held = weight_bytes + costs.output_bytes * voxels_at[levels]
    fits_arrays = array_bytes is None or decode_largest_tensor(
        latent_tokens, levels=levels, growth=growth, costs=costs) <= ARRAY_MARGIN * array_bytes
    if fits_arrays and held + costs.fixed_bytes + costs.voxel_bytes * voxels_at[levels] <= limit:
        return None
    smallest_need = math.inf
    for start in range(levels - 1, -1, -1):
        prefix_peak = max((costs.level_bytes[i] * voxels_at[i + 1] for i in range(start)), default=0.0)
        keep = _prefix_held(start, voxels_at, costs)
        room = limit - held - keep - costs.fixed_bytes
        smallest = min_tile_voxels * growth ** (levels - start)
        need = max(held + keep + costs.fixed_bytes + costs.voxel_bytes * smallest, weight_bytes + prefix_peak)
        smallest_need = min(smallest_need, need)
        if weight_bytes + prefix_peak > limit or room < costs.voxel_bytes * smallest:
            continue
        tile_voxels = room / costs.voxel_bytes
        if array_bytes is not None:  # the prefix's levels whole, a tile's levels within the array limit
            prefix = max((costs.largest_tensor_bytes(i, levels) * voxels_at[i] for i in range(start)), default=0.0)
            per_final = decode_largest_tensor(growth ** -levels, levels=levels, growth=growth, costs=costs,
                                              start=start)
            cap = ARRAY_MARGIN * array_bytes / per_final
            if prefix > ARRAY_MARGIN * array_bytes or cap < smallest:
                continue
            tile_voxels = min(tile_voxels, cap)
        return TilePlan(start_level=start, tile_voxels=int(tile_voxels), growth=growth)
    raise budget_error("decode", smallest_need, budget,
                       f"decoder weights {format_bytes(weight_bytes)}, ~{voxels_at[levels] / 1e6:.1f}M decoded voxels "
                       f"held at {costs.output_bytes:.0f} B each, and the smallest tile")


# -- chunked kernels ----------------------------------------------------------------------------------

ATTENTION_SCORE_COPIES = 3  # scores, softmax output, and the fp32 upcast on CPU/MPS math paths
NAF_CHUNK_COPIES = 3  # gathered keys and values, and the product


def attention_score_elements(free_bytes: float, *, element_size: int = 4, default: int = 1 << 26,
                             floor: int = 1 << 20) -> int:
    """Score elements per attention query chunk for ``free_bytes`` of working memory (default when it fits)."""
    if free_bytes >= default * ATTENTION_SCORE_COPIES * element_size:
        return default
    return max(floor, int(free_bytes // (ATTENTION_SCORE_COPIES * element_size)))


def naf_chunk_elements(free_bytes: float, *, element_size: int = 4, default: int = 1 << 23,
                       floor: int = 1 << 18) -> int:
    """Gathered value elements per NAF attention chunk for ``free_bytes`` of working memory."""
    if free_bytes >= default * NAF_CHUNK_COPIES * element_size:
        return default
    return max(floor, int(free_bytes // (NAF_CHUNK_COPIES * element_size)))


@dataclass(frozen=True)
class FlowChunks:
    """Chunk sizes of a flow stage's two chunked kernels (run with them: ``pixal3d.nn.limits.kernel_limits``)."""

    attention_scores: int
    naf_elements: int


def plan_flow_stage(stage: str, budget: int, *, weight_bytes: int, tokens: int, naf: bool = True) -> FlowChunks:
    """Chunk sizes that keep a flow stage (conditioning, then sampling, the CFG branches one after the
    other) within ``budget``; ``MemoryBudgetError`` when even the smallest chunks do not fit.

    The measured working sets include the default chunks; when they do not fit, the chunks shrink by what
    is missing (the per-token activations of a forward are not chunked: they set the floor).
    """
    default_scores, default_naf = attention_score_elements(math.inf), naf_chunk_elements(math.inf)
    per_token = FLOW_BYTES_PER_TOKEN  # the whole stage's line (the condition and its negative included)
    work = models_and_work(budget) - weight_bytes
    sampling_left = work - tokens * per_token - FLOW_FIXED_BYTES
    scores = attention_score_elements(ATTENTION_SCORE_COPIES * 2 * default_scores + sampling_left, element_size=2)
    naf_left = work - tokens * NAF_BYTES_PER_TOKEN - NAF_FIXED_BYTES if naf else math.inf
    elements = naf_chunk_elements(NAF_CHUNK_COPIES * 4 * default_naf + naf_left)
    short_scores = ATTENTION_SCORE_COPIES * 2 * (default_scores - attention_score_elements(0, element_size=2))
    short_naf = NAF_CHUNK_COPIES * 4 * (default_naf - naf_chunk_elements(0))
    if sampling_left + short_scores < 0 or naf_left + short_naf < 0:
        need = weight_bytes + max(tokens * per_token + FLOW_FIXED_BYTES - short_scores,
                                  tokens * NAF_BYTES_PER_TOKEN + NAF_FIXED_BYTES - short_naf if naf else 0)
        raise budget_error(stage, need, budget, f"weights {format_bytes(weight_bytes)} and {tokens} tokens at "
                                                f"{per_token / 1e3:.0f} kB each with the smallest chunks")
    return FlowChunks(attention_scores=scores, naf_elements=elements)


# -- per-stage estimates --------------------------------------------------------------------------------

@dataclass(frozen=True)
class StageCounts:
    """The sizes a cascade config implies (reference 1024 cascade by default)."""

    ss_tokens: int = 16**3
    lr_tokens: int = 4000
    hr_tokens: int = 20_000
    decoder_levels: int = 4
    structure_image: int = 512
    shape_512_image: int = 512
    shape_1024_image: int = 1024
    texture_image: int = 1024
    export_faces: int = 1_000_000
    texture_size: int = 4096

    @property
    def decoded_voxels(self) -> float:
        return decoded_voxels(self.hr_tokens, self.decoder_levels)


def _flow_stage(tokens: float) -> float:
    """A sparse flow stage: the measured whole-stage line (DINOv3 runs in the features stage)."""
    return tokens * FLOW_BYTES_PER_TOKEN + FLOW_FIXED_BYTES


def working_sets(counts: StageCounts = StageCounts(), *, budget: int | None = None,
                 decoder_weight_bytes: int = 0) -> dict[str, int]:
    """Stage -> bytes of working memory beyond its weights, at ``counts``. With ``budget`` the decode's
    figure is that of its tiled plan (at most what is left of the budget after the weights)."""
    voxels = counts.decoded_voxels
    upsample_voxels = counts.lr_tokens * REFERENCE_GROWTH ** counts.decoder_levels
    decode = DECODE_COSTS.fixed_bytes + (DECODE_COSTS.voxel_bytes + DECODE_COSTS.output_bytes) * voxels
    if budget is not None:
        plan = plan_decode(budget, latent_tokens=counts.hr_tokens, weight_bytes=decoder_weight_bytes,
                           levels=counts.decoder_levels)
        if plan is not None:
            decode = models_and_work(budget) - decoder_weight_bytes
    export = export_estimate(voxels, counts.export_faces, counts.texture_size, normal_map=True,
                             occlusion_map=True)  # the release config bakes both maps
    return {
        "structure": int(STRUCTURE_BYTES * max(1.0, counts.ss_tokens / 16**3)),
        "features": int((max(counts.shape_1024_image, counts.shape_512_image) / 16) ** 2 * DINOV3_BYTES_PER_PATCH),
        "shape_512": int(_flow_stage(counts.lr_tokens)),
        "upsample": int(UPSAMPLE_BYTES_PER_VOXEL * upsample_voxels / REFERENCE_GROWTH),
        "shape_1024": int(_flow_stage(counts.hr_tokens)),
        "texture": int(_flow_stage(counts.hr_tokens)),
        "decode": int(decode),
        "export": int(export),
    }
