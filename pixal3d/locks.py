"""An exclusive lock between processes on one path: ``exclusive_lock(lock_file, wait=...)``.

Two uses: first runs that generate the same cache folder wait for each other (the first writes, the
rest find the folder complete); two runs that would write the same output refuse to (``wait=False``
raises ``LockedError`` naming the process that holds it). The lock is ``flock`` on a small hidden file
that holds the owner's pid; the kernel drops it when its process dies, however it dies, so a crashed
run never leaves a stale lock, and the file is removed on release. A SIGKILL skips that removal: the file
stays, unlocked, until ``remove_if_stale`` (which locks it first, so a live holder's file is never taken)
clears it. Where ``fcntl`` does not exist (Windows) the lock does nothing.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None


class LockedError(RuntimeError):
    """Another process holds the lock (``holder``: its pid, when known)."""

    def __init__(self, message: str, holder: int | None = None):
        super().__init__(message)
        self.holder = holder


@contextmanager
def exclusive_lock(path: str | os.PathLike, *, wait: bool, what: str = "", owner: str = "another process"
                   ) -> Iterator[Path]:
    """Hold an exclusive lock on ``path`` (created; removed on release) for the block.

    wait:  block until the lock is free; ``False``: raise ``LockedError`` at once, saying that ``owner``
           (with its pid) is already writing ``what`` (default: the path)
    """
    path = Path(path)
    if fcntl is None:
        yield path
        return
    fd = _acquire(path, wait=wait, what=what or str(path), owner=owner)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield path
    finally:
        try:
            path.unlink(missing_ok=True)  # while still holding it: a waiter then sees the file gone and retries
        finally:
            os.close(fd)


def _acquire(path: Path, *, wait: bool, what: str, owner: str) -> int:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            who = f"{owner} (pid {holder})" if holder else owner
            raise LockedError(f"{who} is already writing {what}; wait for it to finish or choose another path",
                              holder) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # the previous holder removed this file as it released it: lock the current one


def _holder(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def remove_if_stale(path: str | os.PathLike) -> bool:
    """Remove the lock file ``path`` when no process holds it (its owner died without releasing it); True when
    removed. Removed while locked, as a release does, so a process waiting for it retries on a fresh file."""
    path = Path(path)
    if fcntl is None:
        return False
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its owner is alive
        os.close(fd)
        return False
    try:
        if os.fstat(fd).st_ino != os.stat(path).st_ino:
            return False  # released and recreated meanwhile: not the file we locked
        path.unlink()
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
