"""NAF, Neighborhood Attention Filtering (valeoai/NAF): upsample DINO patch features guided by the image.

Pure PyTorch, key-compatible with the published ``naf_release.pth`` (no ``natten``). The maths, top to bottom:

1. Image encoder on the [0, 1] RGB image: two conv stacks (1×1 ``encoder`` and 3×3 ``sem_encoder``, reflect
   padding; each Conv2d(3→dim/2) then ``img_layers`` blocks GroupNorm(8)→SiLU→conv→GroupNorm→SiLU→conv, no
   residual), concatenated to ``dim`` channels, ``adaptive_avg_pool2d`` to the target T×T, then an axial 2-D
   RoPE (``heads_rope`` heads; periods ``base^(2j/(D/2))``; coords ``(i+0.5)/n·2−1``) — the *queries*.
2. Keys: the queries ``adaptive_avg_pool2d``-ed to the patch grid h×w. Values: the DINO patch features.
3. Keys/values are ``nearest-exact``-upsampled to T×T and attended with a 9×9 neighbourhood at dilation
   ``T/h`` (NATTEN ``na2d``: per dilation sub-lattice the window is centred on the query and clamped to stay
   inside). With T a multiple of h the upsampled maps are block-constant, so every pixel of one patch
   attends to the same 9×9 block of patches, starting at ``clamp(patch − 4, 0, h − 9)`` per axis — which is
   what ``_attend`` computes, on the small maps, for any set of pixels.

Three entry points:
* ``forward``: the full ``[1, C, T, T]`` map (4 GiB at T=1024, C=1024), as the reference.
* ``sample``: ``sample_map(forward(...), grid)`` bit for bit without that map: attention only at the pixels
  the bilinear taps read (a pixel's value does not depend on which other pixels are computed), then
  ``grid_sample`` itself on a zero map holding those pixels, a chunk of channels at a time. The guidance
  map is never whole either (``TiledEncoder``: one map per encoder branch, in place, GroupNorm a group and a
  3×3 convolution a band of rows at a time; the same bits at the released width on the CPU).
* ``features_at``: ``[P, C]`` at chosen pixels with the encoder run over bands of rows (``BandedEncoder``),
  each GroupNorm's statistics gathered in an earlier pass: peak one band, values within ~1e-7 of the
  full map (the statistics are reduced in another order; that order cannot be reproduced in bands, since
  PyTorch's GroupNorm reduces a whole group at once in a kernel- and ISA-specific order).
"""
from __future__ import annotations

import math
import pickle
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from ..devices import kind
from ..nn.limits import current_limits
from ..staging.stream import release_freed_heap
from .loading import CheckpointError, register_model
from .projection import read_pixels, sample_map

_BAND_BYTES = 64 << 20  # activation budget of one band of the banded encoder
_SAMPLE_MAP_BYTES = 256 << 20  # one channel chunk of the sparse map ``NAF.sample`` bilinear-samples


