"""Shared fixtures of the cascade/CLI/hub tests: the tiny weights (generated once per session into a
temporary pixal3d cache), the tiny config, a helper that runs the tiny cascade in-process, the session's
reference run, and the golden fingerprints of this session's kernels.

Two kinds of check use them. *Relative* checks (staged, resident, the library, the CLI, ``--parallel cfg``
all give the fingerprints of the eager ``tiny_reference`` run) need no golden and hold on every machine.
The *golden* check compares the reference with the golden of this session's kernels (``tests/support/goldens.py``:
``tests/golden/tiny_<key>.json``, ``key`` naming the architecture and the pinned kernel family, or a kind of
CPU's variant of it); it runs only with the golden verified on this kind of CPU (``kernels.cpu_kind()``), its
torch version and thread count, and skips elsewhere saying why and how to write or verify one
(``python scripts/write_golden.py``).
"""
from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch

from pipelines import Pixal3D, Result
from pixal3d import kernels
from pixal3d.config import CascadeConfig, load_config
from pixal3d.models.dinov3 import load_dinov3
from pixal3d.staging.fingerprint import first_difference  # noqa: F401  (the tests' one import of it)
from pixal3d.tiny_weights import ensure_tiny_weights
from tests.support import goldens
from tests.support.goldens import GOLDEN_DIR  # noqa: F401  (the tests' one import of it)

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / "configs" / "tiny.yaml"
EXAMPLE = REPO / "assets" / "example.png"
WRITE_GOLDEN = "python scripts/write_golden.py"


def golden_path(key: str | None = None, cascade: str = "tiny") -> Path | None:
    """The golden of the kernels ``key`` (default: this session's, ``pixal3d.kernels.key()``) verified on this
    kind of CPU, or None."""
    found = goldens.verified_for(key or kernels.key(), kernels.cpu_kind(), cascade=cascade)
    return found[0] if found is not None else None


def golden_or_skip(cascade: str = "tiny") -> dict[str, dict[str, str]]:
    """This session's golden stages (of ``cascade``: ``tests/support/goldens.py``), or a skip that says why none applies
    here and what to run."""
    key, kind = kernels.key(), kernels.cpu_kind()
    write = WRITE_GOLDEN if cascade == "tiny" else f"{WRITE_GOLDEN} --cascade {cascade}"
    found = goldens.verified_for(key, kind, cascade=cascade)
    if found is None:
        others = {path.name: goldens.kinds(goldens.load(path)) for path in goldens.paths(key, cascade=cascade)}
        if not others:
            pytest.skip(f"no golden for kernels {key} (pins {kernels.pins() or 'none'}, CPU {kind}): the relative "
                        f"checks run all the same; `{write}` writes one")
        listed = "; ".join(f"{name} on {', '.join(k)}" for name, k in others.items())
        pytest.skip(f"no golden of kernels {key} is verified on {kind} CPUs ({listed}): `{write}` "
                    f"compares and records this kind, or writes its own")
    path, golden = found
    if golden["threads"] != torch.get_num_threads():
        pytest.skip(f"{path.name} holds for {golden['threads']} threads, this session runs {torch.get_num_threads()}")
    if golden["versions"]["torch"] != torch.__version__:
        pytest.skip(f"{path.name} was written with torch {golden['versions']['torch']}, this is "
                    f"{torch.__version__}: `{write}` writes one for it")
    return golden["stages"]


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


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """``n`` intra-op threads inside the block (the session's count again after it): single-process bits to
    compare with spawned ranks, which run one thread each."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def one_thread_fingerprints(config: CascadeConfig, images: Mapping[str, Path]) -> dict[str, dict[str, dict[str, str]]]:
    """Each image's per-stage fingerprints from one process, one thread, the command's policy (auto): what a
    batch spread over one-thread ranks must give."""
    with torch_threads(1), Pixal3D.from_config(config, device="cpu") as pipe:
        return {name: pipe.run(path).fingerprints() for name, path in images.items()}


@pytest.fixture(scope="session")
def tiny_reference(tiny: CascadeConfig) -> dict[str, dict[str, str]]:
    """Fingerprints of the session's eager tiny run up to the decode (what ``scripts/write_golden.py``
    writes): the reference of the relative checks, compared once with the golden."""
    return run_tiny(tiny, "eager").fingerprints()
