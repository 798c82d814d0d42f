"""Data-parallel batches: every data group of a torchrun job runs whole images of one batch.

Under ``--parallel data`` each rank is a data group of one: it plans, loads and runs the cascade as a single
process would (its device ``cuda:<local rank>``, its share of the machine's memory), through the same executor,
and only the images are shared out. Under ``--parallel cfg|pipefusion|both --data-groups K`` each group is a job
of G × N ranks of its own (``pixal3d.parallel``: its own process groups and store prefix); its rank 0, the
group's *leader*, runs the images as rank 0 of a one-group job does, its other ranks follow it, and only the
leaders take part in what this module does. Which images a group runs:

* with a work directory every rank sees (one machine, or a file system they share), groups *claim* images as
  they go (``Claims``): a claim is ``<work dir>/<image>/.pixal3d-claim``, created with ``O_EXCL`` and held
  with ``flock`` while the group runs the image, so a fast group takes more images, and a group that dies
  (its lock goes with its process) leaves its image to be taken over, resumed from its stage records;
* without one the split is static: image i to group i mod K.

At the end every group reports its images' rows to rank 0 (group 0's leader) through the job's c10d store;
rank 0 writes the one ``batch.json`` and summary line and posts the exit code every leader then returns. Every rank beats a heartbeat
counter in the store while it runs, so waiting for a slow group is not a timeout: a group whose heartbeat stops
for the job's timeout (killed, its machine gone) is named by rank 0 (a rank that hangs in a
stage keeps beating: it is waited for); the images it claimed stay resumable: the same command,
run again, finishes them.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from pixal3d.parallel import ParallelSettings, PeerFailedError
from pixal3d.parallel.topology import Topology
from pixal3d.staging.executor import Executor

from .batch import BatchItem
from .work_dir import WorkDir

try:
    import fcntl
except ImportError:  # Windows: no claims, so no work dir shared between groups
    fcntl = None

logger = logging.getLogger(__name__)

CLAIM = ".pixal3d-claim"
UNWRITTEN_S = 60.0
"""A claim file still empty after this long belongs to a process that died between creating and writing it."""


class GroupStoppedError(PeerFailedError):
    """A data group sent no report within the job's timeout (its process died or hangs)."""


