"""Shared by the batch tests: a fast tiny config (one sampler step, a small export), three distinct images
(the example turned by 0, 90 and 180 degrees) and their one-by-one fingerprints.

Each test module that imports these fixtures gets its own copy of them from pytest, so they keep what they make
in one folder of the session's temporary directory and a later module reuses it instead of running again."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from PIL import Image

from pipelines import Pixal3D
from pixal3d.staging import EventLog
from tests.support.cascade_fixtures import EXAMPLE, TINY_CONFIG

FLOW_STAGES = ("structure", "shape_512", "shape_1024", "texture")


def write_fast_config(folder: Path) -> Path:
    """tiny.yaml with one sampler step per flow stage and a 64² texture on 500 faces."""
    path = folder / "fast.yaml"
    steps = {s: {"sampler": {"steps": 1}} for s in FLOW_STAGES}
    path.write_text(yaml.safe_dump({"base": str(TINY_CONFIG), **steps,
                                    "export": {"texture_size": 64, "decimation_target": 500}}))
    return path


def write_images(folder: Path, count: int = 3) -> list[Path]:
    """``count`` PNGs named a, b, c...: the example image turned by 0, 90, 180... degrees."""
    folder.mkdir(parents=True, exist_ok=True)
    image = Image.open(EXAMPLE)
    paths = []
    for i in range(count):
        path = folder / f"{'abcdefgh'[i]}.png"
        image.rotate(90 * i).save(path)
        paths.append(path)
    return paths


def _shared(tmp_path_factory) -> Path:
    folder = tmp_path_factory.getbasetemp() / "batch-fixtures"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def fast_config(tiny_cache, tmp_path_factory) -> Path:
    return write_fast_config(_shared(tmp_path_factory))


@pytest.fixture(scope="session")
def batch_images(tmp_path_factory) -> list[Path]:
    return write_images(_shared(tmp_path_factory) / "images")


@pytest.fixture(scope="session")
def singles(fast_config, batch_images, tmp_path_factory) -> dict:
    """One-by-one staged runs of each image (seed 42): ``{"prints": {name: fingerprints}, "loads": [...]}`` with
    the first run's loads as ``[kind, model, stage]``."""
    done = _shared(tmp_path_factory) / "singles.json"
    if done.exists():
        return json.loads(done.read_text())
    log = EventLog()
    prints = {}
    with Pixal3D.from_config(fast_config, policy="staged", device="cpu") as pipe:
        for i, path in enumerate(batch_images):
            prints[path.stem] = pipe.run(path, events=log if i == 0 else None).fingerprints()
            pipe.close()  # each run starts with nothing loaded, as a fresh process would
    loads = [[e.kind, e.model, e.stage] for e in log.events if e.kind in ("load", "reload")]
    done.write_text(json.dumps({"prints": prints, "loads": loads}))
    return json.loads(done.read_text())
