"""Shared by the multi-view tests: a fast tiny multi-view config (one sampler step, a small export), views folders
(the example, and the example with its views' colours swapped), the 1-view folder of the degenerate case, and the
eager run of configs/tiny_mv.yaml on the example views that the multi-view golden holds (``mv_reference``)."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from pipelines import Pixal3D
from pixal3d.models.camera import camera_from_fov
from pixal3d.models.views import front_pose, transforms_json
from tests.support.cascade_fixtures import REPO

TINY_MV_CONFIG = REPO / "configs" / "tiny_mv.yaml"
EXAMPLE_VIEWS = REPO / "assets" / "views_example"
FLOW_STAGES = ("structure", "shape_512", "shape_1024", "texture")


def write_fast_mv_config(folder: Path, **extra) -> Path:
    """tiny_mv.yaml with one sampler step per flow stage and a 64² texture on 500 faces (``extra``: more keys)."""
    path = folder / "fast_mv.yaml"
    steps = {s: {"sampler": {"steps": 1}} for s in FLOW_STAGES}
    path.write_text(yaml.safe_dump({"base": str(TINY_MV_CONFIG), **steps,
                                    "export": {"texture_size": 64, "decimation_target": 500}, **extra}))
    return path


def swapped_views(folder: Path) -> Path:
    """The example folder with each view's red and blue swapped (another object, the same rig)."""
    shutil.copytree(EXAMPLE_VIEWS, folder)
    for path in folder.glob("*.png"):
        pixels = np.asarray(Image.open(path)).copy()
        pixels[..., [0, 2]] = pixels[..., [2, 0]]
        Image.fromarray(pixels, "RGBA").save(path)
    return folder


def disc_source(size: int = 320) -> Image.Image:
    """An RGBA source for the single-view cascade: a textured disc on a transparent background."""
    yy, xx = np.mgrid[:size, :size]
    inside = np.hypot(xx - size / 2, yy - size / 2) < size * 0.4
    pattern = np.stack([(xx * 7) % 256, (yy * 5) % 256, ((xx + yy) * 3) % 256], -1)
    rgb = np.where(inside[..., None], pattern, 0).astype(np.uint8)
    return Image.fromarray(np.dstack([rgb, np.where(inside, 255, 0).astype(np.uint8)]), "RGBA")


def one_view_folder(folder: Path, preprocessed: Image.Image, fov_deg: float, *, farther: float = 1.0) -> Path:
    """A 1-view folder holding the single-view run's preprocessed image (RGB on black) as its view, at the front
    pose of that run's camera (``farther`` moves it away, for controls: one view's pose is always snapped onto the
    front pose, only its distance counts).

    The view is the image with alpha 255 but for one transparent corner pixel (a view must carry transparency to
    be used without a remover). Pillow resizes RGBA premultiplied, so the view's resized, premultiplied pixels are
    the RGB image's exactly wherever the resized alpha stays 255, and near the corner, where it does not, the disc
    leaves only black."""
    folder.mkdir(parents=True)
    view = preprocessed.convert("RGBA")
    alpha = np.full(view.size[::-1], 255, np.uint8)
    alpha[0, 0] = 0
    view.putalpha(Image.fromarray(alpha))
    view.save(folder / "view.png")
    camera = camera_from_fov(math.radians(fov_deg))  # as the camera stage makes it
    pose = front_pose(camera.distance * farther)
    (folder / "transforms.json").write_text(json.dumps(transforms_json(["view.png"], [pose], camera.fov)))
    return folder


@pytest.fixture(scope="session")
def fast_mv_config(tiny_cache, tmp_path_factory) -> Path:
    return write_fast_mv_config(tmp_path_factory.mktemp("fast-mv"))


@pytest.fixture(scope="session")
def views_folders(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("views")
    example = root / "example"
    shutil.copytree(EXAMPLE_VIEWS, example)
    return [example, swapped_views(root / "swapped")]


@pytest.fixture(scope="session")
def mv_reference(tiny_cache) -> dict[str, dict[str, str]]:
    """Fingerprints of an eager run of configs/tiny_mv.yaml on assets/views_example up to the decode, the config's
    seed (what ``scripts/write_golden.py --cascade tiny_mv`` writes)."""
    with Pixal3D.from_config(TINY_MV_CONFIG, policy="eager", device="cpu", until="decode") as pipe:
        return pipe.run(views=EXAMPLE_VIEWS).fingerprints()
