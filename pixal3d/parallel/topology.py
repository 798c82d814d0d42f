"""Who is who: a rank's place in the G × N grid, read from torchrun's environment.

Ranks are laid out pipeline-innermost (xDiT's "pp-cfg" order): ``rank = cfg_index · N + stage``. So
with ``--parallel both --pp 2`` ranks 0, 1 run the positive pass (stages 0, 1) and ranks 2, 3 the
negative one. With K *data groups* the job is K such grids side by side, group-outermost: torchrun's rank
``R = data_group · (G · N) + rank``. ``rank`` and ``world_size`` are always *within the group* (a group is a
job of its own to everything in ``pixal3d.parallel``); ``global_rank`` is torchrun's. The *owner* is the last stage of group 0: it holds the sampler state (the latent), mixes
the CFG branches, takes the Euler step and sends the updated latent pieces back to the first stage of
each group (the ring).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .settings import ParallelConfigError, ParallelSettings

BRANCHES = ("pos", "neg")


@dataclass(frozen=True)
class Topology:
    """One rank's coordinates; pure data, the same arithmetic on every rank."""

    rank: int
    world_size: int
    local_rank: int
    cfg_degree: int
    pp_degree: int
    local_world_size: int = 1  # ranks on this machine (torchrun's LOCAL_WORLD_SIZE): they share its memory
    data_group: int = 0        # which of the job's K data groups this rank belongs to
    data_groups: int = 1       # K

    @classmethod
    def from_env(cls, settings: ParallelSettings, env: Mapping[str, str] | None = None) -> Topology:
        """Read ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (set by torchrun) and check them
        against ``settings``; torchrun's rank becomes a data group and a rank within it."""
        env = os.environ if env is None else env
        missing = [k for k in ("RANK", "WORLD_SIZE") if k not in env]
        if missing:
            raise ParallelConfigError(f"mode={settings.mode} runs under torchrun, which sets {missing}; "
                                      f"start it with torchrun --nproc-per-node {settings.world_size} ...")
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        settings.check_world_size(world)
        size = settings.group_size
        return cls(rank=rank % size, world_size=size, local_rank=int(env.get("LOCAL_RANK", rank)),
                   cfg_degree=settings.cfg_degree, pp_degree=settings.pp_degree,
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)), data_group=rank // size,
                   data_groups=settings.data_groups)

    # -- this rank ------------------------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        """torchrun's rank of this process (``rank`` itself when the job is one group)."""
        return self.data_group * self.world_size + self.rank

    def global_of(self, rank: int) -> int:
        """torchrun's rank of rank ``rank`` of this data group."""
        return self.data_group * self.world_size + rank

    @property
    def name(self) -> str:
        """How messages name this rank: ``rank 1``, or ``rank 1 of data group 2`` (torchrun's rank 3)."""
        return self.name_of(self.rank)

    def name_of(self, rank: int) -> str:
        """How messages name rank ``rank`` of this data group."""
        if self.data_groups == 1:
            return f"rank {rank}"
        return f"rank {rank} of data group {self.data_group} (torchrun rank {self.global_of(rank)})"

    @property
    def cfg_index(self) -> int:
        return self.rank // self.pp_degree

    @property
    def stage(self) -> int:
        return self.rank % self.pp_degree

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp_degree - 1

    @property
    def is_owner(self) -> bool:
        return self.rank == self.owner

    # -- the grid -------------------------------------------------------------------------------
    def rank_of(self, cfg_index: int, stage: int) -> int:
        return cfg_index * self.pp_degree + stage

    @property
    def owner(self) -> int:
        """The rank that holds the latent and takes the sampler steps: the last stage of group 0."""
        return self.rank_of(0, self.pp_degree - 1)

    def group_of(self, branch: str) -> int:
        """The CFG group that runs ``branch`` ("pos" or "neg")."""
        return 0 if self.cfg_degree == 1 else BRANCHES.index(branch)

    def links(self) -> list[tuple[str, int, int]]:
        """Every directed point-to-point link of the job, ``(kind, src, dst)``, in one order for all ranks:
        ``act`` stage k → k+1 (hidden states), ``x`` owner → first stage of a group (latent pieces),
        ``pred`` last stage of group 1 → owner (the negative branch's velocity pieces)."""
        out = [("act", self.rank_of(c, k), self.rank_of(c, k + 1))
               for c in range(self.cfg_degree) for k in range(self.pp_degree - 1)]
        out += [("x", self.owner, self.rank_of(c, 0)) for c in range(self.cfg_degree)
                if self.rank_of(c, 0) != self.owner]
        out += [("pred", self.rank_of(c, self.pp_degree - 1), self.owner) for c in range(1, self.cfg_degree)]
        return out
