"""Submanifold sparse 3-D convolution in plain PyTorch (any device, fp32/fp16/bf16).

Convention (pinned by ``tests/pixal3d/nn/test_sparse_conv.py`` against ``F.conv3d``): the weight is stored as the
checkpoints store it, ``[Cout, K0, K1, K2, Cin]``, and ``weight[:, i, j, k, :]`` multiplies the features of
the voxel at ``(x + d·(i - K0//2), y + d·(j - K1//2), z + d·(k - K2//2))`` — kernel dims 0/1/2 walk the
coordinate columns 1/2/3 (x/y/z), as FlexGEMM's neighbour map does. On a fully occupied grid this equals
``F.conv3d(dense, weight.permute(0, 4, 1, 2, 3), padding=d·(K//2), dilation=d)`` where ``dense`` is
``[B, Cin, X, Y, Z]`` (spatial dims in coordinate order). "Submanifold": outputs live exactly on the input
voxels, absent neighbours count as zero.

How: a neighbour map ``[N, V]`` (row of each of the V = K0·K1·K2 neighbours, -1 if absent) is built once per
coordinate set from linearised coordinates (sort + searchsorted) and cached on the ``SparseTensor``; the
convolution then gathers rows chunk by chunk (im2col, ``[rows, V·Cin]``) and does one GEMM per chunk, so the
extra memory is bounded by ``chunk_bytes`` instead of ``V × N × Cin``.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .sparse_tensor import SparseTensor

DEFAULT_CHUNK_BYTES = 64 * 2**20  # im2col scratch per GEMM: 64 MiB keeps GEMMs large and memory flat
# Fewest rows of one GEMM: a chunk tail shorter than this joins the chunk before it. BLAS kernels for
# a few rows may sum in another order than for many (MKL fp32: 1-3, 5-7, 9-11 rows do), so with short
# tails a voxel's result would depend on where the chunk boundaries fall; with none it depends only on
# the voxel's neighbourhood, which is what lets a tiled decode equal the untiled one bit for bit.
MIN_GEMM_ROWS = 16


def chunk_starts(n: int, rows: int) -> list[int]:
    """Row offsets of the chunks of ``rows`` rows over ``n`` rows; a tail under ``MIN_GEMM_ROWS`` rows is
    merged into the chunk before it (the last chunk is then up to ``rows + MIN_GEMM_ROWS - 1`` rows)."""
    starts = list(range(0, n, max(1, rows)))
    if len(starts) > 1 and n - starts[-1] < MIN_GEMM_ROWS:
        starts.pop()
    return starts


def _kernel_offsets(kernel_size: tuple[int, int, int], dilation: int, device: torch.device) -> torch.Tensor:
    """``[V, 3]`` int64 neighbour offsets, in the order of the flattened ``weight[:, i, j, k, :]``."""
    axes = [(torch.arange(k, device=device) - k // 2) * dilation for k in kernel_size]
    grid = torch.meshgrid(*axes, indexing="ij")  # i slowest, k fastest: same as weight.reshape(Cout, V, Cin)
    return torch.stack([g.reshape(-1) for g in grid], dim=1)


def build_neighbor_map(coords: torch.Tensor, kernel_size: tuple[int, int, int], dilation: int = 1) -> torch.Tensor:
    """``[N, V]`` int32 row index of each kernel neighbour of each voxel (-1 where absent).

    ``coords [N, 4]`` int32 ``(batch, x, y, z)``, rows unique. Neighbours never cross batch indices.
    """
    device = coords.device
    c = coords.long()
    n = c.shape[0]
    offsets = _kernel_offsets(kernel_size, dilation, device)
    if n == 0:
        return torch.empty(0, offsets.shape[0], dtype=torch.int32, device=device)
    pad = offsets.abs().amax(dim=0)  # [3] halo so that a shifted voxel never wraps into another row/sample
    lo = c[:, 1:].amin(dim=0)
    extent = c[:, 1:].amax(dim=0) - lo + 1 + 2 * pad  # [3] padded grid size per axis
    strides = torch.stack([extent[1] * extent[2], extent[2], torch.ones_like(extent[2])])  # x, y, z
    keys = c[:, 0] * (extent.prod()) + ((c[:, 1:] - lo + pad) * strides).sum(dim=1)  # [N] int64
    sorted_keys, order = torch.sort(keys)
    rows = torch.arange(n, device=device)
    out = torch.full((n, offsets.shape[0]), -1, dtype=torch.int32, device=device)
    deltas = (offsets * strides).sum(dim=1).tolist()
    centre = len(deltas) // 2  # offsets are symmetric: offset V-1-v = -offset v, the centre is (0, 0, 0)
    out[:, centre] = rows.to(torch.int32)
    for v in range(centre):  # search half the offsets; j = nbr[i, v]  <=>  i = nbr[j, V-1-v]
        query = keys + deltas[v]
        pos = torch.searchsorted(sorted_keys, query).clamp_(max=n - 1)
        found = sorted_keys[pos] == query
        src, dst = rows[found], order[pos[found]]
        out[src, v] = dst.to(torch.int32)
        out[dst, len(deltas) - 1 - v] = src.to(torch.int32)
    return out


def neighbor_map(x: SparseTensor, kernel_size: tuple[int, int, int], dilation: int = 1) -> torch.Tensor:
    """The cached ``[N, V]`` neighbour map of ``x``'s coordinate set (built on first use)."""
    key = f"submconv_neighbors_{kernel_size[0]}x{kernel_size[1]}x{kernel_size[2]}_d{dilation}"
    return x.cached(key, lambda: build_neighbor_map(x.coords, kernel_size, dilation))


