"""How many blocks of each flow model each pipeline rank holds: even, given, or in proportion to memory.

PipeFusion's default split is near-equal (``near_equal_ranges``), so the smallest device decides what fits.
``ParallelSettings.pp_split`` changes that:

* a tuple ``(B1, ..., BN)``: rank k holds ``Bk`` blocks of a model with ``sum(B)`` blocks; a model with
  another block count gets the same proportions (``proportional``), so one split serves every flow model;
* ``"auto"``: blocks in proportion to each rank's usable memory (``capacities``: what each rank reported
  when the job was planned, rank 0's list broadcast to all). A block's weights and its K/V buffers are the
  same size on every rank, so blocks in proportion to memory leave every rank the same fraction of its
  memory free.

Every part gets at least one block. The arithmetic is pure and runs alike on every rank.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from .settings import ParallelConfigError, near_equal_ranges

Split = tuple[int, ...]


def proportional(total: int, weights: Sequence[float]) -> Split:
    """``total`` split into ``len(weights)`` positive parts in proportion to ``weights`` (largest remainder;
    ties go to the lower index). Needs ``total >= len(weights)``."""
    parts = len(weights)
    if not 1 <= parts <= total:
        raise ParallelConfigError(f"cannot split {total} blocks over {parts} pipeline ranks; use at most {total}")
    weights = [max(float(w), 0.0) for w in weights]
    if not any(weights):
        return tuple(len(r) for r in near_equal_ranges(total, parts))
    ideal = [total * w / sum(weights) for w in weights]
    counts = [max(1, math.floor(x)) for x in ideal]
    while sum(counts) < total:  # the part furthest below its ideal gains one
        counts[max(range(parts), key=lambda k: (ideal[k] - counts[k], -k))] += 1
    while sum(counts) > total:  # the part furthest above its ideal (and above one) gives one back
        counts[max((k for k in range(parts) if counts[k] > 1), key=lambda k: (counts[k] - ideal[k], -k))] -= 1
    return tuple(counts)


def model_split(pp_split: str | Sequence[int] | None, num_blocks: int, stages: int,
                capacities: Sequence[int] | None = None) -> Split:
    """The block count of each of ``stages`` pipeline ranks for a model of ``num_blocks`` blocks."""
    if not 1 <= stages <= num_blocks:
        raise ParallelConfigError(f"cannot split {num_blocks} blocks over {stages} pipeline ranks; "
                                  f"use 1 <= pp <= {num_blocks}")
    if pp_split is None:
        return tuple(len(r) for r in near_equal_ranges(num_blocks, stages))
    if pp_split == "auto":
        if capacities is None or len(capacities) != stages:
            raise ParallelConfigError("pp_split='auto' needs every pipeline rank's memory, which the job gathers "
                                      "when it is planned under torchrun")
        return proportional(num_blocks, capacities)
    given = tuple(pp_split)
    if len(given) != stages:
        raise ParallelConfigError(f"pp_split {given} names {len(given)} ranks but pp is {stages}")
    return given if sum(given) == num_blocks else proportional(num_blocks, given)


def split_ranges(counts: Sequence[int]) -> list[range]:
    """Contiguous block ranges of the given lengths, in rank order."""
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out


def describe_split(counts: Sequence[int]) -> str:
    """``1 + 3`` for the plan."""
    return " + ".join(str(n) for n in counts)
