"""The Pixal3D cascade as stage objects, the library entry point and the command line.

    from pipelines import Pixal3D
    result = Pixal3D.from_config("configs/tiny.yaml").run("assets/example.png", seed=42)
    result.save("outputs/demo.glb")
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

_WHERE = {"BatchItem": ".batch", "NotEnoughMemoryError": ".errors", "Pixal3D": ".pipeline", "RunPlan": ".plan",
          "Result": ".result"}
"""Each public name's module, imported on first use (PEP 562), so that ``pipelines.cli --help`` loads no torch."""

__all__ = ["BatchItem", "NotEnoughMemoryError", "Pixal3D", "Result", "RunPlan"]


def __getattr__(name: str) -> Any:
    """The public name ``name``, importing its module now."""
    if name not in _WHERE:
        raise AttributeError(f"module 'pipelines' has no attribute {name!r}")
    value = getattr(import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value
