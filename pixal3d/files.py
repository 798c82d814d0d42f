"""Atomic writes: a reader never sees half a file. Write a temporary file beside the target (same file
system), then rename it over the target; on any failure the temporary file is removed and the target is
untouched.

The temporary name is hidden and ends in ``.tmp`` (``.out.glb.1a2b3c.tmp``), so a glob such as ``*.glb``
never picks it up; the finished file gets an ordinary file's mode (``0666`` less the umask), not the
``0600`` of ``mkstemp``.
"""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write to; it becomes ``path`` when the block succeeds."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> int:
    """Write ``data`` to ``path`` atomically; return the number of bytes."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return len(data)


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Write ``data`` as indented JSON (UTF-8, trailing newline) to ``path`` atomically."""
    write_bytes_atomic(path, (json.dumps(data, indent=2) + "\n").encode("utf-8"))
