"""What the user asks for: the parallel mode and the PipeFusion knobs, validated in one place.

Vocabulary (written once): *cfg degree* G is 1 or 2 (the positive and the negative CFG pass on two
device groups); *pp degree* N is the number of pipeline ranks a flow transformer's blocks are split
over; *patches* M is the number of contiguous token ranges a step streams through the pipeline;
*warmup* W is the number of leading steps that run synchronously over the whole sequence (exact).
World size = K × G × N, where *data groups* K each run their own images of a batch
(``pipelines/data_parallel.py``): one rank per group under ``mode="data"``, G × N ranks per group (each a
CFG / PipeFusion job of its own) with ``data_groups`` under cfg, pipefusion or both. *pp split*: how many blocks each pipeline rank holds (``split.py``).

Every check raises ``ParallelConfigError`` naming the value, the rule and what to do; every rank runs
the same checks on the same values, so every rank raises the same error (the CLI prints it once, on
rank 0, and every rank exits non-zero).
"""
from __future__ import annotations

from dataclasses import dataclass

MODES = ("none", "cfg", "pipefusion", "both", "data")


class ParallelConfigError(ValueError):
    """The parallel settings do not fit the job (world size, patches, warmup, blocks)."""


def near_equal_ranges(length: int, parts: int) -> list[range]:
    """``parts`` contiguous ranges covering ``range(length)``, sizes differing by at most one (the first
    ``length % parts`` one longer): blocks over pipeline ranks, tokens over patches. Needs
    ``1 <= parts <= length`` (callers say so in their own words)."""
    base, extra = divmod(length, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (i < extra)
        out.append(range(start, stop))
        start = stop
    return out


@dataclass(frozen=True, kw_only=True)
class ParallelSettings:
    """``mode``: none | cfg (exact, 2 ranks) | pipefusion (N ranks) | both (2 × N ranks) | data (K ranks, each
    running its own images of a batch). ``data_groups`` K: under data, the ranks; under cfg, pipefusion or both,
    how many such jobs of G × N ranks run side by side, each on its own images (K × G × N ranks).

    ``pp``: pipeline ranks N (pipefusion, both). ``patches``: M ≥ 1. ``warmup``: W ≥ 0 synchronous
    steps (W ≥ the steps of a stage makes that stage exact). ``timeout_s``: the longest any rank waits
    for another before giving up with an error naming the rank it waited for. ``pp_split``: None (near-equal),
    ``"auto"`` (blocks in proportion to each rank's usable memory) or the block counts ``(B1, ..., BN)``.
    """

    mode: str = "none"
    pp: int = 1
    patches: int = 1
    warmup: int = 1
    timeout_s: float = 600.0
    pp_split: str | tuple[int, ...] | None = None
    data_groups: int = 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ParallelConfigError(f"parallel mode {self.mode!r} is not one of {MODES}")
        if not isinstance(self.pp, int) or self.pp < 1:
            raise ParallelConfigError(f"pp {self.pp!r} must be an integer >= 1")
        if self.mode in ("none", "cfg", "data") and self.pp != 1:
            raise ParallelConfigError(f"pp={self.pp} needs mode=pipefusion or both (mode is {self.mode!r})")
        if self.mode in ("pipefusion", "both") and self.pp < 2:
            raise ParallelConfigError(f"mode={self.mode} needs pp >= 2 (got {self.pp}); "
                                      f"use mode={'none' if self.mode == 'pipefusion' else 'cfg'} for one "
                                      f"pipeline rank")
        if not isinstance(self.patches, int) or self.patches < 1:
            raise ParallelConfigError(f"patches M = {self.patches!r} must be an integer >= 1")
        if self.mode in ("none", "cfg", "data") and self.patches != 1:
            raise ParallelConfigError(f"patches M = {self.patches} needs mode=pipefusion or both "
                                      f"(mode is {self.mode!r}, which runs every step over the whole sequence)")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ParallelConfigError(f"warmup W = {self.warmup!r} must be an integer >= 0")
        if self.pp_split is not None:
            if self.mode not in ("pipefusion", "both"):
                raise ParallelConfigError(f"pp_split needs mode=pipefusion or both (mode is {self.mode!r})")
            if self.pp_split != "auto":
                if isinstance(self.pp_split, str) or not all(isinstance(b, int) and b >= 1 for b in self.pp_split):
                    raise ParallelConfigError(f"pp_split {self.pp_split!r} must be 'auto' or block counts >= 1, "
                                              f"one per pipeline rank (e.g. 1,3)")
                object.__setattr__(self, "pp_split", tuple(self.pp_split))
                if len(self.pp_split) != self.pp:
                    raise ParallelConfigError(f"pp_split {','.join(map(str, self.pp_split))} names "
                                              f"{len(self.pp_split)} pipeline ranks but pp is {self.pp}; give one "
                                              f"block count per rank")
        if not isinstance(self.data_groups, int) or self.data_groups < 1:
            raise ParallelConfigError(f"data_groups K = {self.data_groups!r} must be an integer >= 1")
        if self.data_groups > 1 and self.mode == "none":
            raise ParallelConfigError(f"data_groups K = {self.data_groups} needs a parallel mode: data (one rank per "
                                      f"group), or cfg, pipefusion or both (groups of several ranks)")
        if not self.timeout_s > 0:
            raise ParallelConfigError(f"timeout_s {self.timeout_s!r} must be > 0")

    @property
    def cfg_degree(self) -> int:
        """G: 2 when the positive and negative CFG passes run on separate rank groups."""
        return 2 if self.mode in ("cfg", "both") else 1

    @property
    def pp_degree(self) -> int:
        """N: the pipeline ranks of one CFG group."""
        return self.pp if self.mode in ("pipefusion", "both") else 1

    @property
    def group_size(self) -> int:
        """The ranks of one data group: G × N (1 under mode=data)."""
        return self.cfg_degree * self.pp_degree

    @property
    def world_size(self) -> int:
        return self.data_groups * self.group_size

    def check_world_size(self, world_size: int) -> None:
        """The launcher started exactly K × G × N processes."""
        if world_size != self.world_size:
            raise ParallelConfigError(
                f"mode={self.mode}" + (f" pp={self.pp}" if self.pp_degree > 1 else "")
                + f" needs {self.world_size} processes ("
                + (f"{self.data_groups} data groups × " if self.data_groups > 1 else "")
                + f"cfg {self.cfg_degree} × pp {self.pp_degree}) but "
                f"WORLD_SIZE is {world_size}; start it with torchrun --nproc-per-node {self.world_size} "
                f"(one machine) or adjust pp=")

    def check_stage(self, *, steps: int, num_blocks: int, tokens: int | None = None) -> None:
        """The settings fit one flow stage: W ≤ steps, N ≤ blocks, M ≤ tokens."""
        if self.warmup > steps:
            raise ParallelConfigError(f"warmup W = {self.warmup} is more than the stage's {steps} sampler steps; "
                                      f"use W <= {steps} (W = {steps} runs every step synchronously, exact)")
        if self.pp_degree > num_blocks:
            raise ParallelConfigError(f"pp N = {self.pp_degree} is more than the model's {num_blocks} blocks; "
                                      f"every pipeline rank needs at least one block: use pp <= {num_blocks}")
        if tokens is not None and self.patches > tokens:
            raise ParallelConfigError(f"patches M = {self.patches} is more than the {tokens} tokens of this "
                                      f"latent; use M <= {tokens}")
