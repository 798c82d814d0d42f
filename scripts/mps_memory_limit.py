"""Print the MPS allocator limit of this Mac and the environment that keeps a run out of swap.

    python scripts/mps_memory_limit.py                                  # on the Mac itself
    python scripts/mps_memory_limit.py --recommended-gib 37.44 --ram-gib 48   # for another machine

Reads PYTORCH_MPS_HIGH/LOW_WATERMARK_RATIO, Metal's recommended working set
(torch.mps.recommended_max_memory()) and RAM, then prints the limit they give and the export line that
caps Metal allocations at RAM less the headroom (pixal3d/staging/mps_memory.py says why).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pixal3d.staging.mps_memory import (
    DEFAULT_HEADROOM,
    GIB,
    HIGH_VAR,
    LOW_VAR,
    MpsMemoryLimitError,
    check_mps_memory_limit,
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recommended-gib", type=float, help="Metal's recommended working set (default: ask torch.mps)")
    parser.add_argument("--ram-gib", type=float, help="physical memory (default: this machine's)")
    parser.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM, help="fraction of RAM kept free")
    args = parser.parse_args(argv)
    if args.recommended_gib is None:
        import torch

        if not torch.backends.mps.is_available():
            parser.error("this machine has no MPS device: pass --recommended-gib (torch.mps.recommended_max_memory() "
                         "on the Mac, in GiB) and --ram-gib")
    try:
        limit = check_mps_memory_limit(
            recommended_bytes=None if args.recommended_gib is None else int(args.recommended_gib * GIB),
            physical_bytes=None if args.ram_gib is None else int(args.ram_gib * GIB), headroom=args.headroom)
    except MpsMemoryLimitError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    high, low = limit.safe_ratios()
    print(limit.describe())
    print("a run that outgrows memory would " + ("swap" if limit.lets_swap else "fail with 'MPS backend out of memory'"))
    print(f"export {HIGH_VAR}={high:g} {LOW_VAR}={low:g}"
          + ("" if os.environ.get(HIGH_VAR) is None else "   # instead of the current setting"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
