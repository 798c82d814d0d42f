"""The job's process groups, made once per process: ``init_parallel(settings)`` under torchrun.

A *request* is one exchange every rank takes part in, in the same order on every rank: a flow stage's
``parallel_sample``, or one of the job's messages (``session.py``). Each request has its own failure
board, so the ranks agree on where a failure is reported: a rank that fails *inside* a request posts
on that request's board (``request``); a rank that fails *between* requests (rank 0 in a stage it runs
alone, a follower loading its shard) posts on the board of the next request, the one every other rank
is waiting in or will enter next (``fail``).

Backend: NCCL when the rank computes on CUDA (the device is set before ``init_process_group``, the
order xDiT #735 found ``new_group`` needs), gloo otherwise (CPU, MPS, and between machines without
CUDA). Every group gets ``settings.timeout_s`` as its timeout, so a collective never waits forever.
Groups: the default (world) group for a request's broadcasts, and one two-rank group per directed
point-to-point link of ``Topology.links`` (see ``comm.py`` for why one per direction). With K data groups
each group is a job of its own: its own group for the broadcasts, its own links, its own prefix in the store
(so its requests, failure boards and memory reports are its own: a failure stops its group, not the others).
"""
from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .. import devices
from ..devices import kind
from .comm import Wire
from .failure import FailureBoard, PeerFailedError
from .settings import ParallelConfigError, ParallelSettings
from .topology import Topology

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class ParallelRuntime:
    """One process's view of the job: settings, its place, its groups, and a request counter."""

    settings: ParallelSettings
    topology: Topology
    device: torch.device          # where this rank computes
    backend: str                  # "nccl" or "gloo"
    store: Any                    # the job's c10d store (prefix "pixal3d/parallel/", plus "group<k>/" per data group)
    groups: dict[tuple[str, int, int], Any]
    broadcasts: Any = None        # this data group's process group for broadcasts (None: the whole job)
    requests: int = 0
    last_stats: dict[str, Any] = field(default_factory=dict)
    gathers: int = 0              # memory reports gathered so far (each one a fresh set of store keys)
    _board: FailureBoard | None = field(default=None, repr=False)

    @property
    def wire_device(self) -> torch.device:
        """Where tensors must be to travel: the CUDA device for NCCL, the CPU for gloo."""
        return self.device if kind(self.device).wire_tensors else torch.device("cpu")

    def begin_request(self) -> Wire:
        """A new request: a fresh failure board (keys of earlier requests are never read again)."""
        self.requests += 1
        board = FailureBoard(self.store, self.topology.rank, self.topology.world_size, self.requests,
                             grace_s=min(10.0, self.settings.timeout_s), name=self.topology.name_of)
        self._board = board
        return Wire(self.wire_device, board, self.settings.timeout_s, base=self.topology.global_of(0),
                    group=self.broadcasts)

    def request(self, body: Callable[[Wire], T]) -> T:
        """Run ``body(wire)`` as the job's next request. If it raises, every other rank learns it: this
        rank's own error is re-raised (with a note naming the rank), an error caused by another rank's
        failure becomes ``PeerFailedError`` naming that rank."""
        wire = self.begin_request()
        try:
            return body(wire)
        except PeerFailedError:
            raise
        except BaseException as err:
            notice = wire.board.report(err)  # tells the other ranks (or learns who failed first)
            name = self.topology.name
            # A settings error is the user's to fix and every rank that sees it says the same: raise it as is.
            if isinstance(err, ParallelConfigError) or notice.startswith(f"{name} failed"):
                logger.debug("%s", notice)  # the caller reports the error itself
                err.add_note(f"(raised on {name} of the parallel job; every other rank stops too)")
                raise
            raise PeerFailedError(f"{name} stopped: {notice}") from err

    def fail(self, err: BaseException) -> str | None:
        """Tell every other rank that this rank failed with ``err`` outside a request, on the board of
        the next request (the one they wait in); returns the notice they read. Does nothing (None) when
        ``err`` is the failure of a request, already posted or read there."""
        if isinstance(err, PeerFailedError) or (self._board is not None and self._board.settled):
            return None
        return self.begin_request().board.report(err)

    def gather_memory(self, mine: int) -> tuple[int, ...]:
        """Every rank's ``mine`` (bytes of usable memory), in rank order, on every rank: each rank posts its own in
        the job's store, rank 0 collects them and posts the list, every rank reads rank 0's list. Not a request
        (no failure board): a rank that never reports ends the wait after the job's timeout, naming it."""
        self.gathers += 1
        prefix, rank, world = f"memory/{self.gathers}/", self.topology.rank, self.topology.world_size
        self.store.set(f"{prefix}{rank}", str(int(mine)))
        timeout = timedelta(seconds=self.settings.timeout_s)
        if rank == 0:
            keys = [f"{prefix}{r}" for r in range(world)]
            try:
                self.store.wait(keys, timeout)
            except Exception as err:  # c10d's timeout: say who is missing
                missing = [r for r in range(world) if not self.store.check([f"{prefix}{r}"])]
                raise TimeoutError(f"rank 0: no memory report from rank(s) {missing} after "
                                   f"{self.settings.timeout_s:.0f} s ({err})") from None
            self.store.set(f"{prefix}all", json.dumps([int(self.store.get(k)) for k in keys]))
        try:
            self.store.wait([f"{prefix}all"], timeout)
        except Exception as err:
            raise TimeoutError(f"rank {rank}: rank 0 did not share the ranks' memory reports within "
                               f"{self.settings.timeout_s:.0f} s ({err})") from None
        return tuple(json.loads(self.store.get(f"{prefix}all")))

    def ended_ranks(self) -> list[tuple[int, int]]:
        """The other ranks whose process has ended, as ``(rank, pid)``: those on this machine (each rank posted its
        host and pid at ``init_parallel``) that no longer run or are zombies awaiting torchrun's agent. What rank 0
        can say when torchrun's agent stops it because another rank died (a SIGKILL, the OOM killer) without a
        word on the failure board. Ranks on other machines, or whose post cannot be read, are not judged."""
        import psutil

        ended = []
        for rank in range(self.topology.world_size):
            if rank == self.topology.rank:
                continue
            try:
                host, pid = self.store.get(f"pid/{rank}").decode().rsplit(":", 1)
            except Exception:  # noqa: BLE001  (no post, or a store that went away with the job: unknown)
                continue
            if host != socket.gethostname() or not pid.isdigit():
                continue
            try:
                gone = psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE
            except psutil.Error:  # no such process (reaped), or not ours to look at
                gone = not psutil.pid_exists(int(pid))
            if gone:
                ended.append((rank, int(pid)))
        return ended

    def group(self, kind: str, src: int, dst: int) -> Any:
        return self.groups[(kind, src, dst)]

    def close(self) -> None:
        """Tear the process groups down (end of the job)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def default_device(local_rank: int) -> torch.device:
    """``cuda:<local rank>`` when CUDA is available, else the CPU (pass ``device`` for MPS)."""
    return devices.default_device(("cuda", "cpu"), local_rank)


def init_parallel(settings: ParallelSettings, *, device: torch.device | str | None = None,
                  env: Mapping[str, str] | None = None) -> ParallelRuntime:
    """Join the job torchrun started (``env://``: ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``) and build its groups. Raises ``ParallelConfigError`` on every rank,
    before any rendezvous, when the settings do not fit the world size."""
    if settings.mode == "none":
        raise ParallelConfigError("init_parallel is for mode=cfg, pipefusion or both; mode is 'none'")
    env = os.environ if env is None else env
    topology = Topology.from_env(settings, env)
    world = topology.world_size * topology.data_groups
    device = default_device(topology.local_rank) if device is None else torch.device(device)
    backend = kind(device).backend
    if kind(device).indexed:
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=settings.timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", rank=topology.global_rank, world_size=world,
                                timeout=timeout)
    elif (dist.get_rank(), dist.get_world_size()) != (topology.global_rank, world):
        raise ParallelConfigError(f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                                  f"{dist.get_world_size()}, but the environment says {topology.global_rank} of "
                                  f"{world}")
    group, groups = None, {}
    for k in range(topology.data_groups):  # every rank makes every group, in the same order (new_group's rule)
        members = [k * topology.world_size + r for r in range(topology.world_size)]
        whole = dist.new_group(members, timeout=timeout, backend=backend) if topology.data_groups > 1 else None
        links = {link: dist.new_group([members[link[1]], members[link[2]]], timeout=timeout, backend=backend)
                 for link in topology.links()}
        if k == topology.data_group:
            group, groups = whole, links
    prefix = "pixal3d/parallel/" + (f"group{topology.data_group}/" if topology.data_groups > 1 else "")
    store = dist.PrefixStore(prefix, c10d._get_default_store())  # the store env:// made
    store.set(f"pid/{topology.rank}", f"{socket.gethostname()}:{os.getpid()}")  # for ended_ranks
    logger.info("parallel %s: %s of %d (cfg group %d, pipeline stage %d of %d) on %s over %s",
                settings.mode, topology.name, topology.world_size, topology.cfg_index, topology.stage,
                topology.pp_degree, device, backend)
    return ParallelRuntime(settings, topology, device, backend, store, groups, group)
