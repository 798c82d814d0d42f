"""The MPS audit at real sizes: every device op of the published-size models at the reference's counts,
on ``meta`` (no weights read, nothing computed), judged against torch 2.13's MPS limits
(``pixal3d.audit.limits``, ``pixal3d.audit.sizes``). ``scripts/mps_audit.py`` prints it with the tiny audit.

Cases, each the device work of a stage, models built on ``meta`` from the published configs
(``assets/checkpoints.json``; DINOv3 ViT-L/16 and NAF at their published widths), at the counts of
``pixal3d.memory_budget.StageCounts`` (1024 cascade: 4096 dense tokens, ~4k LR tokens, 20k HR tokens,
~9M decoded voxels) and of the 1536 cascade (~45k HR tokens, ~20M voxels; its flows at the token budget's
49,151):

- camera: MoGe-2 ViT-L's forward at the released config (``assets/moge_checkpoint.json``) on a 1126 px image
  (the largest preprocessed crop), 3600 tokens, with float16 autocast's casts (``pixal3d.audit.autocast``);
- structure: DINOv3 at 512 px, the dense projection, one sparse-structure flow forward, the structure
  decoder (fp16 3-D convolutions), the occupancy argwhere;
- shape_512 / shape_1024 / texture: DINOv3, NAF (``full`` and ``frugal``) and the projection at the stage's
  tokens, one flow forward on the attention route of mps (``fp32_chunked``), and — what ``runtime.attention:
  sdpa`` would run there — one on ``sdpa``;
- upsample: the shape decoder's subdivisions from 4k LR tokens, the quantisation to the HR grid;
- decode: both decoders untiled (1024), and for 1536 as the plan runs it on mps: tiled (its prefix whole, the
  largest tile the plan allows, the reassembly whole) — the untiled 1536 decode is audited apart, as the
  finding the tiles fix.

- sampler: the CFG rescale's per-sample std (``packed_std``) of one HR latent at 20k and at the 1536 token
  budget's tokens, whose ``index_add`` adds every row into one slot.

One forward stands for a stage's sampling: every step repeats the same ops on the same shapes (the CFG
branches run one after the other), and the sampler's own ops are on ``[N, 32]`` latents.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image
from torch import nn

from pipelines.structure import occupied_coords
from pipelines.upsample import quantize_coords
from pipelines.working_set import hr_tokens
from pixal3d.audit.sizes import SizeAudit, SizeOracle, real_size_audit
from pixal3d.memory_budget import REFERENCE_GROWTH, StageCounts, plan_decode
from pixal3d.models.camera import camera_from_fov
from pixal3d.models.conditioning import ExtractorConfig, backbone_features, condition
from pixal3d.models.decoder_tiling import _concat_in_order
from pixal3d.models.loading import build_model
from pixal3d.nn.attention import device_array_bytes, resolve_route, set_attention_route
from pixal3d.nn.sparse_tensor import SparseTensor
from pixal3d.samplers import packed_std

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "assets" / "checkpoints.json"
MPS = torch.device("mps")
COUNTS = StageCounts()
HR_1536 = hr_tokens(1536)  # ~45k: the typical 1536 HR token count
TOKEN_BUDGET = 49_151      # the most HR tokens the 1536 cascade's token budget lets through (max_tokens - 1)
SUBDIVISION = REFERENCE_GROWTH / 8  # children kept per child slot: 4.6 voxels per voxel per level


def meta_model(name: str) -> nn.Module:
    """A published model on ``meta`` from its config in ``assets/checkpoints.json``."""
    spec = json.loads(MANIFEST.read_text())["models"][name]
    return build_model({"name": spec["class"], "args": spec["args"]}).eval()


def meta_dinov3() -> nn.Module:
    """DINOv3 ViT-L/16 (width 1024, 24 layers, 16 heads, 4 registers) on ``meta``."""
    from transformers import DINOv3ViTModel

    from pixal3d.models.dinov3 import tiny_dinov3_config

    config = tiny_dinov3_config(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                num_attention_heads=16, image_size=1024)
    with torch.device("meta"):
        return DINOv3ViTModel(config).eval()


def meta_naf() -> nn.Module:
    from pixal3d.models.naf import NAF

    with torch.device("meta"):
        return NAF().eval()


def sparse(tokens: int, channels: int) -> SparseTensor:
    """Features ``[tokens, channels]`` on one sample's ``meta`` coords (its layout known: one sample)."""
    x = SparseTensor(torch.empty(tokens, channels, device="meta"), torch.empty(tokens, 4, dtype=torch.int32,
                                                                                device="meta"))
    x.cache["layout"] = [slice(0, tokens)]
    return x


