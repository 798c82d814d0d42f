"""The golden files of the tiny cascades (``tiny``: one image; ``tiny_mv``: the example views), by kernel key and kind
of CPU (read by the tests and written by ``scripts/write_golden.py``; imports no torch, so the writer can pin the
kernels first).

Each cascade's files are its own, named by its prefix (``tiny_mv_<key>.json`` for the multi-view one; below, the
single-view names). A kernel key (``pixal3d.kernels.key()``: architecture and pinned family) has one golden,
``tiny_<key>.json``, listing the kinds of CPU whose runs gave exactly its bits (``verified_on``, each entry's
``kind`` from ``pixal3d.kernels.cpu_kind()``). The pins do not make every kind agree (an Intel AVX-512 CPU with
AMX does not give an AMD AVX2 CPU's bits under ``avx2pin``), so a kind whose run differs from every golden of
its key gets a variant, ``tiny_<key>.<kind>.json`` (``intel-avx512-amx``), that holds that kind's bits: on each
kind the tests compare with the one golden verified there, and skip where none is.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden"
CASCADES = ("tiny", "tiny_mv", "tiny_mesh")
"""The cascades with goldens: each its own files, ``<cascade>_<key>.json`` (``tiny``: configs/tiny.yaml on
assets/example.png; ``tiny_mv``: configs/tiny_mv.yaml on assets/views_example; ``tiny_mesh``: configs/tiny.yaml on
assets/example.png texturing assets/example_mesh.ply, up to ``mesh_decode``)."""


def slug(kind: str) -> str:
    """A kind of CPU as a file-name part: ``Intel AVX512 AMX`` → ``intel-avx512-amx``."""
    return "-".join(kind.lower().split())


def paths(key: str, folder: Path = GOLDEN_DIR, cascade: str = "tiny") -> list[Path]:
    """The goldens of ``key`` in ``folder``: the first one written, then the kinds' variants by name."""
    first = folder / f"{cascade}_{key}.json"
    return ([first] if first.exists() else []) + sorted(folder.glob(f"{cascade}_{key}.*.json"))


def kinds(golden: dict[str, Any]) -> list[str]:
    """The kinds of CPU a golden was verified on."""
    return [entry["kind"] for entry in golden["verified_on"]]


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def verified_for(key: str, kind: str, folder: Path = GOLDEN_DIR,
                 cascade: str = "tiny") -> tuple[Path, dict[str, Any]] | None:
    """The golden of ``key`` verified on ``kind`` (path and contents), or None."""
    for path in paths(key, folder, cascade):
        golden = load(path)
        if kind in kinds(golden):
            return path, golden
    return None


def path_for_new(key: str, kind: str, folder: Path = GOLDEN_DIR, cascade: str = "tiny") -> Path:
    """Where a golden of ``key`` first written on ``kind`` goes: ``<cascade>_<key>.json`` when the key has none
    yet, else that kind's variant."""
    if paths(key, folder, cascade):
        return folder / f"{cascade}_{key}.{slug(kind)}.json"
    return folder / f"{cascade}_{key}.json"
