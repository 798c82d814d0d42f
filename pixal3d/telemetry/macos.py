"""macOS memory counters through libproc and sysctl (ctypes); each returns None when unavailable.

``phys_footprint`` is what Activity Monitor shows in its Memory column and includes the Metal
allocations of the process, so on Apple Silicon it covers both CPU and GPU tensors."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from dataclasses import dataclass

logger = logging.getLogger(__name__)

RUSAGE_INFO_V2 = 2
RUSAGE_INFO_V4 = 4

_V2_FIELDS = [
    "ri_user_time", "ri_system_time", "ri_pkg_idle_wkups", "ri_interrupt_wkups", "ri_pageins",
    "ri_wired_size", "ri_resident_size", "ri_phys_footprint", "ri_proc_start_abstime",
    "ri_proc_exit_abstime", "ri_child_user_time", "ri_child_system_time",
    "ri_child_pkg_idle_wkups", "ri_child_interrupt_wkups", "ri_child_pageins",
    "ri_child_elapsed_abstime", "ri_diskio_bytesread", "ri_diskio_byteswritten",
]
_V3_FIELDS = [
    "ri_cpu_time_qos_default", "ri_cpu_time_qos_maintenance", "ri_cpu_time_qos_background",
    "ri_cpu_time_qos_utility", "ri_cpu_time_qos_legacy", "ri_cpu_time_qos_user_initiated",
    "ri_cpu_time_qos_user_interactive", "ri_billed_system_time", "ri_serviced_system_time",
]
_V4_FIELDS = [
    "ri_logical_writes", "ri_lifetime_max_phys_footprint", "ri_instructions", "ri_cycles",
    "ri_billed_energy", "ri_serviced_energy", "ri_interval_max_phys_footprint", "ri_runnable_time",
]


class RusageInfoV2(ctypes.Structure):
    """``struct rusage_info_v2`` from <sys/resource.h>."""

    _fields_ = [("ri_uuid", ctypes.c_uint8 * 16)] + [(n, ctypes.c_uint64) for n in _V2_FIELDS]


class RusageInfoV4(ctypes.Structure):
    """``struct rusage_info_v4``: v2 plus QoS times (v3) plus lifetime/interval max footprint."""

    _fields_ = RusageInfoV2._fields_ + [(n, ctypes.c_uint64) for n in _V3_FIELDS + _V4_FIELDS]


@dataclass(frozen=True)
class Footprint:
    """Physical footprint now and its lifetime maximum (None where the kernel has no v4 record)."""

    current: int
    lifetime_max: int | None


def footprint_from_raw(raw: bytes) -> Footprint:
    """Decode a ``rusage_info_v4`` (or the shorter v2) buffer filled by ``proc_pid_rusage``."""
    if len(raw) >= ctypes.sizeof(RusageInfoV4):
        info = RusageInfoV4.from_buffer_copy(raw)
        return Footprint(info.ri_phys_footprint, info.ri_lifetime_max_phys_footprint)
    info2 = RusageInfoV2.from_buffer_copy(raw)
    return Footprint(info2.ri_phys_footprint, None)


def level_from_raw(raw: bytes) -> int | None:
    """``kern.memorystatus_level`` (percent of memory available, 0-100) from its int32 bytes."""
    if len(raw) < 4:
        return None
    value = int.from_bytes(raw[:4], sys.byteorder, signed=True)
    return value if 0 <= value <= 100 else None


def _library(name: str) -> ctypes.CDLL | None:
    if sys.platform != "darwin":
        return None
    path = ctypes.util.find_library(name)
    try:
        return ctypes.CDLL(path or name, use_errno=True)
    except OSError:
        return None


def _rusage_raw(pid: int) -> bytes | None:
    libproc = _library("proc")
    if libproc is None:
        return None
    for flavor, struct in ((RUSAGE_INFO_V4, RusageInfoV4), (RUSAGE_INFO_V2, RusageInfoV2)):
        info = struct()
        if libproc.proc_pid_rusage(ctypes.c_int(pid), ctypes.c_int(flavor), ctypes.byref(info)) == 0:
            return bytes(info)
    logger.debug("proc_pid_rusage failed for pid %d (errno %d)", pid, ctypes.get_errno())
    return None


def footprint(pid: int | None = None) -> Footprint | None:
    """Physical footprint of ``pid`` (default: this process) from ``proc_pid_rusage``."""
    raw = _rusage_raw(os.getpid() if pid is None else pid)
    return footprint_from_raw(raw) if raw is not None else None


def sysctl_raw(name: str, size: int) -> bytes | None:
    """The raw value of a sysctl by name, or None where it does not exist."""
    libc = _library("c")
    if libc is None:
        return None
    buffer = ctypes.create_string_buffer(size)
    length = ctypes.c_size_t(size)
    if libc.sysctlbyname(name.encode(), buffer, ctypes.byref(length), None, ctypes.c_size_t(0)) != 0:
        return None
    return buffer.raw[: length.value]


def memorystatus_level() -> int | None:
    """Percent of memory available as the kernel's memory-pressure logic sees it (0-100)."""
    raw = sysctl_raw("kern.memorystatus_level", 4)
    return level_from_raw(raw) if raw is not None else None
