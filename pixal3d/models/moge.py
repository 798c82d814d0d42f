"""MoGe-2 (Wang et al. 2025, "MoGe-2: Accurate Monocular Geometry with Metric Scale and Sharp Details"):
the camera estimator of Pixal3D's reference, in plain PyTorch, key-compatible with the published ``model.pt``.

The reference (``inference.py``, ``get_camera_params_wild_moge``) calls
``MoGeModel.from_pretrained("Ruicheng/moge-2-vitl").infer(image)`` on the preprocessed RGB image with
MoGe's defaults and reads the horizontal focal length from the intrinsics. The maths, top to bottom, as
microsoft/MoGe ``moge/model/v2.py`` and ``moge/model/modules.py`` define it:

1. Token grid: ``num_tokens = int(lo + resolution_level / 9 · (hi − lo))`` from the checkpoint's
   ``num_tokens_range`` (level 9: 3600 for the release), split by the image's aspect ratio into
   ``rows × cols`` (rounded). The image is resized (bilinear, antialiased) to ``14·rows × 14·cols``,
   ImageNet-normalised and encoded by a DINOv2 ViT/14 (position embeddings bicubically resized with DINOv2's
   0.1 offset); the tokens of four blocks, each through the final LayerNorm and a 1×1 conv, are summed.
2. Neck: five levels (the token grid, then ×2 each); every level gets the view-plane UV map of its size
   as two extra channels (``normalized_view_plane_uv``: ``±(w−1)/w · aspect/√(1+aspect²)`` across,
   ``±(h−1)/h · 1/√(1+aspect²)`` down); residual 3×3 conv blocks, upsampled by a 2×2 transposed conv
   (three times) and a bilinear ×2 (once), each followed by a 3×3 conv (replicate padding).
3. Heads: points (3 channels) and mask (1) as conv stacks over the neck's levels (a ``normal`` head where
   the checkpoint has one), their last level resized bilinearly to the image; ``exp`` remap of the points
   (``z = exp(z)``, ``xy·z``), sigmoid mask. Scale head: an MLP on the class token, ``exp``.
4. ``infer``: the forward under float16 autocast (MoGe's ``use_fp16=True`` default, on the model's
   device type), then in float32: ``mask > 0.5``; ``recover_focal_shift`` (focal relative to half the
   image diagonal, and the depth shift, by Levenberg–Marquardt on a 64×64 nearest-neighbour sample of the
   masked point map: SciPy's ``least_squares(method="lm")``, which is MINPACK, as MoGe calls it); normalised
   intrinsics ``fx = focal/2 · √(1+a²)/a``, ``fy = focal/2 · √(1+a²)``, centre (0.5, 0.5); the points
   shifted, the mask kept where depth > 0, the point map recomputed from depth and intrinsics (MoGe's
   ``force_projection``), scaled by the metric scale, masked (``inf`` outside).

Weights: ``model.pt`` is a torch checkpoint ``{"model_config": {...}, "model": state_dict}``; ``load_moge``
reads it with ``weights_only=True``, builds the network on ``meta`` from ``model_config`` and assigns every
tensor under a strict key and shape check (MoGe's own ``from_pretrained`` loads with ``strict=False``).
``assets/moge_checkpoint.json`` lists the released file's tensors. The DINOv2 here is our own: transformers'
``Dinov2Model`` resizes the position embeddings to a target size rather than by DINOv2's offset scale
factor, and runs separate q/k/v projections, so its numbers are not MoGe's.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pixal3d.staging.stream import WeightStream, stream_model

from .loading import CheckpointError

logger = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
PATCH = 14
MOGE_FILE = "model.pt"  # the checkpoint's name in a MoGe Hub repo
RELEASED_REPO = "Ruicheng/moge-2-vitl"  # the reference's MoGe-2: a DINOv2 ViT-L/14 encoder
RELEASED_BACKBONE = "dinov2_vitl14"


# -- DINOv2 ViT/14 ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ViTSize:
    """A DINOv2 ViT/14 as MoGe's hub loaders build it: 518-px position grid, LayerScale, GELU MLP, no registers."""

    embed_dim: int
    depth: int
    num_heads: int
    mlp_ratio: float = 4.0
    image_size: int = 518


BACKBONES: dict[str, ViTSize] = {
    "dinov2_vits14": ViTSize(384, 12, 6),
    "dinov2_vitb14": ViTSize(768, 12, 12),
    "dinov2_vitl14": ViTSize(1024, 24, 16),
    "tiny_vit14": ViTSize(32, 2, 2),  # the offline demo's (pixal3d.tiny_weights); MoGe's loader does not know it
}
"""``encoder.backbone`` names a checkpoint's ``model_config`` may use."""


