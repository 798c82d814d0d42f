"""The job's process groups, made once per process: ``init_parallel(settings)`` under torchrun.

Backend: NCCL when the rank computes on CUDA (the device is set before ``init_process_group``, the
order xDiT #735 found ``new_group`` needs), gloo otherwise (CPU, MPS, and between machines without
CUDA). Every group gets ``settings.timeout_s`` as its timeout, so a collective never waits forever.
Groups: the default (world) group for a request's broadcasts, and one two-rank group per directed
point-to-point link of ``Topology.links`` (see ``comm.py`` for why one per direction).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .comm import Wire
from .failure import FailureBoard
from .settings import ParallelConfigError, ParallelSettings
from .topology import Topology

logger = logging.getLogger(__name__)


@dataclass
class ParallelRuntime:
    """One process's view of the job: settings, its place, its groups, and a request counter."""

    settings: ParallelSettings
    topology: Topology
    device: torch.device          # where this rank computes
    backend: str                  # "nccl" or "gloo"
    store: Any                    # the job's c10d store (under a "pixal3d/parallel/" prefix)
    groups: dict[tuple[str, int, int], Any]
    requests: int = 0
    last_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def wire_device(self) -> torch.device:
        """Where tensors must be to travel: the CUDA device for NCCL, the CPU for gloo."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def begin_request(self) -> Wire:
        """A new request: a fresh failure board (keys of earlier requests are never read again)."""
        self.requests += 1
        board = FailureBoard(self.store, self.topology.rank, self.topology.world_size, self.requests,
                             grace_s=min(10.0, self.settings.timeout_s))
        return Wire(self.wire_device, board, self.settings.timeout_s)

    def group(self, kind: str, src: int, dst: int) -> Any:
        return self.groups[(kind, src, dst)]

    def close(self) -> None:
        """Tear the process groups down (end of the job)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def default_device(local_rank: int) -> torch.device:
    """``cuda:<local rank>`` when CUDA is available, else the CPU (pass ``device`` for MPS)."""
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def init_parallel(settings: ParallelSettings, *, device: torch.device | str | None = None,
                  env: Mapping[str, str] | None = None) -> ParallelRuntime:
    """Join the job torchrun started (``env://``: ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``) and build its groups. Raises ``ParallelConfigError`` on every rank,
    before any rendezvous, when the settings do not fit the world size."""
    if settings.mode == "none":
        raise ParallelConfigError("init_parallel is for --parallel cfg, pipefusion or both; mode is 'none'")
    env = os.environ if env is None else env
    topology = Topology.from_env(settings, env)
    device = default_device(topology.local_rank) if device is None else torch.device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=settings.timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", rank=topology.rank, world_size=topology.world_size,
                                timeout=timeout)
    elif (dist.get_rank(), dist.get_world_size()) != (topology.rank, topology.world_size):
        raise ParallelConfigError(f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                                  f"{dist.get_world_size()}, but the environment says {topology.rank} of "
                                  f"{topology.world_size}")
    groups = {link: dist.new_group([link[1], link[2]], timeout=timeout, backend=backend)
              for link in topology.links()}
    store = dist.PrefixStore("pixal3d/parallel/", c10d._get_default_store())  # the store env:// made
    logger.info("parallel %s: rank %d of %d (cfg group %d, pipeline stage %d of %d) on %s over %s",
                settings.mode, topology.rank, topology.world_size, topology.cfg_index, topology.stage,
                topology.pp_degree, device, backend)
    return ParallelRuntime(settings, topology, device, backend, store, groups)