def _gather_neighbours(feats: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """im2col rows ``[r, V·Cin]`` for the neighbour indices ``idx [r, V]`` (zeros where ``idx < 0``)."""
    cols = feats.index_select(0, idx.clamp(min=0).reshape(-1))  # [r·V, Cin]
    cols = cols.reshape(idx.shape[0], idx.shape[1], feats.shape[1])  # [r, V, Cin]
    return cols.masked_fill_((idx < 0).unsqueeze(-1), 0).reshape(idx.shape[0], -1)


def sparse_conv3d(x: SparseTensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  dilation: int = 1, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> SparseTensor:
    """Submanifold convolution of ``x [N, Cin]`` with ``weight [Cout, K0, K1, K2, Cin]`` -> ``[N, Cout]``.

    Computed in ``weight.dtype`` (features are cast to it), chunked so that the gathered neighbour
    features never exceed ``chunk_bytes`` (under autograd each chunk is kept for the backward pass).
    """
    cout, *kernel, cin = weight.shape
    if x.feats.shape[1] != cin:
        raise ValueError(f"sparse_conv3d: input has {x.feats.shape[1]} channels but the weight expects {cin}")
    if any(k % 2 == 0 for k in kernel):
        raise ValueError(f"sparse_conv3d: kernel size {tuple(kernel)} must be odd in every dimension "
                         f"(submanifold convolution centres the kernel on each voxel)")
    nbr = neighbor_map(x, tuple(kernel), dilation)  # [N, V]
    n, num_offsets = nbr.shape
    feats = x.feats.to(weight.dtype)
    w = weight.reshape(cout, num_offsets * cin).t()  # [V·Cin, Cout], row v·Cin + c
    rows = max(1, chunk_bytes // max(1, num_offsets * cin * feats.element_size()))
    bias = None if bias is None else bias.to(weight.dtype)
    track_grad = torch.is_grad_enabled() and (feats.requires_grad or weight.requires_grad
                                              or (bias is not None and bias.requires_grad))
    # Inference writes each chunk straight into the output; autograd needs out-of-place chunks.
    out = None if track_grad else torch.empty(n, cout, dtype=weight.dtype, device=feats.device)
    parts = []
    starts = chunk_starts(n, rows)
    for start, stop in zip(starts, [*starts[1:], n]):  # each gathered chunk is freed before the next
        target = None if out is None else out[start:stop]
        cols = _gather_neighbours(feats, nbr[start:stop])
        part = torch.mm(cols, w, out=target) if bias is None else torch.addmm(bias, cols, w, out=target)
        del cols
        if out is None:
            parts.append(part)
    if out is None:
        out = torch.cat(parts) if parts else feats.new_empty(0, cout)
    return x.replace(out)


class SparseConv3d(nn.Module):
    """Submanifold sparse 3-D convolution; parameters ``weight [Cout, K, K, K, Cin]`` and ``bias [Cout]``."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, *, dilation: int = 1,
                 bias: bool = True, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        super().__init__()
        if kernel_size % 2 == 0:
            raise ValueError(f"SparseConv3d: kernel_size={kernel_size} must be odd")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.dilation, self.chunk_bytes = kernel_size, dilation, chunk_bytes
        self.weight = nn.Parameter(torch.empty(out_channels, kernel_size, kernel_size, kernel_size, in_channels))
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Conv3d``'s default initialisation (fan-in = Cin·K³); a no-op on ``meta``."""
        fan_in = self.in_channels * self.kernel_size ** 3
        bound = 1.0 / math.sqrt(fan_in)
        nn.init.uniform_(self.weight, -bound, bound)  # = kaiming_uniform_(a=sqrt(5))
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: SparseTensor) -> SparseTensor:
        return sparse_conv3d(x, self.weight, self.bias, dilation=self.dilation, chunk_bytes=self.chunk_bytes)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}"
                f"{f', dilation={self.dilation}' if self.dilation != 1 else ''}, bias={self.bias is not None}")
