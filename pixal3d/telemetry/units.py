"""Strict parsing and printing of memory sizes and durations (binary units: 1G = 2**30 bytes)."""
from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_size(text: str) -> int:
    """Bytes in a size such as ``8G``, ``512M``, ``1.5GiB`` or ``100`` (a bare number is bytes)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r}; write a number with an optional K, M, G or T "
                         "(binary units), e.g. 8G or 512M")
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[unit.lower()])


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``250ms``, ``30s``, ``5m`` or ``2h`` (a bare number is seconds)."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"not a duration: {text!r}; write a number with an optional ms, s, m or h, "
                         "e.g. 30s or 5m")
    number, unit = match.groups()
    return float(number) * _DURATION_UNITS[(unit or "s").lower()]


def format_bytes(value: float | None) -> str:
    """``value`` in GiB with two decimals (MiB below 1 GiB); ``-`` when unknown."""
    if value is None:
        return "-"
    if abs(value) >= 2**30:
        return f"{value / 2**30:.2f} GiB"
    return f"{value / 2**20:.1f} MiB"
