"""Atomic writes: a reader never sees half a file, and files that belong together appear together.

Write temporary files beside the targets (same file system), then rename them over the targets; on any
failure — the write, a full disk, a signal turned into an exception (``pixal3d.interrupts``) — every
temporary file is removed and no target is touched. ``atomic_paths`` does this for a group (a GLB, its
run.json and its latents): all are written before the first rename, so a full disk leaves none of them,
and if a rename itself fails the targets already renamed are removed again (both or neither).

The group's invariant, which holds after SIGKILL and power loss too (no ``finally`` runs then): **the last
path is the commit point.** It is visible only when every other path of the group is complete beside it:
an older file under the last path's name is removed first, the others are renamed and flushed (their
folders ``fsync``-ed), and the last is renamed after them. A kill between two renames therefore leaves at
most the group's other files without the last one (a run.json without its GLB) — an unfinished group that
a reader treats as absent and the next run over that path removes (``pipelines/leftovers.py``) — never the
last file without the others, and never an older last file beside newer others.

Durable too: each temporary file is flushed to disk (``fsync``) before its rename and the folder after
the renames, so a power loss or a crash of the machine (not only of the process) leaves the old file or the
new one, never an empty or truncated one under the target's name (a resumable work dir relies on it).

The temporary name is hidden and ends in ``.tmp`` (``.out.glb.1a2b3c.tmp``), so a glob such as ``*.glb``
never picks it up; the finished file gets an ordinary file's mode (``0666`` less the umask), not the
``0600`` of ``mkstemp``. An ``OSError`` from writing a temporary file names its target, not the hidden name.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_paths(paths: Sequence[str | os.PathLike]) -> Iterator[list[Path]]:
    """Yield one temporary path beside each of ``paths``; they all become their targets when the block
    succeeds, none does otherwise. The last of ``paths`` is the group's commit point (see the module's doc)."""
    targets = [Path(p) for p in paths]
    temps: list[Path] = []
    renamed: list[Path] = []
    committed = False
    try:
        for target in targets:
            try:
                fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            except OSError as err:
                raise name_target(err, target) from err
            os.close(fd)
            temps.append(Path(name))
        try:
            yield temps
        except OSError as err:
            named = {str(tmp): target for tmp, target in zip(temps, targets)}
            if str(err.filename) in named:
                raise name_target(err, named[str(err.filename)]) from err
            raise
        mode = 0o666 & ~_umask()
        for tmp, target in zip(temps, targets):
            try:
                os.chmod(tmp, mode)
                _sync(tmp)
            except OSError as err:
                raise name_target(err, target) from err
        if len(targets) > 1:  # the commit point first goes: an older one never stands beside newer others
            try:
                targets[-1].unlink(missing_ok=True)
            except OSError as err:
                raise name_target(err, targets[-1]) from err
        for index, (tmp, target) in enumerate(zip(temps, targets)):
            if index == len(targets) - 1:
                for folder in dict.fromkeys(t.parent for t in targets[:-1]):
                    sync_folder(folder)  # the others' renames are on the disk before the commit point's
            try:
                os.replace(tmp, target)
            except OSError as err:
                raise name_target(err, target) from err
            renamed.append(target)
        committed = True
        sync_folder(targets[-1].parent)
    finally:
        for tmp in temps:
            tmp.unlink(missing_ok=True)
        if not committed:
            for target in renamed:
                target.unlink(missing_ok=True)


def _sync(path: Path) -> None:
    """Flush ``path``'s data to the disk (on macOS through the drive's own cache too: ``F_FULLFSYNC``, as Apple
    advises, since its ``fsync`` stops at the drive)."""
    fd = os.open(path, os.O_RDWR)
    try:
        if sys.platform == "darwin":
            import fcntl

            try:
                fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
                return
            except OSError:  # a file system without it (some network ones): fsync is what remains
                pass
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_folder(folder: Path) -> None:
    """Flush ``folder``'s entries (the renames) to the disk, where the system allows it (not on Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder: the renames are done, just not yet flushed
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write to; it becomes ``path`` when the block succeeds."""
    with atomic_paths([path]) as (tmp,):
        yield tmp


def leftover_temporaries(target: str | os.PathLike) -> list[Path]:
    """The temporary files a killed writer of ``target`` left beside it (``.NAME.<random>.tmp``): only a writer
    of ``target`` makes them, so once a caller holds ``target``'s lock every one found is a leftover."""
    target = Path(target)
    prefix = f".{target.name}."
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return []
    return sorted(p for p in entries if p.name.startswith(prefix) and p.name.endswith(".tmp")
                  and len(p.name) > len(prefix) + len(".tmp"))


def write_bytes_to(tmp: Path, data: bytes, target: str | os.PathLike) -> int:
    """Write ``data`` to the temporary file ``tmp``; a failure (a full disk, say) names ``target``."""
    try:
        tmp.write_bytes(data)
    except OSError as err:
        raise name_target(err, target) from err
    return len(data)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> int:
    """Write ``data`` to ``path`` atomically; return the number of bytes."""
    with atomic_path(path) as tmp:
        return write_bytes_to(tmp, data, path)


def json_bytes(data: Any) -> bytes:
    """``data`` as indented JSON (UTF-8, trailing newline)."""
    return (json.dumps(data, indent=2) + "\n").encode("utf-8")


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Write ``data`` as indented JSON (UTF-8, trailing newline) to ``path`` atomically."""
    write_bytes_atomic(path, json_bytes(data))


def name_target(err: OSError, target: str | os.PathLike) -> OSError:
    """The same error (errno, message, subclass) naming ``target`` as its file."""
    return OSError(err.errno, err.strerror or str(err), str(target))


def folds_case(folder: str | os.PathLike) -> bool:
    """True when ``folder``'s file system treats names that differ only in case as one file (macOS's and
    Windows' defaults): ``Cup.glb`` would overwrite ``cup.glb`` there. Probed with a temporary file."""
    fd, name = tempfile.mkstemp(prefix=".pixal3d-case-probe-", dir=folder)
    os.close(fd)
    probe = Path(name)
    try:
        swapped = probe.with_name(probe.name.swapcase())
        return swapped.exists() and os.path.samefile(probe, swapped)
    finally:
        probe.unlink(missing_ok=True)
