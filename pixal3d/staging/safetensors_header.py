"""The one safetensors header reader: tensor names, dtypes, shapes and byte ranges, no tensor read.

Format: 8 bytes little-endian header length, the JSON header, then the tensor data. The reader
checks what a plan or a load must be able to trust: the file is not a git-lfs pointer, the header
parses, every tensor has ``data_offsets``, and the file is exactly as long as the header says.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header

Problem = Literal["missing", "lfs-pointer", "truncated", "corrupt"]


class SafetensorsHeaderError(ValueError):
    """A safetensors file that cannot be trusted; ``problem`` says which way it is broken."""

    def __init__(self, message: str, *, path: Path, problem: Problem):
        super().__init__(message)
        self.path = path
        self.problem = problem


@dataclass(frozen=True)
class SafetensorsHeader:
    """What the header of one file says. ``tensors``: name → ``{"dtype", "shape", "data_offsets"}``."""

    path: Path
    tensors: dict[str, dict[str, Any]]
    metadata: dict[str, str]
    header_bytes: int
    file_bytes: int

    @property
    def data_bytes(self) -> int:
        """Bytes of tensor data (the end of the last tensor's byte range)."""
        return max((int(t["data_offsets"][1]) for t in self.tensors.values()), default=0)


def read_safetensors_header(path: str | os.PathLike, *, check_length: bool = True) -> SafetensorsHeader:
    """Parse ``path``'s header; ``check_length`` also requires the file to hold exactly the data it declares."""
    path = Path(path)
    if not path.is_file():
        raise SafetensorsHeaderError(f"weights file {path} does not exist", path=path, problem="missing")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if head.startswith(b"version "):
            raise SafetensorsHeaderError(f"{path} is a git-lfs pointer, not the weights", path=path,
                                         problem="lfs-pointer")
        if len(head) < 8:
            raise SafetensorsHeaderError(f"{path} is truncated ({size} bytes)", path=path, problem="truncated")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or length > size - 8:
            raise SafetensorsHeaderError(f"{path} is truncated or not a safetensors file (header of {length} "
                                         f"bytes in a {size}-byte file)", path=path, problem="truncated")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            header = None
    if not isinstance(header, dict):
        raise SafetensorsHeaderError(f"{path} has a corrupt header", path=path, problem="corrupt")
    metadata = header.pop("__metadata__", None) or {}
    for key, info in header.items():
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise SafetensorsHeaderError(f"{path}: tensor {key!r} has no valid data_offsets; the file is corrupt",
                                         path=path, problem="corrupt")
    parsed = SafetensorsHeader(path, header, dict(metadata), length, size)
    expected = 8 + length + parsed.data_bytes
    if check_length and size != expected:
        state = "truncated" if size < expected else "longer than its header says"
        raise SafetensorsHeaderError(f"{path} is {state} ({size} bytes, header says {expected})", path=path,
                                     problem="truncated" if size < expected else "corrupt")
    return parsed
