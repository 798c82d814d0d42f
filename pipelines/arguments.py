"""The Python API's arguments checked at the door (``Pixal3D.plan`` / ``from_config``, ``run``, ``run_batch``):
a value of the wrong type is a ``TypeError`` and an unusable value a ``ValueError``, each naming the argument
and what it takes, raised before anything is planned or read — not an ``AttributeError`` from deep inside (issue
30: ``from_config(None)`` failed in the plan with ``'NoneType' object has no attribute 'weights'``).

What the values mean is checked where it is decided (a seed's range: ``config.check_seed``; a field of view:
``config.check_fov``; a memory budget's spelling: ``memory_budget.parse_budget``; an input, by its kind:
``pipelines.inputs``); this module checks what they are.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from pixal3d.config import CascadeConfig
from pixal3d.memory_budget import parse_budget
from pixal3d.staging import Policy, PolicyError


def _kind(value: Any) -> str:
    return type(value).__name__


def check_config(config: Any) -> None:
    """``config`` is a ``CascadeConfig`` or a path to a YAML file."""
    if not isinstance(config, (CascadeConfig, str, Path)):
        raise TypeError(f"config must be a CascadeConfig or the path of a YAML config (e.g. 'configs/tiny.yaml'), "
                        f"not {_kind(config)}")


def check_device(device: Any) -> None:
    """``device`` is None, a ``torch.device`` or its name."""
    if device is not None and not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a torch.device or a name such as 'cpu', 'cuda:1' or 'mps', not {_kind(device)}")


def check_sequence(values: Any, argument: str) -> None:
    """``values`` is a list (not one path, whose characters would become items)."""
    if isinstance(values, (str, Path)) or not isinstance(values, Sequence):
        raise TypeError(f"{argument} must be a list, not {_kind(values)}; for one input call run()")


def check_names(names: Any) -> None:
    """``names`` is None or a sequence of strings."""
    if names is None:
        return
    if isinstance(names, str) or not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"names must be a list of strings, one per image, not {_kind(names)}")


def check_optional(value: Any, argument: str, kinds: tuple[type, ...], what: str) -> None:
    """``value`` is None or one of ``kinds`` (``what`` says them in words)."""
    if value is not None and not isinstance(value, kinds):
        raise TypeError(f"{argument} must be {what} or None, not {_kind(value)}")


def check_callable(value: Any, argument: str) -> None:
    """``value`` is None or callable."""
    if value is not None and not callable(value):
        raise TypeError(f"{argument} must be a function (or None), not {_kind(value)}")


def check_flag(value: Any, argument: str) -> None:
    """``value`` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{argument} must be True or False, not {_kind(value)}")


def check_state_budget(value: Any) -> None:
    """``state_budget`` is None or a number of bytes (0: every state on disk)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"state_budget must be a number of bytes (an int) or None, not {_kind(value)}")
    if value < 0:
        raise ValueError(f"state_budget {value} is negative; pass a number of bytes (0: every state waits on disk)")


def check_order(order: Any) -> Any:
    """``order`` when it is a batch order (``image`` or ``stage``)."""
    if order not in ("image", "stage"):
        raise ValueError(f"batch order {order!r} is neither 'image' nor 'stage'")
    return order


def check_plan_arguments(config: Any, *, policy: Any, device: Any, replace: Any, until: Any,
                         memory_budget: Any) -> int | str | None:
    """What ``Pixal3D.plan`` takes, before it reads anything (an unknown policy name and a budget that is not a
    size included); returns the budget parsed, once (bytes, ``"auto"`` or None)."""
    check_config(config)
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, str, type(None))):
        raise TypeError(f"memory_budget must be a size such as '8G', a number of bytes, 'auto' or None, not "
                        f"{_kind(memory_budget)}")
    budget = memory_budget if memory_budget in (None, "auto") else parse_budget(memory_budget)
    if not isinstance(policy, (Policy, str)):
        raise TypeError(f"policy must be a Policy or one of {[p.value for p in Policy]}, not {_kind(policy)}")
    try:
        Policy(policy)
    except ValueError:
        raise PolicyError(f"unknown policy {policy!r}; choose one of {[p.value for p in Policy]}") from None
    check_device(device)
    check_optional(until, "until", (str,), "a stage name")
    if replace is not None and not isinstance(replace, Mapping):
        raise TypeError(f"replace must map stage names to stages, not {_kind(replace)}")
    return budget


def check_run_arguments(*, events: Any, progress: Any, callback: Any, trace: Any) -> None:
    """What ``run`` and ``run_batch`` share, by type."""
    check_callable(events, "events")
    check_callable(callback, "callback")
    check_flag(progress, "progress")
    check_optional(trace, "trace", (str, Path), "a path")
