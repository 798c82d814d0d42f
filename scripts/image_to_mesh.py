"""Image → textured GLB with the staged Pixal3D cascade (same as the ``pixal3d-image-to-mesh`` command).

    python scripts/image_to_mesh.py input.png [-o out.glb] [--config configs/1024_cascade.yaml] ...
    python scripts/image_to_mesh.py assets/example.png --config configs/tiny.yaml -o outputs/demo.glb
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from pipelines.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
