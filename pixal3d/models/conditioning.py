"""Image conditioning of the four flow stages: DINOv3 tokens, NAF upsampling, pixel-aligned projection.

Pixal3D builds four ``DinoV3ProjFeatureExtractor``s that differ only in sizes (``EXTRACTORS``). Here an
extractor is plain data, and the work is split in two so that DINOv3 never shares memory with a flow model:
``image_features`` runs the backbone once per distinct input size S the cascade reads (512 and 1024 px:
``ss``/``shape_512`` share the 512-px tokens, ``shape_1024``/``tex_1024`` the 1024-px ones) while DINOv3 alone
is loaded, and the result (``ImageFeatures``, megabytes) is kept; ``condition`` then runs one extractor from
those features, with NAF passed in (the registry owns the models), inside the flow stage.

Output per extractor: ``{'global': [1, 5, 1024] f32, 'proj': ...}`` where ``proj`` is dense ``[1, G³, C]`` when
no coords are given (the sparse-structure stage) or a ``SparseTensor [N, C]`` on the given coords, rows in
coords order. ``C`` is the backbone width, doubled (low-res first, NAF second) for the NAF extractors.
The sparse path projects only the N requested points, and NAF runs only at the pixels their bilinear
taps read, in one of two modes (``NAF_MODES``):
* ``full``: bit for bit the reference algorithm (the whole T×T NAF map, then bilinear sampling), without
  holding that map (``NAF.sample``) nor the guidance map (``TiledEncoder``: one map per encoder branch, the
  same bits). Peak ≈ ``naf_peak_bytes``: 1.53 GiB at 1024 px (the whole encoder held 3.52).
* ``frugal``: the guidance map in bands of rows (``NAF.features_at``); within ~1e-7 of ``full`` (fp32),
  which can round a few bf16 condition values differently; peak a fraction of ``full``'s.
``select_naf_mode`` resolves ``auto``: ``full`` when its peak fits the memory budget, else ``frugal`` (on the
real cascade, full fits from a 2.30 GiB budget).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from PIL import Image

from ..nn.sparse_tensor import SparseTensor
from .camera import Camera
from .dinov3 import extract_tokens, num_global_tokens, prepare_image
from .naf import NAF
from .projection import (
    coords_points,
    grid_points,
    project,
    sample_map,
    sample_pointwise,
)

if TYPE_CHECKING:  # annotations only: importing transformers' modeling code costs seconds
    from transformers import DINOv3ViTModel

logger = logging.getLogger(__name__)

NafMode = Literal["frugal", "full"]
NAF_MODES = ("full", "frugal")


@dataclass(frozen=True)
class ExtractorConfig:
    """One projection extractor: DINOv3 input size S, projection grid G, NAF output size T (None: no NAF)."""

    name: str
    image_size: int
    grid_resolution: int
    naf_size: int | None = None


EXTRACTORS: dict[str, ExtractorConfig] = {
    "ss": ExtractorConfig("ss", image_size=512, grid_resolution=16),
    "shape_512": ExtractorConfig("shape_512", image_size=512, grid_resolution=32, naf_size=512),
    "shape_1024": ExtractorConfig("shape_1024", image_size=1024, grid_resolution=64, naf_size=512),
    "tex_1024": ExtractorConfig("tex_1024", image_size=1024, grid_resolution=64, naf_size=1024),
}


def scaled_extractors(factor: int, extractors: dict[str, ExtractorConfig] = EXTRACTORS) -> dict[str, ExtractorConfig]:
    """The extractors with image and NAF sizes divided by ``factor`` (same grids): with a DINOv3 of patch size
    ``16 / factor`` the token grids stay 32² and 64², at a fraction of the pixels (tests, the offline demo)."""
    scaled = {}
    for name, ex in extractors.items():
        if ex.image_size % factor or (ex.naf_size or 0) % factor:
            raise ValueError(f"extractor {name!r} sizes {ex.image_size}/{ex.naf_size} are not divisible by {factor}")
        naf_size = None if ex.naf_size is None else ex.naf_size // factor
        scaled[name] = ExtractorConfig(name, ex.image_size // factor, ex.grid_resolution, naf_size)
    return scaled


@dataclass(frozen=True)
class BackboneFeatures:
    """DINOv3 output for one (image, S): ``tokens [1, 5 + (S/16)², C]`` and the [0, 1] image NAF is guided by."""

    tokens: torch.Tensor
    image: torch.Tensor
    num_global: int

    @property
    def size(self) -> int:
        """The input size S the backbone ran at (the guide image's side)."""
        return int(self.image.shape[-1])

    @property
    def global_tokens(self) -> torch.Tensor:
        return self.tokens[:, :self.num_global]

    def patch_map(self) -> torch.Tensor:
        """Patch tokens as a ``[1, C, S/16, S/16]`` map (row-major ``[y][x]``)."""
        patches = self.tokens[:, self.num_global:]
        side = round(patches.shape[1] ** 0.5)
        return patches.reshape(1, side, side, -1).permute(0, 3, 1, 2)


@dataclass(frozen=True)
class ImageFeatures:
    """DINOv3's features of one image at every input size S a cascade reads (S -> ``BackboneFeatures``).

    Made by ``image_features`` while DINOv3 alone is loaded and kept for the flow stages, which read them with
    ``at(S)``: at the released width 4.2 MB of tokens and 3.1 MB of guide image at 512 px, 16.8 and 12.6 MB at
    1024 px."""

    by_size: Mapping[int, BackboneFeatures]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.by_size))

    def at(self, size: int) -> BackboneFeatures:
        """The features at input size ``size``; a ``ValueError`` naming the sizes held when there are none."""
        if size not in self.by_size:
            raise ValueError(f"no DINOv3 features at {size} px: these image features were computed at "
                             f"{list(self.sizes)} px; compute every size the cascade reads (image_features)")
        return self.by_size[size]


