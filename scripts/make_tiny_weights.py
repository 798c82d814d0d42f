"""Write the tiny demo weights (deterministic: the same bytes on every run) for configs/tiny.yaml.

The demo generates them on first use into the pixal3d cache; this script does it ahead of time, or
into another folder, and prints the sha256 of every file (to compare two machines or two runs).

    python scripts/make_tiny_weights.py [--out DIR] [--force]
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from pixal3d.tiny_weights import TINY_VERSION, ensure_tiny_weights
from pixal3d.hub import cache_root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=cache_root() / "tiny",
                        help=f"parent folder (default: the pixal3d cache); files go to <out>/{TINY_VERSION}")
    parser.add_argument("--force", action="store_true", help="regenerate even if the folder is complete")
    args = parser.parse_args(argv)
    if args.force and (args.out / TINY_VERSION).exists():
        shutil.rmtree(args.out / TINY_VERSION)
    folder = ensure_tiny_weights(args.out)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        print(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.relative_to(folder)}")
    print(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
