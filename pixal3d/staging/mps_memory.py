"""The MPS allocator's limit, checked before a run on Apple Silicon: outgrowing memory must fail, not swap.

What PyTorch does (docs: "MPS Environment Variables", ``torch.mps``; ATen ``mps/MPSAllocator.mm``):

* The allocator refuses an allocation ("MPS backend out of memory") once the process's Metal
  allocations — ``torch.mps.driver_allocated_memory()``: tensors, the allocator's cached blocks and
  MPSGraph's own buffers — would pass ``HIGH × recommended``. ``recommended`` is Metal's
  ``recommendedMaxWorkingSetSize`` (``torch.mps.recommended_max_memory()``, about 3/4 of RAM on
  Apple Silicon); ``HIGH`` is ``PYTORCH_MPS_HIGH_WATERMARK_RATIO``: default 1.7, allowed 0 to 2,
  and 0 means no limit at all.
* ``PYTORCH_MPS_LOW_WATERMARK_RATIO`` (default 1.4 on unified memory) is a soft limit: above it the
  allocator frees cached blocks and commits command buffers early. It must not exceed ``HIGH``, or
  the allocator refuses to start ("invalid low watermark ratio").
* Both are read once, when the allocator starts (the first use of ``mps`` in the process, asking for
  ``recommended_max_memory()`` included). ``torch.mps.set_per_process_memory_fraction(f)`` changes
  ``HIGH`` later (0 to 2, 0 = no limit).

So the defaults allow 1.7 × ~0.75 ≈ 1.3 × RAM: on every Apple Silicon Mac a run that outgrows
memory slides into swap instead of raising. ``check_mps_memory_limit`` computes the limit from the
environment and refuses one the user set that lets a run swap (0, or above physical memory less
``headroom``); with the variable unset it returns the safe fraction for the caller to apply with
``apply_mps_memory_limit``. The limit bounds Metal allocations only: CPU-side memory of the same
process (the export's arrays, Python objects) is not counted, which is what the headroom is for.

Not checked without a Mac: the numbers above are PyTorch's documented and coded behaviour, read, not
measured here; the tests inject ``recommended`` and physical memory.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

HIGH_VAR = "PYTORCH_MPS_HIGH_WATERMARK_RATIO"
LOW_VAR = "PYTORCH_MPS_LOW_WATERMARK_RATIO"
DEFAULT_HIGH = 1.7            # MPSAllocator.h default_high_watermark_ratio
DEFAULT_LOW_UNIFIED = 1.4     # default_low_watermark_ratio_unified
MAX_RATIO = 2.0               # default_high_watermark_upper_bound
DEFAULT_HEADROOM = 0.15       # of physical memory left to macOS, other apps and this process's CPU side
GIB = 2 ** 30


class MpsMemoryLimitError(RuntimeError):
    """The MPS allocator's settings would let a run swap, or are not valid."""


@dataclass(frozen=True)
class MpsMemoryLimit:
    """The allocator's hard limit on this Mac, where it comes from, and what would be safe."""

    high: float                  # effective PYTORCH_MPS_HIGH_WATERMARK_RATIO (0 = no limit)
    low: float                   # effective PYTORCH_MPS_LOW_WATERMARK_RATIO
    from_environment: bool       # HIGH was set by the user (else PyTorch's default)
    recommended_bytes: int       # Metal's recommendedMaxWorkingSetSize
    physical_bytes: int          # RAM
    headroom: float              # fraction of RAM kept free

    @property
    def limit_bytes(self) -> int | None:
        """Bytes of Metal allocations allowed, None when unlimited."""
        return None if self.high == 0 else int(self.high * self.recommended_bytes)

    @property
    def budget_bytes(self) -> int:
        """Physical memory less the headroom: what Metal allocations may use without swapping."""
        return int(self.physical_bytes * (1 - self.headroom))

    @property
    def lets_swap(self) -> bool:
        limit = self.limit_bytes
        return limit is None or limit > self.budget_bytes

    def safe_ratios(self) -> tuple[float, float]:
        """``(HIGH, LOW)`` that cap Metal allocations at the budget, LOW in PyTorch's default proportion."""
        high = min(MAX_RATIO, math.floor(100 * self.budget_bytes / self.recommended_bytes) / 100)
        low = math.floor(100 * high * DEFAULT_LOW_UNIFIED / DEFAULT_HIGH) / 100
        return high, low

    def describe(self) -> str:
        limit = "no limit" if self.limit_bytes is None else f"{self.limit_bytes / GIB:.1f} GiB"
        source = f"{HIGH_VAR}={self.high:g}" if self.from_environment else f"PyTorch's default {HIGH_VAR}={self.high:g}"
        return (f"{source}: Metal allocations limited to {limit} (Metal recommends "
                f"{self.recommended_bytes / GIB:.1f} GiB; RAM {self.physical_bytes / GIB:.1f} GiB, budget "
                f"{self.budget_bytes / GIB:.1f} GiB with {self.headroom:.0%} headroom)")