class EncBlock(nn.Module):
    """GroupNorm → SiLU → conv → GroupNorm → SiLU → conv, reflect padding, no residual (as published)."""

    def __init__(self, channels: int, kernel_size: int, num_groups: int = 8):
        super().__init__()
        self.norm1 = nn.GroupNorm(num_groups, channels)
        self.conv1 = nn.Conv2d(channels, channels, kernel_size, padding=kernel_size // 2, padding_mode="reflect")
        self.norm2 = nn.GroupNorm(num_groups, channels)
        self.conv2 = nn.Conv2d(channels, channels, kernel_size, padding=kernel_size // 2, padding_mode="reflect")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(F.silu(self.norm1(x), inplace=True))  # in place on the norm's fresh output: one map less
        return self.conv2(F.silu(self.norm2(x), inplace=True))


def conv_stack(in_channels: int, channels: int, kernel_size: int, num_layers: int) -> nn.Sequential:
    """Conv2d stem then ``num_layers`` EncBlocks; indices 0..num_layers match the published ``encoder.N`` keys."""
    stem = nn.Conv2d(in_channels, channels, kernel_size, padding=kernel_size // 2, padding_mode="reflect")
    return nn.Sequential(stem, *[EncBlock(channels, kernel_size) for _ in range(num_layers)])


class AxialRoPE(nn.Module):
    """2-D rotary embedding without mixing of axes; ``periods`` is a stored (persistent) buffer as published."""

    def __init__(self, dim: int, num_heads: int, base: float):
        super().__init__()
        if dim % (4 * num_heads):
            raise ValueError(f"RoPE dim {dim} must be divisible by 4 * num_heads ({4 * num_heads})")
        self.num_heads = num_heads
        head_dim = dim // num_heads
        exponents = 2 * torch.arange(head_dim // 4, dtype=torch.float32) / (head_dim // 2)
        self.register_buffer("periods", base ** exponents, persistent=True)  # [head_dim / 4]

    def rotate(self, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Rotate ``x [P, dim]`` at pixels (rows, cols) of an ``height × width`` map."""
        coord_y = (rows.to(torch.float32) + 0.5) / height * 2.0 - 1.0
        coord_x = (cols.to(torch.float32) + 0.5) / width * 2.0 - 1.0
        coords = torch.stack([coord_y, coord_x], dim=-1)  # [P, 2]
        angles = 2 * math.pi * coords[:, :, None] / self.periods[None, None, :]  # [P, 2, D/4]
        angles = angles.flatten(1, 2).tile(2)  # [P, D]: [u..., v..., u..., v...]
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # [P, 1, D]
        x = x.reshape(x.shape[0], self.num_heads, -1)  # [P, heads, D]
        first, second = x.chunk(2, dim=-1)
        rotated = x * cos + torch.cat([-second, first], dim=-1) * sin
        return rotated.reshape(x.shape[0], -1)


class ImageEncoder(nn.Module):
    """Image → ``dim``-channel guidance map (1×1 and 3×3 conv stacks) with a 2-D RoPE."""

    def __init__(self, dim: int, heads_rope: int, rope_base: float, img_layers: int):
        super().__init__()
        self.encoder = conv_stack(3, dim // 2, 1, img_layers)
        self.sem_encoder = conv_stack(3, dim // 2, 3, img_layers)
        self.rope = AxialRoPE(dim, heads_rope, rope_base)

    def encode(self, image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """Un-rotated guidance map ``[1, dim, T, T]`` of ``image [1, 3, H, W]`` in [0, 1]."""
        image = reduced_image(image, size)
        x = torch.cat([self.encoder(image), self.sem_encoder(image)], dim=1)
        if tuple(x.shape[-2:]) == tuple(size):
            return x  # pooling to the same size is the identity (and would copy T×T×dim)
        return F.adaptive_avg_pool2d(x, size)

    def rotate_map(self, x: torch.Tensor) -> torch.Tensor:
        """RoPE over a whole ``[1, dim, H, W]`` map."""
        _, dim, height, width = x.shape
        rows = torch.arange(height, device=x.device).repeat_interleave(width)
        cols = torch.arange(width, device=x.device).repeat(height)
        flat = x[0].reshape(dim, -1).T  # [HW, dim]
        return self.rope.rotate(flat, rows, cols, height, width).T.reshape(1, dim, height, width)


@register_model("NAF")
class NAF(nn.Module):
    """Neighborhood Attention Filtering upsampler; defaults are the released model (``config/model/naf.yaml``)."""

    training_only_args = ("rope_rescale", "use_encoder", "use_semencoder")

    def __init__(self, dim: int = 256, heads_attn: int = 4, heads_rope: int = 4, kernel_size: int = 9,
                 rope_base: float = 100.0, img_layers: int = 2):
        super().__init__()
        if dim % heads_attn:
            raise ValueError(f"dim {dim} must be divisible by heads_attn {heads_attn}")
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size {kernel_size} must be odd")
        self.heads = heads_attn
        self.kernel_size = kernel_size
        self.scale = (dim // heads_attn) ** -0.5
        self.image_encoder = ImageEncoder(dim, heads_rope, rope_base, img_layers)

    # -- public entry points ------------------------------------------------------------------
    def forward(self, image: torch.Tensor, features: torch.Tensor, output_size: tuple[int, int]) -> torch.Tensor:
        """Upsampled features ``[1, C, T, T]`` of ``features [1, C, h, w]`` guided by ``image [1, 3, H, W]``."""
        height, width = output_size
        rows = torch.arange(height, device=image.device).repeat_interleave(width)
        cols = torch.arange(width, device=image.device).repeat(height)
        self._check(image, features, output_size)
        queries, keys = self._queries_and_keys(image, output_size, features.shape[-2:], rows, cols)
        out = self._attend(queries, rows, cols, keys, features, output_size)  # [T*T, C]
        return out.view(1, height, width, -1).permute(0, 3, 1, 2)  # channels-last view: no second T×T×C copy

    def sample(self, image: torch.Tensor, features: torch.Tensor, output_size: tuple[int, int],
               grid: torch.Tensor, *, tiled: bool = True) -> torch.Tensor:
        """``sample_map(self(image, features, output_size), grid)`` bit for bit, ``[K, C]``, without the map.

        grid_sample treats channels independently and reads only the 2×2 taps of each point, so a map that
        is zero except at those pixels (``read_pixels``) gives the same result, chunk of channels by chunk.
        ``tiled``: the guidance map by ``TiledEncoder`` (the same bits; one map per encoder branch held instead
        of every layer's); ``False``: the whole guidance map, as ``forward``.
        """
        self._check(image, features, output_size)
        height, width = output_size
        pixels = read_pixels(grid, height, width)
        rows, cols = pixels[:, 0], pixels[:, 1]
        tiles = TiledEncoder(self.image_encoder, image, output_size, features.shape[-2:]) if tiled else None
        if tiles is not None and tiles.applies:
            queries, keys = tiles.queries_and_keys(rows, cols)
        else:
            queries, keys = self._queries_and_keys(image, output_size, features.shape[-2:], rows, cols)
        values = self._attend(queries, rows, cols, keys, features, output_size)  # [P, C]
        del queries, keys
        channels = values.shape[1]
        step = max(1, min(channels, _SAMPLE_MAP_BYTES // (height * width * values.element_size())))
        buffer = values.new_zeros(1, step, height, width)
        flat = rows * width + cols
        out = values.new_empty(grid.shape[0], channels)
        for first in range(0, channels, step):
            n = min(step, channels - first)
            part = buffer[:, :n]  # a prefix of the channels: still contiguous
            part.view(n, -1)[:, flat] = values[:, first:first + n].T
            out[:, first:first + n] = sample_map(part, grid)
        return out

    def features_at(self, image: torch.Tensor, features: torch.Tensor, output_size: tuple[int, int],
                    pixels: torch.Tensor) -> torch.Tensor:
        """Upsampled features ``[P, C]`` at ``pixels [P, 2]`` (row, col) of the T×T output only."""
        self._check(image, features, output_size)
        rows, cols = pixels[:, 0].long(), pixels[:, 1].long()
        banded = BandedEncoder(self.image_encoder, image, output_size, features.shape[-2:])
        queries, keys = banded.queries_and_keys(rows, cols) if banded.applies else \
            self._queries_and_keys(image, output_size, features.shape[-2:], rows, cols)
        return self._attend(queries, rows, cols, keys, features, output_size)

    def _queries_and_keys(self, image: torch.Tensor, output_size: tuple[int, int], patch_grid: torch.Size,
                          rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated queries ``[P, dim]`` at (rows, cols) and keys ``[1, dim, h, w]`` from the whole guidance map."""
        encoded = self.image_encoder.encode(image, output_size)  # [1, dim, T, T]
        keys = self._keys(encoded, patch_grid)
        queries = encoded[0][:, rows, cols].T  # [P, dim]
        return self.image_encoder.rope.rotate(queries, rows, cols, *output_size), keys

    # -- the maths ----------------------------------------------------------------------------
    def _check(self, image: torch.Tensor, features: torch.Tensor, output_size: tuple[int, int]) -> None:
        if image.dim() != 4 or image.shape[:2] != (1, 3) or features.dim() != 4 or features.shape[0] != 1:
            raise ValueError(f"NAF takes image [1, 3, H, W] and features [1, C, h, w]; got {tuple(image.shape)} "
                             f"and {tuple(features.shape)}")
        for target, patches in zip(output_size, features.shape[-2:]):
            if target % patches or patches < self.kernel_size:
                raise ValueError(f"NAF output size {tuple(output_size)} must be a multiple of the feature grid "
                                 f"{tuple(features.shape[-2:])}, which needs at least {self.kernel_size} patches "
                                 f"per side (the attention window)")

    def _keys(self, encoded: torch.Tensor, patch_grid: torch.Size) -> torch.Tensor:
        """Keys ``[1, dim, h, w]``: the rotated guidance map pooled to the patch grid, a band of rows at a time."""
        height = encoded.shape[2]
        band = key_band_rows(encoded.shape[1:], patch_grid)
        return torch.cat([band_keys(self.image_encoder.rope, encoded[:, :, top:top + band], top, height, patch_grid)
                          for top in range(0, height, band)], dim=2)

    def _attend(self, queries: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor, output_size: tuple[int, int]) -> torch.Tensor:
        """9×9 dilated neighbourhood attention of ``queries [P, dim]`` over patch keys/values -> ``[P, C]``."""
        patch_h, patch_w = values.shape[-2:]
        channels = values.shape[1]
        k = self.kernel_size
        window = torch.arange(k, device=queries.device)
        start_y = (rows // (output_size[0] // patch_h) - k // 2).clamp(0, patch_h - k)
        start_x = (cols // (output_size[1] // patch_w) - k // 2).clamp(0, patch_w - k)
        key_flat = keys[0].reshape(keys.shape[1], -1).T.reshape(patch_h * patch_w, self.heads, -1)  # [hw, n, dk]
        value_flat = values[0].reshape(channels, -1).T.reshape(patch_h * patch_w, self.heads, -1)  # [hw, n, dv]
        queries = queries.reshape(queries.shape[0], self.heads, -1)  # [P, n, dk]
        out = queries.new_empty(queries.shape[0], channels)
        chunk = max(1, current_limits().naf_elements // (k * k * channels))
        for begin in range(0, queries.shape[0], chunk):
            sl = slice(begin, begin + chunk)
            index = ((start_y[sl, None] + window)[:, :, None] * patch_w
                     + (start_x[sl, None] + window)[:, None, :]).reshape(-1, k * k)  # [p, k*k]
            logits = torch.einsum("pnd,pmnd->pnm", queries[sl], key_flat[index]) * self.scale
            weights = logits.softmax(dim=-1)
            out[sl] = torch.einsum("pnm,pmnd->pnd", weights, value_flat[index]).reshape(-1, channels)
        return out


def key_band_rows(map_shape: torch.Size, patch_grid: torch.Size) -> int:
    """Guidance-map rows per band of ``NAF._keys`` for a ``[dim, T, T]`` map: whole patch rows, ~4M elements."""
    dim, height, width = map_shape
    rows_per_patch = height // patch_grid[0]
    return max(1, (1 << 22) // (rows_per_patch * width * dim)) * rows_per_patch


def band_keys(rope: AxialRoPE, chunk: torch.Tensor, top: int, height: int, patch_grid: torch.Size) -> torch.Tensor:
    """Keys of the guidance-map rows ``chunk [1, dim, b, T]`` starting at row ``top``: rotated, pooled to patches."""
    _, dim, rows_in, width = chunk.shape
    rows = torch.arange(top, top + rows_in, device=chunk.device).repeat_interleave(width)
    cols = torch.arange(width, device=chunk.device).repeat(rows_in)
    flat = rope.rotate(chunk[0].reshape(dim, -1).T, rows, cols, height, width)
    rotated = flat.T.reshape(1, dim, rows_in, width)
    return F.adaptive_avg_pool2d(rotated, (rows_in // (height // patch_grid[0]), patch_grid[1]))


def reduced_image(image: torch.Tensor, output_size: tuple[int, int]) -> torch.Tensor:
    """The image the encoder reads: as published, never more than 4× the output size (min over both sides, as
    upstream)."""
    height, width = output_size
    if image.shape[-2] > 4 * height or image.shape[-1] > 4 * width:
        reduced = (min(image.shape[-2], 4 * height, 4 * width), min(image.shape[-1], 4 * width, 4 * height))
        image = F.interpolate(image, size=reduced, mode="bilinear", align_corners=False)
    return image


class TiledEncoder:
    """``ImageEncoder``'s guidance map with the reference's bits, holding one map per branch, never the whole map.

    Each branch (the 1×1 ``encoder``, the 3×3 ``sem_encoder``) keeps one ``dim/2``-channel map at the encoder's
    resolution and takes it through its layers:
    * GroupNorm in place, one group at a time: ``F.group_norm`` over one group's channels of the whole map is the
      same kernel over the same numbers in the same order as the whole call, so its statistics and outputs are
      the same bits (statistics over bands cannot be: PyTorch reduces a group in a kernel- and ISA-specific order);
    * SiLU over the whole map, in place, as ``EncBlock`` does;
    * a 3×3 convolution in place over bands of rows with the halo its kernel reads (``halo``), the rows above a
      band kept from before the previous band overwrote them. The stems and the 1×1 convolutions run whole (a
      new map, the old one freed): oneDNN picks their kernels' blocking by the map's size, so bands of them are
      other bits (on AVX-512, 16- and 100-row bands of a 1024² 1×1 convolution; 30-row bands of the 512² stem).
    The last 3×3 convolution runs in bands of whole ``NAF._keys`` bands, beside the 1×1 branch's output, with the
    concatenation, the pooling to T×T, the queries at the chosen pixels and the band's keys. Peak: three
    ``dim/2``-channel maps at the encoder's resolution (a whole convolution's input, output and oneDNN's blocked
    copy; the 3×3 stem's beside the 1×1 branch's output): 1.5 GiB at 1024², where the whole encoder holds 3.5.
    Applies when the (≤4T-reduced) image height is a multiple of T (pooling over bands is then exact) and the
    encoder has blocks.
    """

    def __init__(self, encoder: ImageEncoder, image: torch.Tensor, output_size: tuple[int, int],
                 patch_grid: torch.Size):
        self.encoder = encoder
        self.image = reduced_image(image, output_size)
        self.output_size = tuple(output_size)
        self.patch_grid = tuple(patch_grid)
        self.factor = self.image.shape[-2] // output_size[0]
        self.applies = self.image.shape[-2] == self.factor * output_size[0] and len(encoder.encoder) > 1

    def halo(self, conv: nn.Conv2d) -> int:
        """Input rows a band's convolution reads beyond each edge of the band: half its kernel."""
        return conv.kernel_size[0] // 2

    def queries_and_keys(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated queries ``[P, dim]`` at (rows, cols) of the T×T guidance map and keys ``[1, dim, h, w]``."""
        enc = self.encoder
        stacks = (enc.encoder, enc.sem_encoder)
        maps = [self._through_layers(stack) for stack in stacks]  # 2 × [1, dim/2, H, W]
        height, width = self.output_size
        dim = sum(stack[0].out_channels for stack in stacks)
        key_band = key_band_rows(torch.Size((dim, height, width)), self.patch_grid)
        conv_rows = conv_band_rows(maps[1].shape[1], dim, maps[1].shape[-1], 1)
        band = key_band * -(-conv_rows // (key_band * self.factor))  # whole key bands, at least a conv band
        queries = self.image.new_empty(rows.shape[0], dim)
        keys = []
        for top in range(0, height, band):
            bottom = min(top + band, height)
            x = torch.cat([self._last_rows(m, stack[-1].conv2, top * self.factor, bottom * self.factor)
                           for m, stack in zip(maps, stacks)], dim=1)  # [1, dim, band·factor, W]
            if tuple(x.shape[-2:]) != (bottom - top, width):
                x = F.adaptive_avg_pool2d(x, (bottom - top, width))  # [1, dim, band, T]
            inside = ((rows >= top) & (rows < bottom)).nonzero().squeeze(1)
            queries[inside] = x[0][:, rows[inside] - top, cols[inside]].T
            keys += [band_keys(enc.rope, x[:, :, first:first + key_band], top + first, height, self.patch_grid)
                     for first in range(0, bottom - top, key_band)]
            del x
            self._release_band()
        return enc.rope.rotate(queries, rows, cols, height, width), torch.cat(keys, dim=2)

    def _release_band(self) -> None:
        """On the CPU, give a band's freed temporaries back to the OS: glibc keeps them (tens of MiB, under its
        mmap threshold) in the heap, where 64 bands of the 1024² pass grew the process by 0.8 GiB."""
        if kind(self.image.device).host_heap:
            release_freed_heap()

    def _through_layers(self, stack: nn.Sequential) -> torch.Tensor:
        """The branch's map after its layers, all but a last 3×3 convolution (that one runs in the final pass)."""
        x = self._conv(self.image, stack[0])  # [1, dim/2, H, W]
        last = stack[-1].conv2
        for block in stack[1:]:
            for norm, conv in ((block.norm1, block.conv1), (block.norm2, block.conv2)):
                self._group_norm_in_place(x, norm)
                F.silu(x, inplace=True)
                if conv.kernel_size[0] == 1:
                    x = self._conv(x, conv)
                elif conv is not last:
                    self._conv_in_place(x, conv)
        return x

    def _conv(self, x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
        """``conv(x)`` whole, into a new map: a stem (over the 3-channel image, whose oneDNN kernel gives other bits
        over bands: 30-row bands of a 512² image) or a 1×1 convolution (without the copy its reflect "padding" of
        0 makes)."""
        if conv.kernel_size[0] == 1:
            return F.conv2d(x, conv.weight, conv.bias)
        return conv(x)

    def _last_rows(self, x: torch.Tensor, last: nn.Conv2d, top: int, bottom: int) -> torch.Tensor:
        """Rows ``[top, bottom)`` of the branch's output: of ``x`` itself, or of its last 3×3 convolution."""
        if last.kernel_size[0] == 1:
            return x[:, :, top:bottom]
        return self._conv_band(x, last, top, bottom, x[:, :, max(0, top - self.halo(last)):top])

    @staticmethod
    def _group_norm_in_place(x: torch.Tensor, norm: nn.GroupNorm) -> None:
        """``x = norm(x)``, one group's channels of the whole map at a time (the same bits: see the class)."""
        per = x.shape[1] // norm.num_groups
        for first in range(0, x.shape[1], per):
            group = slice(first, first + per)
            x[:, group] = F.group_norm(x[:, group], 1, norm.weight[group], norm.bias[group], norm.eps)

    def _conv_in_place(self, x: torch.Tensor, conv: nn.Conv2d) -> None:
        """``x = conv(x)`` over bands of rows: each band reads the input rows above it from a copy kept before
        the previous band was written over them, and the rows below it from ``x``, still unchanged."""
        total, halo = x.shape[-2], self.halo(conv)
        band = min(total, conv_band_rows(x.shape[1], conv.out_channels, x.shape[-1], conv.kernel_size[0] // 2))
        above = x[:, :, :0]
        for top in range(0, total, band):
            bottom = min(top + band, total)
            out = self._conv_band(x, conv, top, bottom, above)
            above = x[:, :, max(top, bottom - halo):bottom].clone()
            x[:, :, top:bottom] = out
            del out
            self._release_band()

    def _conv_band(self, x: torch.Tensor, conv: nn.Conv2d, top: int, bottom: int,
                   above: torch.Tensor) -> torch.Tensor:
        """Rows ``[top, bottom)`` of ``conv(x)``: ``above`` (the input rows just above ``top``), the band and the
        ``halo`` rows below it from ``x``; what the map does not give of the kernel's reach is reflected, as
        ``padding_mode="reflect"`` does at the map's edges."""
        reach = conv.kernel_size[0] // 2
        below = x[:, :, bottom:min(x.shape[-2], bottom + self.halo(conv))]
        rows = torch.cat([above, x[:, :, top:bottom], below], dim=2)
        rows = F.pad(rows, (reach, reach, reach - above.shape[2], reach - below.shape[2]), mode="reflect")
        return F.conv2d(rows, conv.weight, conv.bias)


def conv_band_rows(in_channels: int, out_channels: int, width: int, reach: int) -> int:
    """Rows per band of ``TiledEncoder``'s in-place 3×3 convolutions: the band with its halo, its padded copy, the
    output and oneDNN's blocked copy of it within ``_BAND_BYTES``; a small map is one band. At the released width
    (128 channels) oneDNN's 3×3 convolution gives the same bits over bands of any height (test_naf.py: 3-row bands;
    1- to 100-row bands of a 1024² map); at 8 channels it does not (16-row bands of a 128² map differ), so the
    tiny NAF's small maps are never split."""
    per_row = 2 * (in_channels + out_channels) * (width + 2 * reach) * 4
    return max(2 * reach + 1, _BAND_BYTES // per_row)


class BandedEncoder:
    """``ImageEncoder`` evaluated a band of output rows at a time, for the queries at chosen pixels and the keys.

    A band needs its rows plus a halo (one row per 3×3 conv) recomputed from the image; reflect padding is
    applied only at the map's true top/bottom. GroupNorm needs whole-map statistics, so before the final pass
    each GroupNorm gets one pass over all bands of the layers before it (mean/variance per band, merged with
    Chan's formula) — about 3× the encoder's FLOPs for a peak of one band instead of several T×T maps.
    Applies when the (published ≤4T-reduced) image size is a multiple of the output size.
    """

    def __init__(self, encoder: ImageEncoder, image: torch.Tensor, output_size: tuple[int, int],
                 patch_grid: torch.Size):
        self.encoder = encoder
        height, width = output_size
        self.image = image = reduced_image(image, output_size)
        self.output_size = output_size
        self.patch_grid = tuple(patch_grid)
        self.factor = image.shape[-2] // height
        self.applies = (image.shape[-2] == self.factor * height and image.shape[-1] == self.factor * width
                        and image.shape[-1] // width == self.factor)
        self.stats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- layers as a flat list: conv, then (GroupNorm→SiLU, conv) pairs -------------------------
    @staticmethod
    def _ops(stack: nn.Sequential) -> list[nn.Module]:
        ops: list[nn.Module] = [stack[0]]
        for block in stack[1:]:
            ops += [block.norm1, block.conv1, block.norm2, block.conv2]
        return ops

    def _rows(self, ops: list[nn.Module], top: int, bottom: int) -> torch.Tensor:
        """Output rows ``[top, bottom)`` (image resolution) of the layer stack ``ops``."""
        total = self.image.shape[-2]
        halo = sum(op.kernel_size[0] // 2 for op in ops if isinstance(op, nn.Conv2d))
        lo, hi = max(0, top - halo), min(total, bottom + halo)
        x = self.image[:, :, lo:hi]
        for op in ops:
            if isinstance(op, nn.GroupNorm):
                x = F.silu(self._group_norm(x, op), inplace=True)
                continue
            pad = op.kernel_size[0] // 2
            above, below = (pad if lo == 0 else 0), (pad if hi == total else 0)
            if pad:
                x = F.pad(x, (pad, pad, above, below), mode="reflect")
            x = F.conv2d(x, op.weight, op.bias)
            lo, hi = lo + pad - above, hi - pad + below
        return x[:, :, top - lo:bottom - lo]

    def _group_norm(self, x: torch.Tensor, norm: nn.GroupNorm) -> torch.Tensor:
        mean, rstd = self.stats[id(norm)]  # [G] each
        shape = x.shape
        x = (x.reshape(1, norm.num_groups, -1) - mean[None, :, None]) * rstd[None, :, None]
        return x.reshape(shape) * norm.weight[None, :, None, None] + norm.bias[None, :, None, None]

    def _gather_stats(self, ops: list[nn.Module], norm: nn.GroupNorm, band: int) -> None:
        """Whole-map mean and 1/std per group of the input of ``norm`` (= output of ``ops``), band by band."""
        count, mean, m2 = 0, None, None
        for top in range(0, self.image.shape[-2], band):
            x = self._rows(ops, top, min(top + band, self.image.shape[-2]))
            grouped = x.reshape(norm.num_groups, -1)
            var_b, mean_b = torch.var_mean(grouped, dim=1, unbiased=False)
            n_b = grouped.shape[1]
            # merged in float64 on the CPU (mps has no float64: copy to the host first, then widen)
            mean_b, m2_b = mean_b.cpu().double(), var_b.cpu().double() * n_b
            if mean is None:
                count, mean, m2 = n_b, mean_b, m2_b
                continue
            delta = mean_b - mean
            total = count + n_b
            mean = mean + delta * n_b / total
            m2 = m2 + m2_b + delta ** 2 * count * n_b / total
            count = total
        rstd = (m2 / count + norm.eps).rsqrt()
        device, dtype = norm.weight.device, norm.weight.dtype
        self.stats[id(norm)] = (mean.to(device, dtype), rstd.to(device, dtype))

    def _band_rows(self, channels: int) -> int:
        """Output rows per band: a whole number of patch rows within the activation budget."""
        rows_per_patch = self.output_size[0] // self.patch_grid[0]
        bytes_per_row = 3 * channels * self.factor * self.image.shape[-1] * self.image.element_size()
        return rows_per_patch * max(1, _BAND_BYTES // (bytes_per_row * rows_per_patch))

    def queries_and_keys(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated queries ``[P, dim]`` at (rows, cols) of the T×T guidance map and keys ``[1, dim, h, w]``."""
        enc = self.encoder
        branches = [self._ops(enc.encoder), self._ops(enc.sem_encoder)]
        band = self._band_rows(enc.encoder[0].out_channels)
        for ops in branches:  # 1. GroupNorm statistics, layer after layer
            for index, op in enumerate(ops):
                if isinstance(op, nn.GroupNorm):
                    self._gather_stats(ops[:index], op, band * self.factor)
        height, width = self.output_size
        rows_per_patch = height // self.patch_grid[0]
        dim = 2 * enc.encoder[0].out_channels
        queries = self.image.new_empty(rows.shape[0], dim)
        keys = []
        for top in range(0, height, band):  # 2. bands of the guidance map: pick queries, pool keys
            bottom = min(top + band, height)
            x = torch.cat([self._rows(ops, top * self.factor, bottom * self.factor) for ops in branches], dim=1)
            if self.factor > 1:
                x = F.adaptive_avg_pool2d(x, (bottom - top, width))  # [1, dim, band, T]
            inside = ((rows >= top) & (rows < bottom)).nonzero().squeeze(1)
            queries[inside] = x[0][:, rows[inside] - top, cols[inside]].T
            band_rows = torch.arange(top, bottom, device=x.device).repeat_interleave(width)
            band_cols = torch.arange(width, device=x.device).repeat(bottom - top)
            rotated = enc.rope.rotate(x[0].reshape(dim, -1).T, band_rows, band_cols, height, width)
            rotated = rotated.T.reshape(1, dim, bottom - top, width)
            keys.append(F.adaptive_avg_pool2d(rotated, ((bottom - top) // rows_per_patch, self.patch_grid[1])))
        return enc.rope.rotate(queries, rows, cols, height, width), torch.cat(keys, dim=2)


TINY_NAF_ARGS = {"dim": 16, "heads_attn": 4, "heads_rope": 4}
"""A NAF small enough for CPU tests and the offline demo (values need a width divisible by 4)."""


def write_tiny_naf(stem: str | Path, *, seed: int = 0) -> Path:
    """Write a deterministic tiny NAF as ``<stem>.json`` + ``<stem>.safetensors`` (loadable by ``load_model``)."""
    from .loading import save_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = NAF(**TINY_NAF_ARGS)
    save_model(model, {"name": "NAF", "args": dict(TINY_NAF_ARGS)}, stem)
    return Path(stem)


def naf_state_names(model: NAF) -> dict[str, tuple[int, ...]]:
    """Parameter/buffer names and shapes of ``model`` — the published ``naf_release.pth`` key set at defaults."""
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def load_naf(path: str | Path, *, device: torch.device | str = "cpu", **config) -> NAF:
    """Load a ``naf_release.pth``-style state dict (``.pth`` or ``.safetensors``) strictly into ``NAF(**config)``."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"NAF weights {path} do not exist; download "
                              f"https://github.com/valeoai/NAF/releases/download/model/naf_release.pth")
    try:
        if path.suffix == ".safetensors":
            state = load_file(str(path), device=str(torch.device(device)))
        else:
            state = torch.load(path, map_location=device, weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError, SafetensorError) as err:
        raise CheckpointError(f"NAF weights {path} are not readable ({err}); delete the file and download it again") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    with torch.device("meta"):
        model = NAF(**config)
    expected = naf_state_names(model)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = [f"{k}: file {list(state[k].shape)} vs model {list(expected[k])}"
                  for k in sorted(set(expected) & set(state)) if tuple(state[k].shape) != expected[k]]
    if missing or unexpected or mismatched:
        raise CheckpointError(f"{path} does not match NAF({config}): missing {missing[:8]}, unexpected "
                              f"{unexpected[:8]}, shape mismatch {mismatched[:8]}")
    state = {k: v.to(device=device, dtype=torch.float32) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)