class LayerScale(nn.Module):
    """Per-channel scale of a residual branch (DINOv2's ``ls1``/``ls2``)."""

    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Attention(nn.Module):
    """Multi-head self-attention with one fused qkv projection, through ``scaled_dot_product_attention``."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads)
        qkv = qkv.permute(2, 0, 3, 1, 4)  # [3, B, H, N, C/H]
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.permute(0, 2, 1, 3).reshape(b, n, c))


class Mlp(nn.Module):
    """fc1 → GELU → fc2."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block with LayerScale on both residual branches."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.ls1 = LayerScale(dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.ls2 = LayerScale(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


class PatchEmbed(nn.Module):
    """14×14 patches → tokens ``[B, N, D]`` (row-major)."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, kernel_size=PATCH, stride=PATCH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class DinoV2(nn.Module):
    """The DINOv2 ViT/14 backbone; ``intermediate`` returns chosen blocks' tokens after the final norm."""

    def __init__(self, size: ViTSize):
        super().__init__()
        grid = size.image_size // PATCH
        self.patch_embed = PatchEmbed(size.embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, size.embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + grid * grid, size.embed_dim))
        self.mask_token = nn.Parameter(torch.zeros(1, size.embed_dim))  # DINOv2's training-time masking; unused here
        self.blocks = nn.ModuleList(Block(size.embed_dim, size.num_heads, size.mlp_ratio) for _ in range(size.depth))
        self.norm = nn.LayerNorm(size.embed_dim, eps=1e-6)

    def position_embedding(self, tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The stored embedding, or (another grid) its patch part resized bicubically by DINOv2's scale factor
        ``(n + 0.1) / grid`` (the 0.1 offset of facebookresearch/dino#8), in float32, cast to the tokens' dtype."""
        stored = self.pos_embed.shape[1] - 1
        if tokens.shape[1] - 1 == stored and width == height:
            return self.pos_embed
        embed = self.pos_embed.float()
        grid = int(math.sqrt(stored))
        rows, cols = height // PATCH, width // PATCH
        patches = embed[:, 1:].reshape(1, grid, grid, -1).permute(0, 3, 1, 2)  # [1, D, grid, grid]
        patches = F.interpolate(patches, mode="bicubic", antialias=False,
                                scale_factor=(float(rows + 0.1) / grid, float(cols + 0.1) / grid))
        patches = patches.permute(0, 2, 3, 1).flatten(1, 2)  # [1, rows·cols, D]
        return torch.cat((embed[:, :1].expand(patches.shape[0], -1, -1), patches), dim=1).to(tokens.dtype)

    def intermediate(self, image: torch.Tensor, layers: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(patch tokens [B, N, D], class token [B, D])`` of each block in ``layers``, after the final norm."""
        height, width = image.shape[-2:]
        x = self.patch_embed(image)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = x + self.position_embedding(x, height, width)
        taken = []
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i in layers:
                taken.append(x)
        normed = [self.norm(t) for t in taken]
        return [(t[:, 1:], t[:, 0]) for t in normed]


class DINOv2Encoder(nn.Module):
    """Image in [0, 1] → the summed 1×1 projections of the chosen blocks' patch tokens, and the class token."""

    def __init__(self, backbone: str, intermediate_layers: int | Sequence[int], dim_out: int):
        super().__init__()
        size = BACKBONES[backbone]
        self.layers = (tuple(range(size.depth - intermediate_layers, size.depth))
                       if isinstance(intermediate_layers, int) else tuple(intermediate_layers))
        self.backbone = DinoV2(size)
        self.output_projections = nn.ModuleList(nn.Conv2d(size.embed_dim, dim_out, 1) for _ in self.layers)
        self.register_buffer("image_mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1))
        self.register_buffer("image_std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1))

    def forward(self, image: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = F.interpolate(image, (rows * PATCH, cols * PATCH), mode="bilinear", align_corners=False, antialias=True)
        image = (image - self.image_mean) / self.image_std
        taken = self.backbone.intermediate(image, self.layers)
        maps = [proj(tokens.permute(0, 2, 1).unflatten(2, (rows, cols)).contiguous())
                for proj, (tokens, _) in zip(self.output_projections, taken)]
        return torch.stack(maps, dim=1).sum(dim=1), taken[-1][1]  # [B, dim_out, rows, cols], [B, D]


# -- conv neck and heads ---------------------------------------------------------------------------

ACTIVATIONS = {"relu": nn.ReLU, "leaky_relu": functools.partial(nn.LeakyReLU, negative_slope=0.2),
               "silu": nn.SiLU, "elu": nn.ELU}


def _norm(kind: str, channels: int) -> nn.Module:
    """MoGe's norm names: ``group_norm`` (groups of 32 channels), ``layer_norm`` (one group), ``instance_norm``,
    ``none``."""
    if kind == "group_norm":
        return nn.GroupNorm(channels // 32, channels)
    if kind == "layer_norm":
        return nn.GroupNorm(1, channels)
    if kind == "instance_norm":
        return nn.InstanceNorm2d(channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"norm {kind!r} is not one of group_norm, layer_norm, instance_norm, none")


class ResidualConvBlock(nn.Module):
    """norm → act → 3×3 conv → norm → act → 3×3 conv (replicate padding), plus the input."""

    def __init__(self, channels: int, hidden: int, *, activation: str, in_norm: str, hidden_norm: str):
        super().__init__()
        act = ACTIVATIONS[activation]
        self.layers = nn.Sequential(
            _norm(in_norm, channels), act(),
            nn.Conv2d(channels, hidden, 3, padding=1, padding_mode="replicate"),
            _norm(hidden_norm, hidden), act(),
            nn.Conv2d(hidden, channels, 3, padding=1, padding_mode="replicate"))

    def forward(self, x: torch.Tensor, *, band_rows: int | None = None) -> torch.Tensor:
        """``band_rows``: its 3×3 convs in row bands of that many rows (``conv_in_bands``; None: whole)."""
        y = x
        for layer in self.layers:
            y = conv_in_bands(layer, y, band_rows) if isinstance(layer, nn.Conv2d) else layer(y)
        return y + x


BAND_MIN_CHANNELS = 32
"""The narrowest conv ``conv_in_bands`` bands (in and out): narrower ones run whole (see there)."""


def conv_in_bands(conv: nn.Conv2d, x: torch.Tensor, rows: int | None) -> torch.Tensor:
    """``conv(x)`` for a 3×3 stride-1 conv with replicate padding, computed ``rows`` output rows at a time: each band
    reads its rows and one row of halo above and below (replicated at the image's own edges, as the whole conv
    pads). Only the band's padded copy and the kernel's workspace for it are live at once, not the whole image's
    (at 960² × 64 channels the whole conv holds ~0.55 GB beyond its input).

    Whole instead (the same result, by construction) for ``rows`` None, an image no taller, or a conv narrower than
    ``BAND_MIN_CHANNELS``: on this project's CPU (oneDNN, AVX-512) the bands gave the whole conv's bits at the
    released widths (32-1024 channels) on the release's square grids (60² tokens: 60-960 rows), checked in
    ``tests/pixal3d/models/test_backbone_stream.py`` and at full size by ``scripts/bench_stream.py ratio --model
    moge``; at 8-16 channels (the toy config's) the result changed with the band's height (oneDNN picks its kernel
    by size), as NAF's 1×1 convs did. Another CPU's kernels may differ, and a GPU's were not checked: the bands run
    only under an explicit memory budget, on the CPU (``pipelines.camera``)."""
    if (rows is None or x.shape[-2] <= rows
            or min(conv.in_channels, conv.out_channels) < BAND_MIN_CHANNELS):
        return conv(x)
    if (conv.kernel_size, conv.stride, conv.padding, conv.dilation, conv.groups, conv.padding_mode) != \
            ((3, 3), (1, 1), (1, 1), (1, 1), 1, "replicate"):
        raise ValueError(f"conv_in_bands runs 3x3 stride-1 replicate-padded convs, not {conv}")
    height = x.shape[-2]
    out = None
    for top in range(0, height, rows):
        bottom = min(top + rows, height)
        band = x[:, :, max(top - 1, 0):min(bottom + 1, height)]
        band = F.pad(band, (1, 1, int(top == 0), int(bottom == height)), mode="replicate")
        y = F.conv2d(band, conv.weight, conv.bias)  # [B, C_out, bottom - top, W]
        if out is None:
            out = y.new_empty(*y.shape[:2], height, y.shape[-1])
        out[:, :, top:bottom] = y
    return out


def _resampler(kind: str, dim_in: int, dim_out: int) -> nn.Sequential:
    """×2 upsampling then a 3×3 conv: ``conv_transpose`` (2×2 stride 2) or ``bilinear`` / ``nearest``."""
    if kind == "conv_transpose":
        first: nn.Module = nn.ConvTranspose2d(dim_in, dim_out, kernel_size=2, stride=2)
        channels = dim_out
    elif kind in ("bilinear", "nearest"):
        first = nn.Upsample(scale_factor=2, mode=kind, align_corners=False if kind == "bilinear" else None)
        channels = dim_in
    else:
        raise ValueError(f"resampler {kind!r} is not one of conv_transpose, bilinear, nearest")
    return nn.Sequential(first, nn.Conv2d(channels, dim_out, 3, padding=1, padding_mode="replicate"))


def _per_level(value: Any, levels: int) -> list[Any]:
    """A per-level list as given, or one value repeated for every level."""
    return list(value) if isinstance(value, (list, tuple)) else [value] * levels


class ConvStack(nn.Module):
    """Levels of residual conv blocks joined by ×2 resamplers; level i adds ``input_blocks[i]`` of its input and
    emits ``output_blocks[i]`` of its state (a 1×1 conv, or the state itself where the width is ``None``)."""

    def __init__(self, dim_in: Any, dim_res_blocks: Sequence[int], dim_out: Any, resamplers: Any,
                 dim_times_res_block_hidden: int = 1, num_res_blocks: Any = 1,
                 res_block_in_norm: str = "layer_norm", res_block_hidden_norm: str = "group_norm",
                 activation: str = "relu"):
        super().__init__()
        levels = len(dim_res_blocks)
        ins, outs, blocks = (_per_level(v, levels) for v in (dim_in, dim_out, num_res_blocks))
        kinds = _per_level(resamplers, levels - 1)
        self.input_blocks = nn.ModuleList(nn.Identity() if d is None else nn.Conv2d(d, w, 1)
                                          for d, w in zip(ins, dim_res_blocks))
        self.resamplers = nn.ModuleList(_resampler(k, a, b)
                                        for k, a, b in zip(kinds, dim_res_blocks[:-1], dim_res_blocks[1:]))
        self.res_blocks = nn.ModuleList(
            nn.Sequential(*(ResidualConvBlock(w, dim_times_res_block_hidden * w, activation=activation,
                                              in_norm=res_block_in_norm, hidden_norm=res_block_hidden_norm)
                            for _ in range(n)))
            for w, n in zip(dim_res_blocks, blocks))
        self.output_blocks = nn.ModuleList(nn.Identity() if d is None else nn.Conv2d(w, d, 1)
                                           for d, w in zip(outs, dim_res_blocks))

    def forward(self, features: Sequence[torch.Tensor], *, band_rows: int | None = None) -> list[torch.Tensor]:
        """Each level's output; ``band_rows``: the 3×3 convs in row bands (``conv_in_bands``), the same bits."""
        outputs = []
        x = None
        for i, res_blocks in enumerate(self.res_blocks):
            feature = self.input_blocks[i](features[i])
            x = feature if i == 0 else x + feature
            for block in res_blocks:
                x = block(x, band_rows=band_rows)
            outputs.append(self.output_blocks[i](x))
            if i < len(self.resamplers):
                upsample, conv = self.resamplers[i]
                x = conv_in_bands(conv, upsample(x), band_rows)
        return outputs


class MLP(nn.Sequential):
    """Linear layers with ReLU between them (the scale head)."""

    def __init__(self, dims: Sequence[int]):
        layers: list[nn.Module] = []
        for dim_in, dim_out in zip(dims[:-2], dims[1:-1]):
            layers += [nn.Linear(dim_in, dim_out), nn.ReLU(inplace=True)]
        super().__init__(*layers, nn.Linear(dims[-2], dims[-1]))


# -- geometry --------------------------------------------------------------------------------------

def normalized_view_plane_uv(width: int, height: int, aspect_ratio: float, *, dtype: torch.dtype,
                             device: torch.device) -> torch.Tensor:
    """``[H, W, 2]`` pixel-centre coordinates on the view plane, the image diagonal spanning [-1, 1]."""
    span_x = aspect_ratio / (1 + aspect_ratio ** 2) ** 0.5
    span_y = 1 / (1 + aspect_ratio ** 2) ** 0.5
    half_u, half_v = span_x * (width - 1) / width, span_y * (height - 1) / height
    u = torch.linspace(-half_u, half_u, width, dtype=dtype, device=device)
    v = torch.linspace(-half_v, half_v, height, dtype=dtype, device=device)
    u, v = torch.meshgrid(u, v, indexing="xy")
    return torch.stack([u, v], dim=-1)


def recover_focal_shift(points: torch.Tensor, mask: torch.Tensor | None = None,
                        downsample_size: tuple[int, int] = (64, 64)) -> tuple[torch.Tensor, torch.Tensor]:
    """Focal (relative to half the image diagonal) and z shift that make ``points`` [..., H, W, 3] a pinhole
    view: ``min |focal · xy / (z + shift) − uv|`` over a nearest-neighbour ``downsample_size`` sample of the
    (masked) map, by Levenberg–Marquardt (MoGe's ``recover_focal_shift``). Fewer than two valid samples give
    focal 1, shift 0. Returns two tensors of the batch shape ``[...]``."""
    from scipy.optimize import least_squares

    shape = points.shape
    height, width = shape[-3], shape[-2]
    points = points.reshape(-1, *shape[-3:])
    mask = None if mask is None else mask.reshape(-1, *shape[-3:-1])
    uv = normalized_view_plane_uv(width, height, width / height, dtype=points.dtype, device=points.device)
    points_lr = F.interpolate(points.permute(0, 3, 1, 2), downsample_size, mode="nearest").permute(0, 2, 3, 1)
    uv_lr = F.interpolate(uv.unsqueeze(0).permute(0, 3, 1, 2), downsample_size, mode="nearest")
    uv_lr = uv_lr.squeeze(0).permute(1, 2, 0)
    uv_np, points_np = uv_lr.cpu().numpy(), points_lr.detach().cpu().numpy()
    if mask is not None:
        mask_np = (F.interpolate(mask.to(torch.float32).unsqueeze(1), downsample_size, mode="nearest").squeeze(1) > 0
                   ).cpu().numpy()
    focals, shifts = [], []
    for i in range(points.shape[0]):
        xyz, uv_i = (points_np[i], uv_np) if mask is None else (points_np[i][mask_np[i]], uv_np[mask_np[i]])
        if uv_i.shape[0] < 2:
            focals.append(1.0)
            shifts.append(0.0)
            continue
        uv_i, xy, z = uv_i.reshape(-1, 2), xyz[..., :2].reshape(-1, 2), xyz[..., 2].reshape(-1)
        # float64 from here (the shift SciPy passes is float64), as MoGe's residual computes it
        solution = least_squares(functools.partial(_reprojection_error, uv_i, xy, z), x0=0, ftol=1e-3, method="lm")
        shift = solution["x"].squeeze().astype(np.float32)
        projected = xy / (z + shift)[:, None]
        focals.append(float((projected * uv_i).sum() / np.square(projected).sum()))
        shifts.append(float(shift))
    batch = shape[:-3]
    return (torch.tensor(focals, device=points.device, dtype=points.dtype).reshape(batch),
            torch.tensor(shifts, device=points.device, dtype=points.dtype).reshape(batch))


def _reprojection_error(uv: np.ndarray, xy: np.ndarray, z: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """Residuals of the best focal for ``shift``: ``f · xy/(z+shift) − uv`` with ``f`` solved in closed form."""
    projected = xy / (z + shift)[:, None]
    focal = (projected * uv).sum() / np.square(projected).sum()
    return (focal * projected - uv).ravel()


def intrinsics_from_focal_center(fx: torch.Tensor, fy: torch.Tensor, cx: torch.Tensor,
                                 cy: torch.Tensor) -> torch.Tensor:
    """``[..., 3, 3]`` OpenCV intrinsics from batched focal lengths and a principal point."""
    fx, fy, cx, cy = torch.broadcast_tensors(fx, fy, cx, cy)
    zeros, ones = torch.zeros_like(fx), torch.ones_like(fx)
    return torch.stack([fx, zeros, cx, zeros, fy, cy, zeros, zeros, ones], dim=-1).unflatten(-1, (3, 3))


def depth_to_points(depth: torch.Tensor, intrinsics: torch.Tensor) -> torch.Tensor:
    """Camera-space points ``[B, H, W, 3]`` of a depth map ``[B, H, W]`` under normalised intrinsics ``[B, 3, 3]``:
    pixel centres ``((j+0.5)/W, (i+0.5)/H, 1) · depth`` through the inverse of the homogeneous 4×4 intrinsics
    (how MoGe's ``utils3d`` unprojects)."""
    height, width = depth.shape[-2:]
    dtype, device = depth.dtype, depth.device
    u = torch.linspace(0.5 / width, 1 - 0.5 / width, width, dtype=dtype, device=device)
    v = torch.linspace(0.5 / height, 1 - 0.5 / height, height, dtype=dtype, device=device)
    u, v = torch.meshgrid(u, v, indexing="xy")
    uv = torch.stack([u, v], dim=2)  # [H, W, 2]
    k = intrinsics[..., None, :, :]  # [B, 1, 3, 3]
    k = torch.cat([torch.cat([k, torch.zeros((*k.shape[:-2], 3, 1), dtype=dtype, device=device)], dim=-1),
                   torch.tensor([[0, 0, 0, 1]], dtype=dtype, device=device).expand(*k.shape[:-2], 1, 4)], dim=-2)
    points = torch.cat([uv, torch.ones((*uv.shape[:-1], 1), dtype=dtype, device=device)], dim=-1) * depth[..., None]
    points = torch.cat([points, torch.ones((*points.shape[:-1], 1), dtype=dtype, device=device)], dim=-1)
    return (points @ torch.linalg.inv(k).mT)[..., :3]


# -- the model -------------------------------------------------------------------------------------

@dataclass
class MoGeOutput:
    """What ``MoGe2.infer`` returns (batch dimension dropped for a ``[3, H, W]`` input).

    points:     ``[B, H, W, 3]`` metric camera-space points, ``inf`` outside the mask
    depth:      ``[B, H, W]`` metric depth, ``inf`` outside the mask
    intrinsics: ``[B, 3, 3]`` normalised by the image width (row 0) and height (row 1)
    mask:       ``[B, H, W]`` bool: predicted valid (> 0.5) and in front of the camera
    normal:     ``[B, H, W, 3]`` unit normals (zero outside the mask), when the checkpoint has a normal head
    """

    points: torch.Tensor
    depth: torch.Tensor
    intrinsics: torch.Tensor
    mask: torch.Tensor
    normal: torch.Tensor | None = None


HEADS = ("points_head", "normal_head", "mask_head")


class MoGe2(nn.Module):
    """MoGe-2: DINOv2 encoder, conv neck, points/mask (and optional normal) heads, scale MLP (see the module
    docstring). Built from a checkpoint's ``model_config`` (``build_moge``)."""

    stream_lists = ("encoder.backbone.blocks",)  # what the ``stream`` policy streams: the ViT's blocks
    stream_unit = r"encoder\.backbone\.blocks\.\d+\."  # one block's names in model.pt (for the plan)

    def __init__(self, encoder: Mapping[str, Any], neck: Mapping[str, Any], points_head: Mapping[str, Any],
                 mask_head: Mapping[str, Any], scale_head: Mapping[str, Any],
                 normal_head: Mapping[str, Any] | None = None, remap_output: str = "linear",
                 num_tokens_range: Sequence[int] = (1200, 3600)):
        super().__init__()
        if remap_output not in ("linear", "sinh", "exp", "sinh_exp"):
            raise ValueError(f"remap_output {remap_output!r} is not one of linear, sinh, exp, sinh_exp")
        self.remap_output = remap_output
        self.num_tokens_range = tuple(int(n) for n in num_tokens_range)
        self.encoder = DINOv2Encoder(**encoder)
        self.neck = ConvStack(**neck)
        self.points_head = ConvStack(**points_head)
        self.mask_head = ConvStack(**mask_head)
        self.normal_head = ConvStack(**normal_head) if normal_head is not None else None
        self.scale_head = MLP(**scale_head)

    def _remap(self, points: torch.Tensor) -> torch.Tensor:
        if self.remap_output == "sinh":
            return torch.sinh(points)
        if self.remap_output == "exp":
            xy, z = points.split([2, 1], dim=-1)
            z = torch.exp(z)
            return torch.cat([xy * z, z], dim=-1)
        if self.remap_output == "sinh_exp":
            xy, z = points.split([2, 1], dim=-1)
            return torch.cat([torch.sinh(xy), torch.exp(z)], dim=-1)
        return points

    def forward(self, image: torch.Tensor, num_tokens: int, *, band_rows: int | None = None
                ) -> dict[str, torch.Tensor]:
        """Raw predictions for ``image`` [B, 3, H, W] in [0, 1] on a grid of about ``num_tokens`` tokens: affine
        ``points`` [B, H, W, 3], ``mask`` [B, H, W] (probability), ``metric_scale`` [B], ``normal`` if present.
        ``band_rows``: the neck's and heads' 3×3 convs in row bands of that many rows (the same bits, less
        memory: ``conv_in_bands``)."""
        batch, _, height, width = image.shape
        aspect = width / height
        rows, cols = round((num_tokens / aspect) ** 0.5), round((num_tokens * aspect) ** 0.5)
        # 1. encoder, then the view-plane UV map of each level's size as two more channels
        features, cls_token = self.encoder(image, rows, cols)
        levels = []
        for level in range(5):
            uv = normalized_view_plane_uv(cols * 2 ** level, rows * 2 ** level, aspect, dtype=image.dtype,
                                          device=image.device)
            uv = uv.permute(2, 0, 1).unsqueeze(0).expand(batch, -1, -1, -1)
            levels.append(torch.concat([features, uv], dim=1) if level == 0 else uv)
        # 2. neck, 3. heads (their last level, resized to the image)
        neck = self.neck(levels, band_rows=band_rows)
        heads = {name: getattr(self, name)(neck, band_rows=band_rows)[-1] for name in HEADS
                 if getattr(self, name) is not None}
        heads = {name: F.interpolate(v, (height, width), mode="bilinear", align_corners=False, antialias=False)
                 for name, v in heads.items()}
        out = {"points": self._remap(heads["points_head"].permute(0, 2, 3, 1)),
               "mask": heads["mask_head"].squeeze(1).sigmoid(),
               "metric_scale": self.scale_head(cls_token).squeeze(1).exp()}
        if "normal_head" in heads:
            out["normal"] = F.normalize(heads["normal_head"].permute(0, 2, 3, 1), dim=-1)
        return out

    @torch.no_grad()  # MoGe uses inference_mode: the same numbers, but it refuses the audit's tensor subclass
    def infer(self, image: torch.Tensor, *, resolution_level: int = 9, num_tokens: int | None = None,
              use_fp16: bool = True, band_rows: int | None = None) -> MoGeOutput:
        """MoGe's ``infer`` with its defaults (``force_projection``, ``apply_mask``, focal recovered): metric
        points, depth, normalised intrinsics and mask of ``image`` [3, H, W] or [B, 3, H, W] in [0, 1].

        ``use_fp16``: the forward under float16 autocast on the model's device type (MoGe's default; where the
        device type has no autocast, such as the audit's stand-in device, it runs in the weights' dtype).
        ``band_rows``: the conv neck's and heads' 3×3 convs in row bands (``forward``)."""
        squeeze = image.dim() == 3
        image = (image.unsqueeze(0) if squeeze else image).to(dtype=self.dtype, device=self.device)
        height, width = image.shape[-2:]
        aspect = width / height
        if num_tokens is None:
            low, high = self.num_tokens_range
            num_tokens = int(low + (resolution_level / 9) * (high - low))
        device_type = self.device.type
        autocast = use_fp16 and self.dtype != torch.float16 and torch.amp.is_autocast_available(device_type)
        with torch.autocast(device_type=device_type, dtype=torch.float16) if autocast else contextlib.nullcontext():
            raw = self.forward(image, num_tokens, band_rows=band_rows)
        points, mask, scale = raw["points"].float(), raw["mask"].float(), raw["metric_scale"].float()
        normal = raw["normal"].float() if "normal" in raw else None
        # in float32 from here (MoGe's float32 autocast region there is a no-op: its inputs are float32)
        valid = mask > 0.5
        focal, shift = recover_focal_shift(points, valid)
        root = (1 + aspect ** 2) ** 0.5
        fx, fy = focal / 2 * root / aspect, focal / 2 * root
        centre = torch.tensor(0.5, device=points.device, dtype=points.dtype)
        intrinsics = intrinsics_from_focal_center(fx, fy, centre, centre)
        points[..., 2] += shift[..., None, None]
        valid &= points[..., 2] > 0
        depth = points[..., 2].clone()
        points = depth_to_points(depth, intrinsics)
        points *= scale[:, None, None, None]
        depth *= scale[:, None, None]
        points = torch.where(valid[..., None], points, torch.inf)
        depth = torch.where(valid, depth, torch.inf)
        if normal is not None:
            normal = torch.where(valid[..., None], normal, torch.zeros_like(normal))
        out = MoGeOutput(points=points, depth=depth, intrinsics=intrinsics, mask=valid, normal=normal)
        if squeeze:
            out = MoGeOutput(**{k: None if v is None else v.squeeze(0) for k, v in vars(out).items()})
        return out

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype


# -- building and loading --------------------------------------------------------------------------

CONFIG_KEYS = {"encoder", "neck", "points_head", "mask_head", "normal_head", "scale_head", "remap_output",
               "num_tokens_range"}
REQUIRED_KEYS = ("encoder", "neck", "points_head", "mask_head", "scale_head")


def build_moge(model_config: Mapping[str, Any], *, device: torch.device | str = "meta", source: str = "model_config"
               ) -> MoGe2:
    """``MoGe2`` from a checkpoint's ``model_config`` on ``device`` (default meta); an unknown or missing key, an
    unknown backbone or an invalid value is a ``CheckpointError`` naming it (MoGe's own constructor ignores
    unknown keys with a warning)."""
    if not isinstance(model_config, Mapping):
        raise CheckpointError(f"{source}: model_config must be a mapping, got {type(model_config).__name__}")
    unknown = sorted(set(model_config) - CONFIG_KEYS)
    missing = [k for k in REQUIRED_KEYS if model_config.get(k) is None]
    if unknown or missing:
        raise CheckpointError(f"{source}: model_config has unknown keys {unknown} / lacks {missing}; a MoGe-2 "
                              f"config has {sorted(CONFIG_KEYS)} (is this a MoGe-1 checkpoint? use a MoGe-2 one, "
                              f"e.g. Ruicheng/moge-2-vitl)")
    backbone = model_config["encoder"].get("backbone") if isinstance(model_config["encoder"], Mapping) else None
    if backbone not in BACKBONES:
        raise CheckpointError(f"{source}: encoder.backbone {backbone!r} is not one of {sorted(BACKBONES)}")
    try:
        with torch.device(device):
            return MoGe2(**model_config)
    except (TypeError, ValueError, KeyError) as err:
        raise CheckpointError(f"{source}: model_config does not describe a MoGe-2 network ({err})") from None


def read_checkpoint(path: str | Path, *, map_location: torch.device | str = "cpu") -> dict[str, Any]:
    """``{"model_config", "model"}`` of a MoGe ``model.pt`` (``weights_only=True``; tensors memory-mapped), or a
    ``CheckpointError`` saying what is wrong and what to do. ``map_location="meta"`` reads shapes only."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"MoGe-2 weights {path} do not exist; fetch Ruicheng/moge-2-vitl (model.pt) or "
                              f"pass fov=DEG")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True, mmap=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as err:
        raise CheckpointError(f"MoGe-2 weights {path} are not a readable torch checkpoint ({_first_line(err)}); "
                              f"delete the file and download it again") from None
    if (not isinstance(checkpoint, Mapping) or not isinstance(checkpoint.get("model"), Mapping)
            or "model_config" not in checkpoint):
        keys = sorted(checkpoint) if isinstance(checkpoint, Mapping) else type(checkpoint).__name__
        raise CheckpointError(f"{path} is not a MoGe checkpoint: it holds {keys}, not 'model_config' and 'model'")
    return dict(checkpoint)


def checkpoint_bytes(path: str | Path) -> int:
    """Tensor bytes of a MoGe ``model.pt`` (read from its index, no data loaded): what the plan counts."""
    state = read_checkpoint(path, map_location="meta")["model"]
    return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))


def checkpoint_tensor_bytes(path: str | Path) -> dict[str, int]:
    """Each tensor's bytes in a MoGe ``model.pt`` (name -> bytes, from its index, no data loaded): what the
    ``stream`` policy's plan splits into the blocks (``MoGe2.stream_unit``) and the rest."""
    state = read_checkpoint(path, map_location="meta")["model"]
    return {k: t.numel() * t.element_size() for k, t in state.items() if isinstance(t, torch.Tensor)}


def released_tensor_bytes(listed_bytes: int) -> dict[str, int]:
    """The release's blocks and the rest, for a plan made before ``model.pt`` is downloaded (the Hub lists only
    its size, ``listed_bytes``): the 24 float32 blocks of its ViT-L/14 (built on meta), and everything else as
    one entry of the listed size less theirs (the file's ~0.2 MB of pickle counted with it: over, not under)."""
    size = BACKBONES[RELEASED_BACKBONE]
    with torch.device("meta"):
        block = Block(size.embed_dim, size.num_heads, size.mlp_ratio)
    unit = sum(t.numel() * 4 for t in block.state_dict().values())
    tensors = {f"encoder.backbone.blocks.{i}.all": unit for i in range(size.depth)}
    tensors["rest"] = max(0, listed_bytes - size.depth * unit)
    return tensors


def load_moge(path: str | Path, device: torch.device | str = "cpu") -> MoGe2:
    """MoGe-2 from ``model.pt`` on ``device``: built on meta from its ``model_config``, every tensor checked
    (missing, unexpected, shape) and assigned in the model's dtype; eval mode, no gradients."""
    model, state = _checked(path)
    expected = dict(model.state_dict(keep_vars=True))
    model.load_state_dict({k: state[k].to(device=device, dtype=expected[k].dtype) for k in expected},
                          strict=True, assign=True)
    return model.eval().requires_grad_(False)


def load_moge_streamed(path: str | Path, stream: WeightStream, *, pin: bool = False) -> MoGe2:
    """``load_moge`` for the ``stream`` policy: the ViT's blocks (``MoGe2.stream_lists``) stay on ``meta`` and
    stream to ``stream``'s device one at a time as the encoder reaches them, read from the memory-mapped
    ``model.pt`` (``pin``: from pinned host copies made now, for CUDA when host memory has room); the rest (patch
    embedding, neck, heads: 0.09 GB of the release's 1.30 GB) loads onto the device whole. The same checks, the
    same bytes in the same dtypes: the same bits as ``load_moge``."""
    model, state = _checked(path)
    expected = dict(model.state_dict(keep_vars=True))
    prefixes = tuple(f"{name}." for name in model.stream_lists)
    resident, sources = {}, {}
    for key, target in expected.items():
        stored = state[key]
        if key.startswith(prefixes):
            sources[key] = stored.to(target.dtype).pin_memory() if pin else stored
        else:
            value = stored.to(device=stream.device, dtype=target.dtype)
            resident[key] = value.clone() if stream.copy and value.data_ptr() == stored.data_ptr() else value
    model.load_state_dict(resident, strict=False, assign=True)
    stream_model(model, model.stream_lists, sources, stream)
    return model.eval().requires_grad_(False)


def _checked(path: str | Path) -> tuple[MoGe2, Mapping[str, torch.Tensor]]:
    """The network ``model.pt``'s ``model_config`` describes, on meta, and its state (memory-mapped), every key and
    shape checked against each other (a ``CheckpointError`` listing what differs)."""
    checkpoint = read_checkpoint(path)
    model = build_moge(checkpoint["model_config"], device="meta", source=str(path))
    expected = dict(model.state_dict(keep_vars=True))
    state = checkpoint["model"]
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = [f"{k}: file {list(state[k].shape)} vs model {list(expected[k].shape)}"
                  for k in sorted(set(expected) & set(state)) if tuple(state[k].shape) != tuple(expected[k].shape)]
    if missing or unexpected or mismatched:
        lines = [f"{path} does not match the MoGe-2 its model_config describes:"]
        for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched)):
            if items:
                more = f", ... ({len(items)} in all)" if len(items) > 8 else ""
                lines.append(f"  {label}: {', '.join(items[:8])}{more}")
        raise CheckpointError("\n".join(lines))
    empty = [k for k in expected if state[k].is_meta]
    if empty:
        raise CheckpointError(f"{path} stores no data for {len(empty)} tensors (e.g. {empty[0]}): it was saved from a "
                              f"model on the meta device; use the published model.pt")
    return model, state


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