# -- claims --------------------------------------------------------------------------------------------
class Claims:
    """This group's claims on images in ``work``: ``take(name)`` (True when the image is ours now), ``done``."""

    def __init__(self, work: WorkDir, job: str, rank: int):
        if fcntl is None:
            raise OSError("claims need flock (not available on this system); run --parallel data without --work-dir")
        self.work, self.job, self.rank = work, job, rank
        self._held: dict[str, int] = {}  # image name -> the claim's open, locked descriptor

    def path(self, name: str) -> Path:
        return self.work.folder(name) / CLAIM

    def take(self, name: str) -> bool:
        """Claim ``name``: a new claim file, or one whose owner's lock is gone and which this job has not
        finished (an earlier job's finished image is run again: resumed from its records)."""
        path = self.path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        except FileExistsError:
            return self._take_over(path, name)
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocks only while another group looks at the new, empty file
        self._write(fd, name, "claimed")
        return True

    def _take_over(self, path: Path, name: str) -> bool:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return self.take(name)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live group holds it
            os.close(fd)
            return False
        text = os.pread(fd, 4096, 0).decode(errors="replace")
        try:
            claim = json.loads(text)
        except ValueError:
            claim = None
        if claim is None and time.time() - os.fstat(fd).st_mtime < UNWRITTEN_S:  # being written right now
            os.close(fd)
            return False
        if claim is not None and claim.get("status") == "done" and claim.get("job") == self.job:
            os.close(fd)
            return False
        if claim is not None and claim.get("status") == "claimed":
            logger.warning("taking over %s from rank %s (pid %s on %s), whose lock is gone", name, claim.get("rank"),
                           claim.get("pid"), claim.get("host"))
        self._write(fd, name, "claimed")
        return True

    def _write(self, fd: int, name: str, status: str, **extra: Any) -> None:
        data = json.dumps({"status": status, "job": self.job, "rank": self.rank, "pid": os.getpid(),
                           "host": socket.gethostname(), "image": name, **extra}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        self._held[name] = fd

    def done(self, item: BatchItem) -> None:
        """Mark ``item`` finished (written or failed) by this job and let its claim go."""
        fd = self._held.pop(item.name, None)
        if fd is not None:
            self._write(fd, item.name, "done", ok=item.ok)
            self._held.pop(item.name, None)
            os.close(fd)

    def release(self) -> None:
        """Let every claim still held go (the run stopped): the images are left to be taken over."""
        for fd in self._held.values():
            os.close(fd)
        self._held.clear()


def read_claim(work: WorkDir, name: str) -> dict[str, Any] | None:
    """The claim of image ``name`` in ``work`` (None when there is none or it cannot be read)."""
    try:
        return json.loads((work.folder(name) / CLAIM).read_text())
    except (OSError, ValueError):
        return None


# -- the job -------------------------------------------------------------------------------------------
class DataJob:
    """One data group's part of the job (held by its leader): which images it runs, and the end of the job.
    ``rank`` is the group's index, ``groups`` their number K."""

    def __init__(self, settings: ParallelSettings, topology: Topology, store: Any, job: str):
        self.settings, self.topology, self.store, self.job = settings, topology, store, job
        self._owns_group = True  # join() says whether this job made the process group (or the groups' runtime did)
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._beating, name="pixal3d-data-heartbeat", daemon=True)
        self._beat.start()

    def _beating(self) -> None:
        """This rank's heartbeat in the store, so that waiting for a slow rank is not mistaken for a dead one."""
        every = min(2.0, self.settings.timeout_s / 4)
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # the store's host has gone: the waits say so
                self.store.add(f"beat/{self.rank}", 1)
            self._stop.wait(every)

    def _wait(self, keys: Sequence[str], ranks: Sequence[int]) -> list[int]:
        """Wait until every key of ``keys`` is set; returns the ``ranks`` (one per key) that stopped beating for
        the job's timeout before setting theirs (empty when all are set)."""
        seen = {r: (-1, time.monotonic()) for r in ranks}
        while True:
            pending = [(k, r) for k, r in zip(keys, ranks, strict=True) if not self.store.check([k])]
            if not pending:
                return []
            now, dead = time.monotonic(), []
            for _, r in pending:
                beat = self.store.add(f"beat/{r}", 0)
                last, since = seen[r]
                if beat != last:
                    seen[r] = (beat, now)
                elif now - since > self.settings.timeout_s:
                    dead.append(r)
            if dead:
                return dead
            time.sleep(0.2)

    @classmethod
    def join(cls, settings: ParallelSettings) -> DataJob:
        """Join the job torchrun started (``env://``, gloo: only small messages travel; already joined when the
        groups are CFG / PipeFusion jobs) and agree on its id. Called by each group's leader."""
        topology = Topology.from_env(settings)
        if topology.rank != 0:
            raise RuntimeError(f"{topology.name} follows its group's rank 0; only a group's leader joins the data job")
        timeout = timedelta(seconds=settings.timeout_s)
        joined = not dist.is_initialized()
        if joined:
            dist.init_process_group("gloo", init_method="env://", rank=topology.global_rank,
                                    world_size=topology.world_size * topology.data_groups, timeout=timeout)
        store = dist.PrefixStore("pixal3d/data/", c10d._get_default_store())
        if topology.data_group == 0:
            store.set("job", uuid.uuid4().hex)
        store.wait(["job"], timeout)
        job = cls(settings, topology, store, store.get("job").decode())
        job._owns_group = joined  # the groups' runtime tears its process groups down itself
        return job

    @property
    def rank(self) -> int:
        """This data group's index (its leader's rank in the job's messages)."""
        return self.topology.data_group

    @property
    def groups(self) -> int:
        return self.topology.data_groups

    @property
    def kind(self) -> str:
        """The job's name in messages."""
        return "--parallel data" if self.topology.world_size == 1 else f"--parallel {self.settings.mode} --data-groups"

    def who(self, *groups: int) -> str:
        """How messages name data groups: ``rank 1`` under --parallel data (a group is a rank), else ``data
        group 1`` (its leader, torchrun's rank 2)."""
        plural = "s" if len(groups) > 1 else ""
        if self.topology.world_size == 1:
            return f"rank{plural} {', '.join(map(str, groups))}"
        size = self.topology.world_size
        return (f"data group{plural} {', '.join(map(str, groups))} (leader{plural}: torchrun rank{plural} "
                f"{', '.join(str(g * size) for g in groups)})")

    def in_turn(self, action: Callable[[], Any]) -> Any:
        """``action()`` on rank 0 first, then on the others (each waits, at most the job's timeout, until rank 0's
        is over, however it ended): e.g. making the work directory, which two ranks must not make at once."""
        if self.rank == 0:
            try:
                return action()
            finally:
                self.store.set("turn", "1")
        with contextlib.suppress(Exception):  # rank 0 gone: its error is its own; ours follows from the action
            self.store.wait(["turn"], timedelta(seconds=self.settings.timeout_s))
        return action()

    def check_lead(self) -> None:
        """Between images: raise when rank 0 has already ended the job (it failed), instead of running on."""
        if self.rank != 0 and self.store.check(["exit"]):
            raise PeerFailedError(f"{self.who(self.rank)} stopped: rank 0 ended the {self.kind} job with exit code "
                                  f"{int(self.store.get('exit'))}")

    def feed(self, items: Sequence[BatchItem], executor: Executor, order: str, work: WorkDir | None
             ) -> Iterator[BatchItem]:
        """This group's images through ``executor`` in ``order``: claimed as the run goes in a work directory
        (stage order claims ``ceil(n / K)`` images at a time and runs them stage by stage), else i mod K."""
        items = list(items)
        self.check_lead()
        if work is None:
            mine = [item for i, item in enumerate(items) if i % self.groups == self.rank]
            yield from executor.drive(mine, order)
            return
        claims = Claims(work, self.job, self.rank)
        try:
            if order == "stage":
                size = max(1, math.ceil(len(items) / self.groups))
                claimed = self._claimed(items, claims)
                while chunk := list(itertools.islice(claimed, size)):
                    for item in executor.drive(chunk, order):
                        yield item
                        claims.done(item)
            else:
                for item in executor.drive(self._claimed(items, claims), order):
                    yield item
                    claims.done(item)
        finally:
            claims.release()

    def _claimed(self, items: Sequence[BatchItem], claims: Claims) -> Iterator[BatchItem]:
        """The images this group claims, in order; then a second pass takes over those of groups that died."""
        taken: set[int] = set()
        for _ in range(2):
            for item in items:
                self.check_lead()
                if item.index not in taken and claims.take(item.name):
                    taken.add(item.index)
                    yield item

    # -- the end -------------------------------------------------------------------------------------
    def gather(self, rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]] | None:
        """Every group's rows, in rank order, on rank 0 (None elsewhere). Raises ``GroupStoppedError`` on rank 0
        naming the groups that sent nothing within the job's timeout (with the rows of those that did)."""
        self.store.set(f"rows/{self.rank}", json.dumps(rows))
        if self.rank != 0:
            return None
        keys = [f"rows/{r}" for r in range(self.groups)]
        missing = self._wait(keys, range(self.groups))
        got = {r: json.loads(self.store.get(k)) for r, k in enumerate(keys) if self.store.check([k])}
        missing = [r for r in range(self.groups) if r not in got]
        if missing:
            err = GroupStoppedError(
                f"{self.who(*missing)} of the {self.kind} job sent "
                f"no report and no heartbeat for {self.settings.timeout_s:.0f} s (it stopped); the images "
                f"{'they' if len(missing) > 1 else 'it'} claimed are left resumable: run the same command again")
            err.rows = [got[r] for r in sorted(got)]
            raise err
        return [got[r] for r in range(self.groups)]

    def post_exit(self, code: int, readers: int) -> None:
        """Rank 0: the job's exit code, for every rank; waits (at most the job's timeout) until the ``readers``
        other ranks that reported have read it, since this rank's exit takes the job's store with it."""
        self.store.set("exit", str(code))
        deadline = time.monotonic() + self.settings.timeout_s
        while readers and self.store.add("read", 0) < readers and time.monotonic() < deadline:
            time.sleep(0.05)

    def wait_exit(self) -> int:
        """Ranks != 0: rank 0's exit code (1 when rank 0 says nothing within the timeout, naming it)."""
        try:
            stopped = self._wait(["exit"], [0])
        except Exception:  # noqa: BLE001 -- a vanished store: rank 0, its host, is gone
            stopped = [0]
        if stopped:
            logger.error("%s: rank 0 stopped before writing the batch summary (no sign of it for %.0f s)",
                         self.who(self.rank), self.settings.timeout_s)
            return 1
        code = int(self.store.get("exit"))
        self.store.add("read", 1)
        return code

    def close(self) -> None:
        self._stop.set()
        self._beat.join()
        with contextlib.suppress(Exception):
            if self._owns_group and dist.is_initialized():
                dist.destroy_process_group()