@dataclass(frozen=True)
class Case:
    """One audited piece of device work: its name, its oracle counts, and the function that runs it."""

    name: str
    run: Callable[[], None]
    oracle: SizeOracle = field(default_factory=SizeOracle)


class Models:
    """The meta models, built once and shared by the cases."""

    def __init__(self):
        self.dinov3, self.naf = meta_dinov3(), meta_naf()
        self._models: dict[str, nn.Module] = {}

    def __getitem__(self, name: str) -> nn.Module:
        if name not in self._models:
            self._models[name] = meta_model(name)
        return self._models[name]

    def flow(self, name: str, route: str) -> nn.Module:
        return set_attention_route(self[name], route)


def _condition(models: Models, name: str, image_size: int, grid: int, naf_size: int | None,
               tokens: int | None, naf_mode: str = "frugal") -> dict:
    image = Image.new("RGB", (image_size, image_size))
    coords = None if tokens is None else torch.zeros(tokens, 4, dtype=torch.int32).to("meta")
    return condition(ExtractorConfig(name, image_size=image_size, grid_resolution=grid, naf_size=naf_size),
                     backbone_features(models.dinov3, image, image_size), camera_from_fov(math.radians(40.0)), coords,
                     naf=models.naf if naf_size else None, naf_mode=naf_mode)


