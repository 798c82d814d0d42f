"""Write assets/example.png: a synthetic RGBA object (a shaded ball on a box) on a transparent background.

Deterministic (pure NumPy, no randomness), so the offline demo needs no background-removal model:
the alpha channel marks the object.

    python scripts/make_example_image.py [-o assets/example.png] [--size 256]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image


def example_image(size: int = 256) -> Image.Image:
    """An RGBA image of a lit orange ball resting on a blue box, background fully transparent."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float64) / size  # [0, 1), y down
    rgba = np.zeros((size, size, 4), dtype=np.float64)
    light = np.array([-0.5, -0.6, 0.62])
    light /= np.linalg.norm(light)
    # box: a front face and a lighter top face
    front = (np.abs(x - 0.5) < 0.3) & (y > 0.62) & (y < 0.9)
    top = (np.abs(x - 0.5 + (y - 0.62) * 0.5) < 0.3) & (y > 0.52) & (y <= 0.62)
    rgba[front] = [0.20, 0.35, 0.75, 1.0]
    rgba[top] = [0.35, 0.55, 0.90, 1.0]
    # ball: Lambert shading plus a specular highlight
    cx, cy, r = 0.5, 0.36, 0.24
    dx, dy = (x - cx) / r, (y - cy) / r
    inside = dx ** 2 + dy ** 2 < 1.0
    dz = np.sqrt(np.clip(1.0 - dx ** 2 - dy ** 2, 0.0, 1.0))
    shade = np.clip(dx * light[0] + dy * light[1] + dz * light[2], 0.0, 1.0)
    spec = shade ** 40
    color = np.stack([0.95 * (0.25 + 0.75 * shade) + spec, 0.55 * (0.25 + 0.75 * shade) + spec,
                      0.15 * (0.25 + 0.75 * shade) + spec], axis=-1)
    rgba[inside, :3] = np.clip(color[inside], 0.0, 1.0)
    rgba[inside, 3] = 1.0
    return Image.fromarray(np.round(rgba * 255).astype(np.uint8), mode="RGBA")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=Path(__file__).resolve().parents[1] / "assets" / "example.png")
    parser.add_argument("--size", type=int, default=256)
    args = parser.parse_args(argv)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    example_image(args.size).save(args.output, optimize=False)
    print(args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
