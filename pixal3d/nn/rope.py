"""3-D rotary position embedding (RoPE) of the flow transformers.

Phases follow TRELLIS.2's ``RotaryPositionEmbedder``: ``F = head_dim // 2 // 3`` frequencies per axis,
``freq_j = base / theta ** (j / F)``; the phase row of a voxel is ``polar(1, x·freq)``, then y, then z
(``3F`` complex numbers), padded with zero phases (rotation by 1) up to ``head_dim // 2``. A phase
rotates one *interleaved* channel pair ``(q[2p], q[2p+1])``; the rotation is a complex product in fp32.
"""
from __future__ import annotations

import torch

DEFAULT_ROPE_FREQ = (1.0, 10000.0)


def rope_frequencies(head_dim: int, *, axes: int = 3, rope_freq: tuple[float, float] = DEFAULT_ROPE_FREQ,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """The ``head_dim // 2 // axes`` per-axis angular frequencies (fp32), lowest index = fastest."""
    count = head_dim // 2 // axes
    exponents = torch.arange(count, dtype=torch.float32, device=device) / count
    return rope_freq[0] / (rope_freq[1] ** exponents)


def rope_phases(positions: torch.Tensor, head_dim: int, *,
                rope_freq: tuple[float, float] = DEFAULT_ROPE_FREQ) -> torch.Tensor:
    """Unit complex phases ``[N, head_dim // 2]`` (complex64) for integer positions ``[N, axes]``."""
    if positions.dim() != 2:
        raise ValueError(f"positions must be [N, axes]; got shape {tuple(positions.shape)}")
    n, axes = positions.shape
    if head_dim % 2 or head_dim // 2 < axes:
        raise ValueError(f"head_dim {head_dim} must be even and hold at least one pair per axis ({axes} axes)")
    freqs = rope_frequencies(head_dim, axes=axes, rope_freq=rope_freq, device=positions.device)
    angles = torch.outer(positions.reshape(-1).float(), freqs).reshape(n, -1)  # [N, axes·F]: x's F, y's F, z's F
    phases = torch.polar(torch.ones_like(angles), angles)
    pad = head_dim // 2 - phases.shape[1]
    if pad:
        zeros = torch.zeros(n, pad, dtype=torch.float32, device=positions.device)
        phases = torch.cat([phases, torch.polar(torch.ones_like(zeros), zeros)], dim=1)
    return phases


def grid_positions(resolution: int, *, axes: int = 3, device: torch.device | str | None = None) -> torch.Tensor:
    """Integer positions ``[resolution**axes, axes]`` of a dense grid, first axis slowest ('ij' order)."""
    ranges = [torch.arange(resolution, device=device) for _ in range(axes)]
    return torch.stack(torch.meshgrid(*ranges, indexing="ij"), dim=-1).reshape(-1, axes)


def apply_rope(x: torch.Tensor, phases: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., L, H, D]`` by ``phases [L, D/2]`` on interleaved pairs, in fp32; returns x's dtype."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # [..., L, H, D/2]
    rotated = pairs * phases.unsqueeze(-2)
    return torch.view_as_real(rotated).reshape(x.shape).to(x.dtype)
