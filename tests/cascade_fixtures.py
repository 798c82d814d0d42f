"""Shared fixtures of the cascade/CLI/hub tests: the tiny weights (generated once per session into a
temporary pixal3d cache), the tiny config, and a helper that runs the tiny cascade in-process."""
from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from pipelines import Pixal3D, Result
from pixal3d.config import CascadeConfig, load_config
from pixal3d.models.dinov3 import load_dinov3
from pixal3d.tiny_weights import ensure_tiny_weights

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "configs" / "tiny.yaml"
EXAMPLE = REPO / "assets" / "example.png"
GOLDEN = Path(__file__).resolve().parent / "golden" / "tiny_cpu.json"


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pixal3d cache holding the tiny weights; ``PIXAL3D_CACHE`` points at it for the session."""
    root = tmp_path_factory.mktemp("pixal3d-cache")
    folder = ensure_tiny_weights(root / "tiny")
    old = os.environ.get("PIXAL3D_CACHE")
    os.environ["PIXAL3D_CACHE"] = str(root)
    load_dinov3(folder / "dinov3")  # imports what a first load imports, so the freeze below covers it
    gc.collect()
    gc.freeze()  # as pipelines.cli.main does: keeps the collections during a run (and each release) cheap
    yield root
    gc.unfreeze()
    if old is None:
        os.environ.pop("PIXAL3D_CACHE", None)
    else:
        os.environ["PIXAL3D_CACHE"] = old


@pytest.fixture(scope="session")
def tiny(tiny_cache: Path) -> CascadeConfig:
    """The tiny config (its weights in the session's tiny cache)."""
    return load_config(TINY_CONFIG)


def run_tiny(config: CascadeConfig, policy: str, *, export: bool = False, until: str | None = None,
             seed: int | None = None, image=EXAMPLE, events=None, **kwargs) -> Result:
    """Run the tiny cascade over ``image`` (default assets/example.png) on the CPU through ``Pixal3D``, without
    the export stage unless asked (only up to stage ``until`` when given); ``kwargs`` go to ``from_config``."""
    until = until or (None if export else "decode")
    with Pixal3D.from_config(config, policy=policy, device="cpu", until=until, **kwargs) as pipe:
        return pipe.run(image, seed=seed, events=events)