def _flow_forward(model: nn.Module, tokens: int, image: int, concat: int = 0) -> None:
    x = sparse(tokens, 32)
    global_tokens = 5 + (image // 16) ** 2  # CLS, 4 registers, the patches
    cond = {"global": torch.empty(1, global_tokens, 1024, device="meta"),
            "proj": torch.empty(tokens, 2048, device="meta")}
    extra = {"concat_cond": SparseTensor(torch.empty(tokens, concat, device="meta"), x.coords, x.cache)} if concat else {}
    model(x, torch.empty(1, device="meta"), cond, **extra)


def camera_case() -> None:
    """MoGe-2 ViT-L at the released config (``assets/moge_checkpoint.json``), its forward as ``infer`` runs it on
    mps: float16 autocast's casts (``pixal3d.audit.autocast``), 3600 tokens, the largest preprocessed crop."""
    from pixal3d.audit.autocast import standin_autocast
    from pixal3d.models.moge import build_moge

    config = json.loads((REPO / "assets" / "moge_checkpoint.json").read_text())["model_config"]
    model = build_moge(config, device="meta").eval()
    side = int(1.1 * 1024)  # preprocess: the object's bbox (at most 1024) times 1.1
    with standin_autocast():
        model.forward(torch.empty(1, 3, side, side, device="meta"), model.num_tokens_range[1])


def structure_case(models: Models) -> None:
    cond = _condition(models, "ss", 512, 16, None, None)
    flow = models.flow("sparse_structure_flow_model", resolve_route("auto", MPS))
    latent = flow(torch.empty(1, 8, 16, 16, 16, device="meta"), torch.empty(1, device="meta"), cond)
    occupied_coords(models["sparse_structure_decoder"](latent), COUNTS.structure_image // 16)


def flow_stage_case(models: Models, flow: str, *, tokens: int, image: int, grid: int, naf: int, route: str,
                    concat: int = 0, naf_modes: tuple[str, ...] = ("full", "frugal")) -> Callable[[], None]:
    def run() -> None:
        for mode in naf_modes:
            _condition(models, flow, image, grid, naf, tokens, mode)
        _flow_forward(models.flow(flow, route), tokens, image, concat)
    return run


def upsample_case(models: Models) -> None:
    fine = models["shape_slat_decoder"].upsample(sparse(COUNTS.lr_tokens, 32), times=COUNTS.decoder_levels)
    quantize_coords(fine, 32 * 16, 64)


def decode_case(models: Models, tokens: int) -> None:
    shape, tex = models["shape_slat_decoder"], models["tex_slat_decoder"]
    latent = sparse(tokens, 32)
    _, subs = shape.decode_fields(latent)
    tex.decode_pbr(SparseTensor(torch.empty(tokens, 32, device="meta"), latent.coords, latent.cache), subs, 1536)


def tiled_decode_case(models: Models, tokens: int) -> None:
    """The 1536 decode as the plan tiles it on mps: the untiled prefix at full size, then the largest tile the
    plan allows (its stages on as many start-level voxels as it may hold), then the reassembly of all voxels."""
    shape, tex = models["shape_slat_decoder"], models["tex_slat_decoder"]
    plan = plan_decode(2**50, latent_tokens=tokens, weight_bytes=0, array_bytes=device_array_bytes(MPS))
    start, last = plan.start_level, shape.num_upsamplings
    latent = sparse(tokens, 32)
    _, prefix_subs = shape.run_stages(shape.embed(latent), 0, start)
    tex.run_stages(tex.embed(latent), 0, start, prefix_subs)
    tile_start = int(plan.tile_voxels / REFERENCE_GROWTH ** (last - start))  # start-level voxels of one tile
    h = sparse(tile_start, shape.blocks[start][0].conv.in_channels)
    out, subs = shape.run_stages(h.type(torch.float16), start, last + 1)
    shape.head(out)
    guide = [None] * start + subs
    tex.head(tex.run_stages(h.type(torch.float16), start, last + 1, guide)[0])
    voxels = round(tokens * REFERENCE_GROWTH ** last)
    parts = [torch.empty(voxels // 2, 7, device="meta"), torch.empty(voxels - voxels // 2, 7, device="meta")]
    order = torch.argsort(torch.empty(voxels, dtype=torch.int64, device="meta"), stable=True)
    coords = _concat_in_order([torch.empty(voxels, 4, dtype=torch.int32, device="meta")], order)
    shape.fields_from_output(SparseTensor(_concat_in_order(parts, order), coords))
    _concat_in_order([torch.empty(voxels, 6, device="meta")], order) * 0.5 + 0.5


def sampler_case(tokens: int) -> Callable[[], None]:
    """The CFG rescale's std of one sparse latent of ``tokens`` rows (32 channels): an index_add of every row
    into one slot."""
    def run() -> None:
        packed_std(torch.empty(tokens, 32, device="meta"), [slice(0, tokens)])
    return run


def cases(models: Models) -> list[Case]:
    """The product's device work at real sizes (see the module doc)."""
    fp32 = resolve_route("auto", MPS)
    out = [Case("camera", camera_case, SizeOracle()),
           Case("structure", lambda: structure_case(models), SizeOracle(nonzero_fraction=0.12))]
    for label, tokens in (("1024", COUNTS.hr_tokens), ("1536", TOKEN_BUDGET)):
        for route in (fp32, "sdpa"):
            suffix = f" {label}" + ("" if route == fp32 else " (sdpa route)")
            modes = ("full", "frugal") if route == fp32 else ()
            out.append(Case("shape_1024" + suffix, flow_stage_case(
                models, "shape_slat_flow_model_1024", tokens=tokens, image=1024, grid=64, naf=512, route=route,
                naf_modes=modes), SizeOracle(nonzero_fraction=0.5)))
            out.append(Case("texture" + suffix, flow_stage_case(
                models, "tex_slat_flow_model_1024", tokens=tokens, image=1024, grid=64, naf=1024, route=route,
                concat=32, naf_modes=modes), SizeOracle(nonzero_fraction=0.5)))
    out.insert(2, Case("shape_512", flow_stage_case(models, "shape_slat_flow_model_512", tokens=COUNTS.lr_tokens,
                                                     image=512, grid=32, naf=512, route=fp32),
                       SizeOracle(nonzero_fraction=0.5)))
    fraction = COUNTS.hr_tokens / (COUNTS.lr_tokens * REFERENCE_GROWTH ** COUNTS.decoder_levels)
    out.insert(3, Case("upsample", lambda: upsample_case(models),
                       SizeOracle(nonzero_fraction=SUBDIVISION, unique_fraction=fraction)))
    out += [Case(f"sampler {label}", sampler_case(tokens), SizeOracle())
            for label, tokens in (("1024", COUNTS.hr_tokens), ("1536", TOKEN_BUDGET))]
    out.append(Case("decode 1024", lambda: decode_case(models, COUNTS.hr_tokens), SizeOracle(SUBDIVISION)))
    out.append(Case("decode 1536 (tiled on mps)", lambda: tiled_decode_case(models, HR_1536),
                    SizeOracle(SUBDIVISION)))
    return out


def untiled_1536_decode(models: Models) -> Case:
    """What the tiles fix: the 1536 decode in one piece."""
    return Case("decode 1536 untiled", lambda: decode_case(models, HR_1536), SizeOracle(SUBDIVISION))


def run_cases(selected: list[Case], audit: SizeAudit | None = None) -> SizeAudit:
    """Run each case under one real-size audit (its oracle counts, its name on the rows)."""
    audit = audit if audit is not None else SizeAudit()
    with torch.no_grad(), real_size_audit(audit):
        for case in selected:
            with _case(audit, case):
                case.run()
    return audit


@contextmanager
def _case(audit: SizeAudit, case: Case) -> Iterator[None]:
    audit.case, audit.oracle = case.name, case.oracle
    try:
        yield
    finally:
        audit.case = "-"


ATTENTION_NOTE = """\
What mps runs for attention (torch 2.13). `F.scaled_dot_product_attention` picks its kernel in ATen's
`scaled_dot_product_attention` (`aten/src/ATen/native/transformers/attention.cpp`, the `math` case, compiled into
every build; read from the pytorch/pytorch source as stored for this search, a 2.5-or-later version — the branch
holds no check, so the 2.13 binary gives no line for it): on mps, q, k and v all contiguous, no grad and no dropout go to the MPS op
`_scaled_dot_product_attention_math_for_mps` (`mps/operations/Attention.mm`: `sdpa_vector_*` for short queries,
`sdpa_prefill_mps` — which `PYTORCH_MPS_DISABLE_PREFILL_ATTENTION` turns off — or `sdpa_general_mps`, which hands all
of Q·Kᵀ to MPSGraph's softmax; torch 2.13's own meta function for the op, `torch/_meta_registrations.py:6476-6488`,
allocates the `[B, H, Lq, Lk]` scores in the query dtype). Anything else takes the composite
`_scaled_dot_product_attention_math`, which upcasts half-precision q, k, v to fp32 (unless
`allowFP16BF16ReductionMathSDP` is set) and runs `bmm`, `_safe_softmax`, `bmm` — the ops this audit records, on mps as
on the CPU (seen here: `_to_copy` bf16→f32 before the `bmm` rows). The flow models' heads are `[B, H, L, D]` views of
`[B, L, H, D]` projections, never contiguous, and DINOv3's (transformers) are not either: no call of the cascade
reaches the MPS kernel. The `fp32_chunked` route (the default on mps) calls no SDPA at all: `bmm` → `_softmax` → `bmm` in
fp32 per query chunk, rows below. The `(sdpa route)` cases are what `runtime.attention: sdpa` runs: the fp32 math path
per query chunk of `score_budget()` scores. A contiguous call would be recorded as `{op}` with its scores as its
largest tensor (`pixal3d/audit/sizes.py`, `SdpaDispatch`; tests/pixal3d/test_mps_real_size.py shows it caught).
""".format(op="`aten::_scaled_dot_product_attention_math_for_mps`")


def report(audit: SizeAudit, before: SizeAudit, seconds: float) -> str:
    """The real-size section of benchmarks/mps_audit.md."""
    from pixal3d.audit.sizes import limits_markdown

    over = before.problems()
    found = "\n".join(f"- `{r.op}` [{' '.join(r.dtypes)}]: " + "; ".join(r.violations.values()) for r in over)
    plan = plan_decode(2**50, latent_tokens=HR_1536, weight_bytes=0, array_bytes=device_array_bytes(MPS))
    status = "none" if not audit.problems() else "\n" + "\n".join(f"- `{r.op}`: {r.violations}" for r in audit.problems())
    return (
        "## At real sizes, against MPS's limits\n\n"
        f"`python scripts/mps_audit.py -o benchmarks/mps_audit.md` (`scripts/mps_real_size.py`), {seconds:.0f} s: "
        "the published-size models built on `meta` (no weights, nothing computed) and run at the reference's counts "
        "— 1024 cascade: 4096 dense structure tokens, ~4k LR tokens, 20k HR tokens, ~9M decoded voxels; 1536 "
        f"cascade: its flows at the token budget's {TOKEN_BUDGET:,} tokens, its decode at ~{HR_1536:,} tokens "
        f"(~{HR_1536 * REFERENCE_GROWTH ** 4 / 1e6:.0f}M voxels). Each device op is recorded with its largest "
        "tensor and judged against the limits below (`pixal3d/audit/limits.py`). Data-dependent counts stand in "
        "for data (`SizeOracle`): the decoders keep 4.6 of 8 children per voxel, the structure 12 % of its grid, the "
        "upsampling's quantisation ~20k of its ~1.8M voxels. One flow forward stands for a stage's sampling (every "
        "step repeats its ops and shapes). Views (`view`, `slice`, `t`, …) are listed at the size they describe; "
        "they run no kernel.\n\n"
        + ATTENTION_NOTE +
        "\n### The limits (torch 2.13)\n\n"
        "Read from the torch 2.13.0 macOS arm64 wheel: each `TORCH_CHECK`'s file and line as its call site hands "
        "them to `c10::detail::torchCheckFail` (or a `SourceLocation`) in `libtorch_cpu.dylib` (`llvm-objdump "
        "--macho -d`), the kernels' integer types from its headers; paths under `aten/src/ATen/native/`.\n\n"
        + limits_markdown(audit.limits) +
        "\n### Found and fixed\n\n"
        "The 1536 decode in one piece (its rows over a limit):\n\n" + (found or "- none") + "\n\n"
        f"Fix: on mps the plan tiles the decode so that no tensor of it exceeds {100 * 0.9:.0f} % of 2**32 bytes "
        "(`memory_budget.plan_decode(..., array_bytes=)`, `DecodeStage.fitted`; `StageBudget.array_bytes` is "
        f"MPSGraph's limit on mps) — at ~{HR_1536:,} tokens from decoder level {plan.start_level}, at most "
        f"{plan.tile_voxels:,} voxels a tile, the same voxels and fields as the untiled decode (decoder_tiling's "
        "exactness). The 1024 decode (largest tensor 2.14 GiB) stays whole. Re-audited: the `decode 1536 (tiled on "
        "mps)` rows below.\n\n"
        "### How close each limit comes\n\n"
        "The call that comes closest to each limit with a measure, over every case: bytes for MPSGraph's array limit, "
        "score elements for attention's silent one (what one call of the `fp32_chunked` route holds is bounded by "
        "`score_budget()`, 2**26 by default), rows per slot for `index_add` (no bound: the sampler's accumulator is "
        "fp32 on every device, `samplers.segment_mean`, so its row count costs no precision).\n\n"
        + audit.closest_markdown() +
        "\n### The largest tensor of each case\n\n" + audit.cases_markdown() +
        f"\n### Every device op at real size (rows over a limit: {status})\n\n"
        "Per op and dtypes: its largest tensor over every call and the case it came from, its most elements and "
        "largest dimension, calls (and the number of cases using it), the verdict.\n\n"
        + audit.to_markdown())
