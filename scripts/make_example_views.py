"""Write ``assets/views_example``: a toy object seen by upstream's example rig (4 views at azimuths 0/90/180/270,
20° field of view, camera distance 3.1192), as RGBA PNGs and a ``transforms.json``.

    python scripts/make_example_views.py [--out assets/views_example] [--size 128]

The object (a box with a coloured face each side, a ball on top, a small block on one side, so that every view
differs) is ray-cast analytically with numpy, 3×3 samples a pixel (the alpha is the covered fraction); the
background is transparent. Deterministic: the same bytes on every run.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
from PIL import Image

from pixal3d.models.views import orbit_pose, transforms_json

FOV = 0.3490658503988659  # upstream's example rig: 20 degrees
DISTANCE = 3.1192049980163574
AZIMUTHS = (0, 90, 180, 270)
LIGHT = np.array([0.4, -0.6, 0.7]) / np.linalg.norm([0.4, -0.6, 0.7])

# axis-aligned boxes (lo, hi, one colour per face: -x, +x, -y, +y, -z, +z) in the world (Z up, front = -Y)
BOXES = (
    ((-0.3, -0.2, -0.45), (0.3, 0.2, 0.1),
     ((200, 60, 50), (60, 160, 70), (230, 200, 60), (60, 90, 200), (90, 90, 90), (220, 220, 220))),
    ((0.3, -0.1, -0.3), (0.42, 0.1, -0.05),
     ((240, 140, 30),) * 6),
)
BALL = ((0.05, 0.0, 0.25), 0.16, (170, 70, 190))


def render(pose: tuple[tuple[float, ...], ...], size: int, samples: int = 3) -> Image.Image:
    """The scene seen by camera-to-world ``pose`` at ``FOV``: RGBA, alpha the covered fraction of each pixel."""
    m = np.array(pose, dtype=np.float64)
    focal = size / (2 * math.tan(FOV / 2))
    jj, ii = np.meshgrid(np.arange(size * samples), np.arange(size * samples))  # sub-sample columns, rows
    x = ((jj + 0.5) / samples - size / 2) / focal
    y = -((ii + 0.5) / samples - size / 2) / focal
    dirs = np.stack([x, y, -np.ones_like(x)], -1) @ m[:3, :3].T
    dirs /= np.linalg.norm(dirs, axis=-1, keepdims=True)
    origin = m[:3, 3]
    depth = np.full(dirs.shape[:2], np.inf)
    colour = np.zeros(dirs.shape)
    for lo, hi, faces in BOXES:
        t, normal, face = _box(origin, dirs, np.array(lo), np.array(hi))
        hit = t < depth
        depth[hit] = t[hit]
        shade = 0.45 + 0.55 * np.clip(normal @ LIGHT, 0, 1)
        colour[hit] = (np.array(faces, dtype=np.float64)[face] * shade[..., None])[hit]
    centre, radius, rgb = BALL
    t = _sphere(origin, dirs, np.array(centre), radius)
    hit = t < depth
    depth[hit] = t[hit]
    normal = (origin + dirs * np.where(hit, t, 0.0)[..., None] - np.array(centre)) / radius
    shade = 0.45 + 0.55 * np.clip(normal @ LIGHT, 0, 1)
    colour[hit] = (np.array(rgb, dtype=np.float64) * shade[..., None])[hit]
    covered = np.isfinite(depth)
    alpha = covered.reshape(size, samples, size, samples).mean(axis=(1, 3))
    rgb_sum = (colour * covered[..., None]).reshape(size, samples, size, samples, 3).sum(axis=(1, 3))
    counts = covered.reshape(size, samples, size, samples).sum(axis=(1, 3))
    rgb = np.where(counts[..., None] > 0, rgb_sum / np.maximum(counts, 1)[..., None], 0)
    pixels = np.concatenate([rgb, alpha[..., None] * 255], -1)
    return Image.fromarray(np.clip(np.round(pixels), 0, 255).astype(np.uint8), mode="RGBA")


def _box(origin: np.ndarray, dirs: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """Ray-box hits: distance (inf when missed), outward normal and face index (-x, +x, -y, +y, -z, +z)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        t1, t2 = (lo - origin) / dirs, (hi - origin) / dirs
    near, far = np.minimum(t1, t2), np.maximum(t1, t2)
    t_near, axis = near.max(-1), near.argmax(-1)
    hit = (t_near <= far.min(-1)) & (t_near > 0)
    sign = np.where(np.take_along_axis(dirs, axis[..., None], -1)[..., 0] > 0, -1.0, 1.0)
    normal = np.zeros(dirs.shape)
    np.put_along_axis(normal, axis[..., None], sign[..., None], -1)
    face = axis * 2 + (sign > 0)
    return np.where(hit, t_near, np.inf), normal, face


def _sphere(origin: np.ndarray, dirs: np.ndarray, centre: np.ndarray, radius: float) -> np.ndarray:
    oc = origin - centre
    b = dirs @ oc
    disc = b * b - (oc @ oc - radius * radius)
    t = -b - np.sqrt(np.maximum(disc, 0))
    return np.where((disc >= 0) & (t > 0), t, np.inf)


def dumps(document: dict) -> str:
    """``transforms.json`` text with one matrix row a line (as upstream's example writes it)."""
    text = json.dumps(document, indent=2)
    for frame in document["frames"]:
        rows = frame["transform_matrix"]
        text = text.replace(json.dumps(rows, indent=2).replace("\n", "\n      "),
                            "[\n" + ",\n".join(f"        {json.dumps(r)}" for r in rows) + "\n      ]", 1)
    return text + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "assets" / "views_example")
    parser.add_argument("--size", type=int, default=128)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    files, poses = [], []
    for index, azimuth in enumerate(AZIMUTHS):
        pose = orbit_pose(azimuth, DISTANCE)
        name = f"view{index:02d}_azim{azimuth:03d}.png"
        render(pose, args.size).save(args.out / name, optimize=True)
        files.append(name)
        poses.append(pose)
    document = transforms_json(files, poses, FOV, names=[f"azim{a:03d}" for a in AZIMUTHS])
    (args.out / "transforms.json").write_text(dumps(document))
    print(f"wrote {len(files)} views and transforms.json to {args.out}")


if __name__ == "__main__":
    main()
