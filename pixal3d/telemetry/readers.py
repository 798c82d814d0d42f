"""Platform-neutral memory readings built on the Linux, macOS and device readers plus psutil.

Every counter degrades to None ("unknown") instead of failing when the platform lacks it."""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

import psutil

from . import linux, macos
from .device import DeviceReader

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SystemMemory:
    """Machine-wide memory: bytes total/available (cgroup limit applied), percent available, swap used."""

    total: int | None
    available: int | None
    available_percent: float | None
    swap_used: int | None


def _swap_used() -> int | None:
    try:
        return int(psutil.swap_memory().used)
    except (OSError, RuntimeError):
        return None


def system_memory() -> SystemMemory:
    """Read the machine's memory; on macOS the percent is ``kern.memorystatus_level``."""
    try:
        virtual = psutil.virtual_memory()
        total, available = int(virtual.total), int(virtual.available)
    except (OSError, RuntimeError):
        total = available = None
    percent = None
    if sys.platform == "darwin":
        level = macos.memorystatus_level()
        percent = float(level) if level is not None else None
    elif total is not None and available is not None:
        total, available, _ = linux.cgroup_bounded(total, available)
    if percent is None and total and available is not None:
        percent = 100.0 * available / total
    return SystemMemory(total, available, percent, _swap_used())


class ProcessMemory:
    """This process's memory (Linux RSS, macOS phys_footprint, psutil RSS elsewhere) and its peak
    between two calls of :meth:`peak_and_reset`, exact where the platform allows."""

    def __init__(self) -> None:
        self.platform = "linux" if linux.is_linux() else sys.platform
        self._reset_works = self.platform == "linux" and linux.reset_peak()
        self._last_high = self._high_water()

    def current(self) -> int | None:
        """Bytes this process holds now."""
        if self.platform == "linux":
            return linux.process_memory()[0]
        if self.platform == "darwin":
            footprint = macos.footprint()
            if footprint is not None:
                return footprint.current
        try:
            return int(psutil.Process().memory_info().rss)
        except (OSError, psutil.Error):
            return None

    def _high_water(self) -> int | None:
        if self.platform == "linux":
            return linux.process_memory()[1]
        if self.platform == "darwin":
            footprint = macos.footprint()
            return footprint.lifetime_max if footprint is not None else None
        return None

    def peak_and_reset(self) -> int | None:
        """Exact peak since the previous call, or None when only sampling can tell.

        With a resettable high-water mark (Linux clear_refs) the peak is always exact. Otherwise
        a lifetime high-water mark that rose since the previous call was reached in between, so
        it is still the exact peak; when it did not rise the peak is unknown."""
        high = self._high_water()
        if self._reset_works:
            linux.reset_peak()
            return high
        previous, self._last_high = self._last_high, high
        if high is not None and previous is not None and high > previous:
            return high
        return None


class MemoryProbe:
    """What the meter reads: a sample of all counters, and exact peaks at window boundaries."""

    def __init__(self, device: Any = None):
        self.process = ProcessMemory()
        self.device = DeviceReader(device) if device is not None else None

    def sample(self) -> dict[str, float | int]:
        """Current counters by name; unknown ones are left out."""
        system = system_memory()
        values: dict[str, float | int | None] = {
            "process": self.process.current(),
            "available": system.available,
            "swap_used": system.swap_used,
        }
        if self.process.platform == "linux":
            pressure = linux.memory_pressure()
            values["psi_some_avg10"] = pressure.get("some_avg10") if pressure else None
            group = linux.cgroup_memory()
            values["cgroup"] = group.usage if group else None
        elif self.process.platform == "darwin":
            values["level"] = system.available_percent
        if self.device is not None:
            values.update(self.device.sample())
        return {name: value for name, value in values.items() if value is not None}

    def peaks(self) -> dict[str, int]:
        """Exact peaks since the previous call (``process_peak``, ``device_peak``), then reset."""
        values = {"process_peak": self.process.peak_and_reset()}
        if self.device is not None:
            values["device_peak"] = self.device.peak_and_reset()
        return {name: value for name, value in values.items() if value is not None}
