"""Layer sharding: pipeline rank k of N holds a contiguous range of a flow transformer's blocks.

A shard is the model's own class (``SparseStructureFlowModel`` / ``SLatFlowModel``) built on ``meta``
with every block outside the range replaced by a parameterless ``RemoteBlock``, the input layer kept
only on the first rank and the output layer only on the last; the timestep embedder and the shared
adaLN layer (every block reads their output) stay on every rank. Parameter names are unchanged
(``blocks.17.mlp...`` stays ``blocks.17...``), so loading reads exactly the shard's tensors from the
safetensors file (``safe_open``, one tensor at a time, after checking the whole file's header against
the whole network), and a shard is an ``nn.Module`` the staging registry loads and releases like any
other model.

Ranges are near-equal by default (``divmod(num_blocks, N)``, the first ``num_blocks % N`` ranks one block
longer); ``split`` (block counts per rank, ``split.model_split``) gives uneven ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..models.flow_transformer import FlowTransformer
from ..models.loading import build_model, load_state_into, read_spec
from .settings import ParallelConfigError, near_equal_ranges
from .split import split_ranges


def block_ranges(num_blocks: int, stages: int, split: Sequence[int] | None = None) -> list[range]:
    """The contiguous block range of each of ``stages`` pipeline ranks: near-equal, or ``split[k]`` blocks on
    rank k (they must add up to ``num_blocks``, each at least one)."""
    if not 1 <= stages <= num_blocks:
        raise ParallelConfigError(f"cannot split {num_blocks} blocks over {stages} pipeline ranks; "
                                  f"use 1 <= pp <= {num_blocks}")
    if split is None:
        return near_equal_ranges(num_blocks, stages)
    if len(split) != stages or sum(split) != num_blocks or min(split) < 1:
        raise ParallelConfigError(f"the block split {tuple(split)} does not cover the model's {num_blocks} blocks "
                                  f"over {stages} pipeline ranks with at least one each")
    return split_ranges(split)


def shard_tensor_names(names: Iterable[str], stage: int, stages: int, split: Sequence[int] | None = None
                       ) -> set[str]:
    """The tensors of a whole flow checkpoint (``names``) that pipeline rank ``stage`` of ``stages`` holds:
    its blocks, the input layer on the first rank, the output layer on the last, the shared layers on every
    rank; what ``shard_model`` keeps, read from names alone (the plan sizes shards from headers)."""
    names = list(names)
    blocks = {int(n.split(".")[1]) for n in names if n.startswith("blocks.")}
    mine = block_ranges(max(blocks) + 1, stages, split)[stage] if blocks else range(0)
    keep = set()
    for name in names:
        part = name.split(".")
        if part[0] == "blocks":
            if int(part[1]) in mine:
                keep.add(name)
        elif (part[0] != "input_layer" or stage == 0) and (part[0] != "out_layer" or stage == stages - 1):
            keep.add(name)
    return keep


class RemoteBlock(nn.Module):
    """Stands in for a block another pipeline rank holds (no parameters)."""

    def __init__(self, index: int, owner: int):
        super().__init__()
        self.index, self.owner = index, owner

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError(f"block {self.index} lives on pipeline rank {self.owner}; a shard runs only its own "
                           f"blocks (pixal3d.parallel)")

    def extra_repr(self) -> str:
        return f"index={self.index}, owner={self.owner}"


@dataclass(frozen=True)
class ShardInfo:
    """Which part of the network a shard holds."""

    stage: int
    stages: int
    blocks: range
    split: tuple[int, ...] = ()  # every rank's block count (the same on every rank of the job)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1


def shard_model(model: FlowTransformer, stage: int, stages: int, split: Sequence[int] | None = None
                ) -> FlowTransformer:
    """Cut ``model`` (in place, best on ``meta``) down to pipeline rank ``stage`` of ``stages`` (``split``: the
    block count of every rank; default near-equal)."""
    ranges = block_ranges(len(model.blocks), stages, split)
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not in 0..{stages - 1}")
    for owner, blocks in enumerate(ranges):
        if owner != stage:
            for i in blocks:
                model.blocks[i] = RemoteBlock(i, owner)
    if stage > 0:
        model.input_layer = None
    if stage < stages - 1:
        model.out_layer = None
    model.shard_info = ShardInfo(stage, stages, ranges[stage], tuple(len(r) for r in ranges))
    return model


def shard_info(model: FlowTransformer) -> ShardInfo:
    """The model's ``ShardInfo`` (a whole model is the one shard of a one-rank pipeline)."""
    info = getattr(model, "shard_info", None)
    return info if info is not None else ShardInfo(0, 1, range(len(model.blocks)), (len(model.blocks),))


def owned_blocks(model: FlowTransformer) -> list[nn.Module]:
    """The blocks this shard runs, in order."""
    return [model.blocks[i] for i in shard_info(model).blocks]


def build_flow_shard(spec: Mapping[str, Any], stage: int, stages: int, *, source: str = "config",
                     split: Sequence[int] | None = None) -> FlowTransformer:
    """The shard of the network ``spec`` describes, on ``meta``."""
    model = build_model(spec, device="meta", source=source)
    if not isinstance(model, FlowTransformer):
        raise TypeError(f"{source}: {type(model).__name__} is not a flow transformer; only flows are pipelined")
    return shard_model(model, stage, stages, split)


def load_flow_shard(stem: str | Path, stage: int, stages: int, *, device: torch.device | str = "cpu",
                    split: Sequence[int] | None = None) -> FlowTransformer:
    """Load pipeline rank ``stage``'s shard of ``<stem>.json`` + ``<stem>.safetensors`` onto ``device``:
    the file is checked against the whole network, only the shard's tensors are read. ``split``: every rank's
    block count (default near-equal)."""
    stem = Path(stem)
    spec = read_spec(stem.with_suffix(".json"))
    source = str(stem.with_suffix(".json"))
    whole = build_model(spec, device="meta", source=source)
    shard = build_flow_shard(spec, stage, stages, source=source, split=split)
    return load_state_into(shard, stem.with_suffix(".safetensors"), device=device, reference=whole)


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer (works on ``meta``)."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
