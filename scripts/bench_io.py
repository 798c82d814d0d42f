"""Raw sequential read throughput of checkpoint files, with the page cache made cold or warm on purpose.

The benchmark compares the cascade's load throughput with this: the same bytes read front to back
with ``readinto`` into one reused buffer (no tensor is built). ``evict`` drops a file's pages from the
page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (per file, any user, only clean pages no
process maps); ``cached_fraction`` checks what is still resident with ``mincore`` on a read-only map,
so a "cold" figure is only called cold when the check says so.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

BLOCK = 16 << 20  # 16 MiB reads
_PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class ReadResult:
    """One sequential read of a set of files: bytes, seconds, GB/s (1e9) and the cache state before it."""

    label: str
    nbytes: int
    seconds: float
    cached_before: float  # fraction of the files' pages in the page cache just before the read

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def to_dict(self) -> dict:
        return {**asdict(self), "gb_per_s": round(self.gb_per_s, 3)}


def evict(path: str | os.PathLike) -> None:
    """Ask the kernel to drop ``path``'s clean pages from the page cache (POSIX_FADV_DONTNEED)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return libc


def cached_fraction(path: str | os.PathLike) -> float | None:
    """Fraction of ``path``'s pages in the page cache (mincore), or None where mincore is unavailable."""
    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    try:
        libc = _libc()
    except OSError:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = (size + _PAGE - 1) // _PAGE
            vector = ctypes.create_string_buffer(pages)
            if libc.mincore(address, size, vector) != 0:
                return None
            return sum(byte & 1 for byte in vector.raw) / pages
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


def read_sequential(paths: Iterable[str | os.PathLike], label: str = "read") -> ReadResult:
    """Read every file front to back in 16 MiB blocks into one buffer; time the whole set."""
    paths = [Path(p) for p in paths]
    cached = mean_cached_fraction(paths)
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    total = 0
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    break
                total += n
    return ReadResult(label, total, time.perf_counter() - start, cached)


def mean_cached_fraction(paths: list[Path]) -> float:
    """Size-weighted fraction of the files' pages in the page cache (NaN where mincore is unavailable)."""
    sizes = [p.stat().st_size for p in paths]
    fractions = [cached_fraction(p) for p in paths]
    if any(f is None for f in fractions) or not sum(sizes):
        return float("nan")
    return sum(f * s for f, s in zip(fractions, sizes)) / sum(sizes)


def cold_and_warm(paths: Iterable[str | os.PathLike]) -> dict[str, ReadResult]:
    """Raw read throughput with the files evicted first (``cold``), then read again (``warm``)."""
    paths = list(paths)
    for path in paths:
        evict(path)
    cold = read_sequential(paths, "cold")
    warm = read_sequential(paths, "warm")
    return {"cold": cold, "warm": warm}
