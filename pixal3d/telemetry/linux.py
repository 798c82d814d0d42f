"""Linux memory counters read from /proc and /sys; each returns None when the counter is absent."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")
PSI_MEMORY = Path("/proc/pressure/memory")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# A cgroup v1 "no limit" reads as a page-rounded 2**63 - 1; anything this large means unlimited.
_UNLIMITED = 2**60


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def parse_status(text: str) -> dict[str, int]:
    """Byte values of the ``Vm*`` lines of a /proc/PID/status text (``VmRSS``, ``VmHWM``, ...)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if key.startswith("Vm") and len(fields) == 2 and fields[1] == "kB" and fields[0].isdigit():
            values[key] = int(fields[0]) * 1024
    return values


def process_memory(path: Path = STATUS) -> tuple[int | None, int | None]:
    """(resident bytes, peak resident bytes since the last reset) of this process."""
    text = _read_text(path)
    if text is None:
        return None, None
    values = parse_status(text)
    return values.get("VmRSS"), values.get("VmHWM")


def reset_peak(path: Path = CLEAR_REFS) -> bool:
    """Reset this process's VmHWM to its current RSS (writes "5" to clear_refs, Linux >= 4.0).

    Returns False where the kernel or a sandbox does not permit it; the caller then falls back
    to sampling."""
    try:
        with open(path, "w") as handle:
            handle.write("5")
        return True
    except OSError as error:
        logger.debug("cannot reset the peak RSS through %s: %s", path, error)
        return False


def parse_psi(text: str) -> dict[str, float]:
    """``{'some_avg10': ..., 'full_avg60': ..., 'some_total': ...}`` from a PSI file's text."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        kind, *pairs = line.split()
        for pair in pairs:
            name, _, number = pair.partition("=")
            try:
                values[f"{kind}_{name}"] = float(number)
            except ValueError:
                continue
    return values


def memory_pressure(path: Path = PSI_MEMORY) -> dict[str, float] | None:
    """Memory pressure stall information (PSI), or None on kernels without it."""
    text = _read_text(path)
    return parse_psi(text) if text else None


@dataclass(frozen=True)
class CgroupMemory:
    """Memory charged to this process's cgroup; ``limit``/``peak`` None when unlimited/unknown."""

    version: int
    usage: int
    limit: int | None
    peak: int | None


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    if text is None:
        return None
    text = text.strip()
    return int(text) if text.isdigit() else None


def _own_cgroup_paths(proc_cgroup: Path) -> dict[str, str]:
    """Controller (``''`` for v2) -> path of this process's cgroup, from /proc/self/cgroup."""
    paths: dict[str, str] = {}
    for line in (_read_text(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                paths[controller] = parts[2]
    return paths


def _first_dir(candidates: list[Path], marker: str) -> Path | None:
    return next((path for path in candidates if (path / marker).exists()), None)


def _tightest_limit(group: Path, top: Path, name: str) -> int | None:
    """The lowest ``name`` limit of ``group`` and every cgroup above it up to ``top``: a limit set on a parent
    (a systemd slice, a container's group) binds its children as their own does. None: unlimited."""
    limits = []
    while True:
        limit = _read_int(group / name)  # v2's "max" reads as None
        if limit is not None and limit < _UNLIMITED:
            limits.append(limit)
        if group == top or top not in group.parents:
            break
        group = group.parent
    return min(limits) if limits else None


def cgroup_memory(root: Path = CGROUP_ROOT,
                  proc_cgroup: Path = Path("/proc/self/cgroup")) -> CgroupMemory | None:
    """Usage, limit and peak of this process's memory cgroup (v2 first, then v1), or None. The limit is the
    lowest of its group's and its ancestors' (``memory.max``; v1 ``memory.limit_in_bytes``)."""
    own = _own_cgroup_paths(proc_cgroup)
    # Inside a container the cgroup is often mounted at the root although /proc names a path.
    v2 = _first_dir([root / own.get("", "/").lstrip("/"), root], "memory.current")
    if v2 is not None:
        usage = _read_int(v2 / "memory.current")
        if usage is not None:
            return CgroupMemory(2, usage, _tightest_limit(v2, root, "memory.max"), _read_int(v2 / "memory.peak"))
    v1_root = root / "memory"
    v1 = _first_dir([v1_root / own.get("memory", "/").lstrip("/"), v1_root], "memory.usage_in_bytes")
    if v1 is None:
        return None
    usage = _read_int(v1 / "memory.usage_in_bytes")
    if usage is None:
        return None
    return CgroupMemory(1, usage, _tightest_limit(v1, v1_root, "memory.limit_in_bytes"),
                        _read_int(v1 / "memory.max_usage_in_bytes"))


def cgroup_bounded(total: int, available: int) -> tuple[int, int, CgroupMemory | None]:
    """The machine's ``total`` and ``available`` bytes as this process may use them: its cgroup's limit where that
    is lower than ``total``, available then the limit less what the group holds (never more than the machine has
    free); and the group when it is what bounds them (None: the machine's own figures)."""
    group = cgroup_memory()
    if group is not None and group.limit is not None and group.limit < total:
        return group.limit, min(available, max(group.limit - group.usage, 0)), group
    return total, available, None


def is_linux() -> bool:
    """True where /proc/self/status exists (Linux, WSL)."""
    return os.path.exists(STATUS)