def image_features(backbone: DINOv3ViTModel, image: Image.Image, sizes: Iterable[int]) -> ImageFeatures:
    """Run the backbone once per distinct size in ``sizes`` on ``image``: every feature the extractors read."""
    return ImageFeatures({size: backbone_features(backbone, image, size) for size in sorted(set(sizes))})


def backbone_features(backbone: DINOv3ViTModel, image: Image.Image, size: int) -> BackboneFeatures:
    """Run the backbone once on ``image`` resized to ``size``²."""
    patch = backbone.config.patch_size
    if size % patch:
        raise ValueError(f"image size {size} must be a multiple of the DINOv3 patch size {patch}")
    device = backbone.embeddings.patch_embeddings.weight.device
    normalised, raw = prepare_image(image, size, device)
    with torch.no_grad():
        tokens = extract_tokens(backbone, normalised)
    return BackboneFeatures(tokens=tokens, image=raw, num_global=num_global_tokens(backbone))


def condition(extractor: ExtractorConfig, features: BackboneFeatures, camera: Camera,
              coords: torch.Tensor | None = None, *, naf: NAF | None = None,
              naf_mode: NafMode = "frugal") -> dict[str, torch.Tensor | SparseTensor]:
    """The flow-model condition of one extractor from the backbone's ``features`` at its input size:
    ``{'global': [1, 5, C], 'proj': dense [1, G³, C'] or SparseTensor [N, C'] on ``coords [N, 4]`` int32}``
    (C' = 2C with NAF)."""
    if extractor.naf_size is not None and naf is None:
        raise ValueError(f"extractor {extractor.name!r} upsamples with NAF (T={extractor.naf_size}); pass naf=")
    if naf_mode not in NAF_MODES:
        raise ValueError(f"naf_mode must be one of {NAF_MODES}; got {naf_mode!r} (resolve 'auto' with select_naf_mode)")
    if features.size != extractor.image_size:
        raise ValueError(f"extractor {extractor.name!r} reads DINOv3 features at {extractor.image_size} px; these "
                         f"are at {features.size} px")
    device = features.tokens.device
    if coords is None:
        points = grid_points(extractor.grid_resolution, device=device)
    else:
        if coords.dtype != torch.int32 or (coords.numel() and int(coords[:, 0].max()) != 0):
            raise ValueError("coords must be int32 [N, 4] (batch, x, y, z) of a single image (batch index 0)")
        points = coords_points(coords.to(device), extractor.grid_resolution)
    grid = project(points, camera, extractor.image_size)  # [K, 2]
    with torch.no_grad():
        proj = project_features(extractor, features.patch_map(), features.image, grid, naf, naf_mode)  # [K, C']
    if coords is None:
        return {"global": features.global_tokens, "proj": proj[None]}
    return {"global": features.global_tokens, "proj": SparseTensor(proj, coords.to(device))}


