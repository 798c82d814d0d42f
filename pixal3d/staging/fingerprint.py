"""Fingerprints: sha256 over each tensor's dtype, shape and bytes, so two runs compare bit for bit.

``fingerprint_tensor`` hashes one tensor; ``fingerprints(value)`` walks the values a stage
produces (tensors, NumPy arrays, dataclasses, dicts, lists, PIL images, numbers, bytes, and any object
with a ``fingerprint_parts()`` method returning a dict of such values) and returns
``{dotted name: "sha256 hex"}``. ``first_difference`` names where two runs' per-stage fingerprints part.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np
import torch


def fingerprint_tensor(tensor: torch.Tensor) -> str:
    """sha256 of ``dtype``, ``shape`` and the raw bytes of ``tensor`` (on the CPU, contiguous)."""
    t = tensor.detach().to("cpu").contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    digest = hashlib.sha256()
    digest.update(f"{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def fingerprints(value: Any, name: str) -> dict[str, str]:
    """Fingerprints of every tensor inside ``value``, keyed ``name`` or ``name.<field>``."""
    out: dict[str, str] = {}
    _walk(value, name, out)
    return out


def first_difference(actual: dict[str, dict[str, str]], expected: dict[str, dict[str, str]]) -> str:
    """The first stage, in ``expected``'s order, whose fingerprints differ in ``actual``, with the differing
    names (``"first differing stage 'structure': ['ss_latent']"``); ``""`` when the two are equal."""
    for stage, prints in expected.items():
        if actual.get(stage) != prints:
            names = sorted(k for k, v in prints.items() if actual.get(stage, {}).get(k) != v)
            return f"first differing stage {stage!r}: {names}"
    return "extra stages" if actual != expected else ""


def _walk(value: Any, name: str, out: dict[str, str]) -> None:
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        out[name] = fingerprint_tensor(value)
    elif callable(getattr(value, "fingerprint_parts", None)):
        for key, item in value.fingerprint_parts().items():
            _walk(item, f"{name}.{key}", out)
    elif isinstance(value, (bytes, bytearray)):
        out[name] = fingerprint_tensor(torch.from_numpy(np.frombuffer(value, dtype=np.uint8).copy()))
    elif isinstance(value, dict):
        for key, item in value.items():
            _walk(item, f"{name}.{key}", out)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _walk(item, f"{name}.{i}", out)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _walk(getattr(value, f.name), f"{name}.{f.name}", out)
    elif isinstance(value, (bool, int, float)):
        out[name] = fingerprint_tensor(torch.tensor(value, dtype=torch.float64 if isinstance(value, float)
                                                    else torch.int64))
    elif hasattr(value, "mode") and hasattr(value, "size") and hasattr(value, "tobytes"):  # PIL image
        out[name] = fingerprint_tensor(torch.from_numpy(np.array(value)))
    elif isinstance(value, np.ndarray):
        out[name] = fingerprint_tensor(torch.from_numpy(np.ascontiguousarray(value)))
    else:
        raise TypeError(f"cannot fingerprint {name}: {type(value).__name__}")
