"""Download every weight file a config needs (same as the ``pixal3d-fetch`` command).

    python scripts/fetch_weights.py [--config configs/1024_cascade.yaml] [--no-moge] [--no-rembg]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from pixal3d.fetch import main

if __name__ == "__main__":
    raise SystemExit(main())