def negative_condition(cond: dict[str, torch.Tensor | SparseTensor]) -> dict[str, torch.Tensor | SparseTensor]:
    """The classifier-free-guidance negative: zeros of the same shapes (a SparseTensor keeps its coords)."""
    return {key: value.replace(torch.zeros_like(value.feats)) if isinstance(value, SparseTensor)
            else torch.zeros_like(value) for key, value in cond.items()}


def project_features(extractor: ExtractorConfig, patch_map: torch.Tensor, image: torch.Tensor, grid: torch.Tensor,
                     naf: NAF | None, naf_mode: NafMode) -> torch.Tensor:
    """Low-res features of ``patch_map [1, C, h, w]`` at ``grid [K, 2]`` then (NAF extractors) the NAF features
    guided by ``image [1, 3, S, S]``, concatenated: ``[K, C or 2C]``."""
    low_res = sample_map(patch_map, grid)
    if extractor.naf_size is None:
        return low_res
    size = (extractor.naf_size, extractor.naf_size)
    if naf_mode == "full":
        high_res = naf.sample(image, patch_map, size, grid)
    else:
        high_res = sample_pointwise(lambda pixels: naf.features_at(image, patch_map, size, pixels),
                                    grid, *size)
    return torch.cat([low_res, high_res], dim=-1)


def naf_peak_bytes(mode: NafMode, image_size: int, naf_size: int, *, dim: int = 256, channels: int = 1024,
                   points: int = 0) -> int:
    """Working memory (bytes, fp32) of one NAF projection at input size S = ``image_size`` and output T.

    ``full``: the larger of two phases. Encoding (``TiledEncoder``, where the encoder's side = min(S, 4T) is a
    multiple of T): three ``dim / 2``-channel maps of side² (a whole convolution's input, its output and oneDNN's
    blocked copy) and 160 MiB for a band and the allocator's slack, fitted never to fall under the measurements
    below; elsewhere the whole encoder's four dim-channel maps. Sampling: one channel chunk (at most 256 MiB) of
    the sparse sampling map, the values (about 4 pixels × C per point) and the queries (4 pixels × dim, rotated:
    twice); with the whole encoder also the T² × dim guidance map. ``frugal``: four band activations (64 MiB
    each) and the values.

    Measured at real width, NAF alone (``scripts/bench_naf_modes.py --modes whole full``, benchmarks/full_work.md):
    S = T = 512, 4000 points: full 0.51 GiB (estimate 0.53); S = 1024, 20,000 points: full 1.53 GiB at T = 512
    and at T = 1024 (estimate 1.66), where the whole encoder held 3.52 GiB.
    """
    side = min(image_size, 4 * naf_size)
    values = 4 * points * channels * 4
    if mode == "full":
        chunk = min(256 << 20, channels * naf_size * naf_size * 4)
        sampling = chunk + values + 2 * 4 * points * dim * 4
        if side % naf_size == 0:  # TiledEncoder applies
            return max(3 * (dim // 2) * side * side * 4 + (160 << 20), sampling)
        return max(4 * side * side * dim * 4, naf_size * naf_size * dim * 4 + sampling)
    if mode == "frugal":
        return 4 * (64 << 20) + values
    raise ValueError(f"naf mode must be one of {NAF_MODES}; got {mode!r}")


def select_naf_mode(requested: str, *, budget_bytes: int, full_bytes: int) -> NafMode:
    """``auto`` → ``full`` (reference-exact) when its peak ``full_bytes`` fits ``budget_bytes``, else ``frugal``;
    ``full`` and ``frugal`` are returned as given."""
    if requested in NAF_MODES:
        return requested  # type: ignore[return-value]
    if requested != "auto":
        raise ValueError(f"naf mode must be 'auto', 'full' or 'frugal'; got {requested!r}")
    return "full" if full_bytes <= budget_bytes else "frugal"
