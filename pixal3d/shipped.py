"""Where the shipped configs are, importing nothing heavy (the command's ``--help`` names the default one)."""
from __future__ import annotations

from pathlib import Path

SHIPPED = Path(__file__).resolve().parent / "configs"
"""The configs installed with the package (package data; in a checkout they are in ``configs/``)."""
CHECKOUT = Path(__file__).resolve().parents[1] / "configs"


def shipped_config(name: str) -> Path:
    """The shipped config called ``name`` (``tiny``, ``tiny.yaml``, ``1024_cascade.yaml``, ...)."""
    folder = SHIPPED if SHIPPED.is_dir() else CHECKOUT
    return folder / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
