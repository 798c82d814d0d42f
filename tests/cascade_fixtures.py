"""Shared fixtures of the cascade/CLI/hub tests: the tiny weights (generated once per session into a
temporary pixal3d cache), the tiny config, and a helper that runs the tiny cascade in-process."""
from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from pipelines.build import build_cascade
from pipelines.cascade import StageRecord
from pipelines.state import RunState
from pipelines.tiny_weights import ensure_tiny_weights
from pixal3d.config import CascadeConfig, load_config
from pixal3d.hub import ResolvedWeights, resolve_weights
from pixal3d.models.dinov3 import load_dinov3

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
def tiny(tiny_cache: Path) -> tuple[CascadeConfig, ResolvedWeights]:
    """The tiny config and its resolved weights."""
    config = load_config(TINY_CONFIG)
    return config, resolve_weights(config.weights, offline=True)


def run_tiny(config: CascadeConfig, weights: ResolvedWeights, policy: str, *, tmp: Path, export: bool = False,
             until: str | None = None, **cascade_kwargs) -> tuple[list[StageRecord], RunState]:
    """Seed, then run the tiny cascade over assets/example.png (without the export stage unless asked;
    only up to stage ``until`` when given)."""
    cascade = build_cascade(config, weights, policy=policy, **cascade_kwargs)
    if not export:
        cascade.stages = [s for s in cascade.stages if s.name != "export"]
    if until is not None:
        names = [s.name for s in cascade.stages]
        cascade.stages = cascade.stages[:names.index(until) + 1]
    state = RunState(input_path=EXAMPLE, output_path=tmp / "out.glb", seed=config.seed,
                     device=torch.device("cpu"), progress=False)
    torch.manual_seed(config.seed)
    try:
        records = cascade.run(state)
    finally:
        cascade.close()
    return records, state


def stage_fingerprints(records: list[StageRecord]) -> dict[str, dict[str, str]]:
    """Stage → {output name → sha256} (stages without outputs left out)."""
    return {r.stage: r.fingerprints for r in records if r.fingerprints}
