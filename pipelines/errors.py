"""Which errors a user caused, and how to say so: ``classify(err, started=...)`` → ``Failure`` (kind, one
line, exit code), or ``None`` for a programming error whose traceback must show.

The one place every front end asks (the command, batches, the web app): an error a user can cause —
a bad input, config or option, missing or corrupt weights, not enough memory, a full disk, a path that
cannot be written, an interrupt — becomes one line that names the value and the next step. Exit codes
follow the command's promise: 2 before the run starts (nothing was computed), 1 during it, 128 + N
when signal N stopped it (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP).
"""
from __future__ import annotations

import errno
import logging
from dataclasses import dataclass

import torch

from pixal3d.config import ConfigError, SettingError, UsageError
from pixal3d.devices import DeviceError
from pixal3d.hub import MissingWeightsError, WeightsError
from pixal3d.interrupts import Terminated
from pixal3d.locks import LockedError
from pixal3d.memory_budget import MemoryBudgetError
from pixal3d.models.loading import CheckpointError
from pixal3d.models.preprocess import ImageError
from pixal3d.parallel import LinkError, ParallelConfigError, PeerFailedError
from pixal3d.staging import PolicyError, StageGraphError
from pixal3d.staging.mps_memory import MpsMemoryLimitError
from pixal3d.staging.stream import WeightsCutShort

from .structure import EmptyStructureError
from .work_dir import WorkDirError

logger = logging.getLogger(__name__)

EXIT_DURING_RUN = 1
EXIT_BEFORE_RUN = 2


class NotEnoughMemoryError(RuntimeError):
    """Even the smallest-footprint policy needs more memory than the machine has available."""


# Our own exceptions for what a user can cause, by kind. Their messages already name the value, the rule
# and the next step.
KINDS: tuple[tuple[type[BaseException], str], ...] = (
    (UsageError, "usage"), (SettingError, "usage"), (LockedError, "usage"), (DeviceError, "usage"),
    (WorkDirError, "usage"),
    (ConfigError, "config"),
    (ImageError, "input"), (EmptyStructureError, "input"), (WeightsError, "weights"), (CheckpointError, "weights"),
    (WeightsCutShort, "weights"),
    (NotEnoughMemoryError, "memory"), (PolicyError, "memory"), (MpsMemoryLimitError, "memory"),
    (StageGraphError, "config"), (MemoryBudgetError, "memory"), (ParallelConfigError, "config"), (PeerFailedError, "parallel"),
    (LinkError, "parallel"),
)

MEMORY_ADVICE = ("close other programs, run with policy=staged, or lower export.texture_size / "
                 "export.decimation_target in the config")
# torch raises a plain RuntimeError (not OutOfMemoryError) when a CPU allocation fails, and older builds
# do the same for MPS; these are the messages (c10/core/impl/alloc_cpu.cpp, the MPS allocator).
TORCH_OOM_MESSAGES = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory",
                      "MPS backend out of memory")
DISK_ERRNOS = {errno.ENOSPC: "free some space or write somewhere else",
               errno.EDQUOT: "free some space or write somewhere else",
               errno.EFBIG: "the file system's or the process's file-size limit was reached: raise the limit or "
                            "write somewhere else"}
PERMISSION_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)


@dataclass(frozen=True)
class Failure:
    """A user-caused error, ready to report.

    kind:      usage, config, input, weights, memory, disk, permission, io, parallel (another rank failed or a
               link broke) or interrupted (a web app maps
               these to its status codes; a batch records them per image)
    message:   one line: what happened, the value or path, and what to do next
    exit_code: the command's exit status for it
    """

    kind: str
    message: str
    exit_code: int


def classify(err: BaseException, *, started: bool) -> Failure | None:
    """The ``Failure`` for ``err`` (``started``: the run had begun computing), or ``None`` for a bug."""
    code = EXIT_DURING_RUN if started else EXIT_BEFORE_RUN
    if isinstance(err, Terminated):
        return Failure("interrupted", f"{err}; nothing was written for the image in progress", err.exit_code)
    if isinstance(err, KeyboardInterrupt):
        return Failure("interrupted", "stopped by Ctrl-C (SIGINT); nothing was written for the image in progress",
                       130)
    if isinstance(err, MissingWeightsError):  # a list, one file a line, ending with the command that fetches them
        return Failure("weights", str(err).strip(), code)
    for cls, kind in KINDS:
        if isinstance(err, cls):
            return Failure(kind, one_line(err), code)
    if isinstance(err, torch.OutOfMemoryError):
        return Failure("memory", f"not enough device memory: {_first_line(err)}; {MEMORY_ADVICE}", code)
    if isinstance(err, MemoryError) or (isinstance(err, RuntimeError) and any(m in str(err) for m in TORCH_OOM_MESSAGES)):
        detail = _first_line(err) or "an allocation failed"  # numpy's _ArrayMemoryError is a MemoryError
        return Failure("memory", f"not enough memory: {detail}; {MEMORY_ADVICE}", code)
    if isinstance(err, OSError):
        return _os_failure(err, code)
    return None


def one_line(err: BaseException) -> str:
    """The message on one line (whitespace runs, newlines included, become one space)."""
    return " ".join(str(err).split()) or type(err).__name__


def _os_failure(err: OSError, code: int) -> Failure:
    """The system's own words (``No space left on device``), the file, and what to do."""
    reason = err.strerror or one_line(err)
    path = f" {err.filename}" if err.filename is not None else ""
    if err.errno in DISK_ERRNOS:
        return Failure("disk", f"{reason} while writing{path}; {DISK_ERRNOS[err.errno]}", code)
    if err.errno in PERMISSION_ERRNOS or isinstance(err, PermissionError):
        return Failure("permission", f"{reason}:{path}; choose a path you can write, or change its permissions", code)
    if err.strerror and err.filename is not None:
        return Failure("io", f"{reason}:{path}", code)
    return Failure("io", one_line(err), code)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0]


def error_line(err: BaseException) -> str:
    """The line a visitor or a client sees for ``err`` (the web app, the job server): the classifier's line for a
    user-caused error; for anything else a line naming it as unexpected (its traceback is logged)."""
    failure = classify(err, started=True)
    if failure is not None:
        return failure.message
    logger.error("job failed unexpectedly", exc_info=err)
    return f"unexpected error ({type(err).__name__}: {one_line(err)}); the server log has the traceback"