def watermark_ratios(env: Mapping[str, str]) -> tuple[float, float, bool]:
    """``(HIGH, LOW, HIGH came from env)`` as the allocator will read them, validated as it does."""
    high = _ratio(env, HIGH_VAR, DEFAULT_HIGH)
    low = _ratio(env, LOW_VAR, DEFAULT_LOW_UNIFIED)
    ceiling = high if high > 0 else MAX_RATIO
    if low > ceiling:
        raise MpsMemoryLimitError(
            f"{LOW_VAR}={low:g} is above {HIGH_VAR}={high:g}{'' if HIGH_VAR in env else ' (the default)'}: the MPS "
            f"allocator refuses to start with a low watermark above the high one. Set both, low <= high, e.g. "
            f"{HIGH_VAR}={high:g} {LOW_VAR}={math.floor(100 * high * DEFAULT_LOW_UNIFIED / DEFAULT_HIGH) / 100:g}")
    return high, low, HIGH_VAR in env


def _ratio(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise MpsMemoryLimitError(f"{name}={text!r} is not a number; use a ratio between 0 and {MAX_RATIO:g} "
                                  f"(see docs/apple-silicon.md)") from None
    if not 0 <= value <= MAX_RATIO:
        raise MpsMemoryLimitError(f"{name}={text} is outside 0..{MAX_RATIO:g}, which the MPS allocator refuses; "
                                  f"use a ratio between 0 and {MAX_RATIO:g}")
    return value


def check_mps_memory_limit(*, env: Mapping[str, str] | None = None, recommended_bytes: int | None = None,
                           physical_bytes: int | None = None, headroom: float = DEFAULT_HEADROOM) -> MpsMemoryLimit:
    """The allocator's limit for a run on ``mps``; raise ``MpsMemoryLimitError`` if the user set one that swaps.

    ``env`` defaults to ``os.environ``; ``recommended_bytes`` to ``torch.mps.recommended_max_memory()``
    (which starts the allocator: the variables are validated first, so a bad value gets this
    module's message rather than the allocator's); ``physical_bytes`` to ``psutil``'s total. With
    HIGH unset the result may still ``lets_swap``: the caller applies ``safe_ratios()[0]`` with
    ``apply_mps_memory_limit``.
    """
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom {headroom} must be a fraction of physical memory in [0, 1)")
    env = os.environ if env is None else env
    high, low, from_env = watermark_ratios(env)
    if recommended_bytes is None:
        import torch

        recommended_bytes = int(torch.mps.recommended_max_memory())
    if physical_bytes is None:
        import psutil

        physical_bytes = int(psutil.virtual_memory().total)
    if recommended_bytes <= 0 or physical_bytes <= 0:
        raise ValueError(f"recommended ({recommended_bytes}) and physical ({physical_bytes}) memory must be positive")
    limit = MpsMemoryLimit(high, low, from_env, recommended_bytes, physical_bytes, headroom)
    if from_env and limit.lets_swap:
        safe_high, safe_low = limit.safe_ratios()
        why = ("0 turns the limit off" if high == 0 else
               f"{high:g} × {recommended_bytes / GIB:.1f} GiB (Metal's recommended working set) = "
               f"{limit.limit_bytes / GIB:.1f} GiB is more than this Mac can give without swapping "
               f"({physical_bytes / GIB:.1f} GiB RAM less {headroom:.0%} = {limit.budget_bytes / GIB:.1f} GiB)")
        raise MpsMemoryLimitError(
            f"{HIGH_VAR}={env[HIGH_VAR]} lets a run that outgrows memory swap instead of failing: {why}. "
            f"Set {HIGH_VAR}={safe_high:g} {LOW_VAR}={safe_low:g} before starting Python (the allocator reads "
            f"them once), or unset {HIGH_VAR} and the run applies that limit itself.")
    return limit


def apply_mps_memory_limit(limit: MpsMemoryLimit, *, api: Any = None) -> float | None:
    """Lower HIGH at run time (``torch.mps.set_per_process_memory_fraction``) when PyTorch's default
    would let the run swap; return the fraction applied, or None when nothing had to change.

    Leaves a user's own setting alone (``check_mps_memory_limit`` refuses an unsafe one). LOW keeps
    its value: above HIGH it only means the allocator frees its cache when an allocation fails
    rather than earlier; the failure is still an error, not swap."""
    if limit.from_environment or not limit.lets_swap:
        return None
    if api is None:
        import torch

        api = torch.mps
    fraction = limit.safe_ratios()[0]
    api.set_per_process_memory_fraction(fraction)
    logger.info("MPS memory limit: %s; lowered to %s=%g (%.1f GiB) so that outgrowing memory fails "
                "instead of swapping", limit.describe(), HIGH_VAR, fraction,
                fraction * limit.recommended_bytes / GIB)
    return fraction
