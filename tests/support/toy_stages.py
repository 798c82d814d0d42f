"""A two-stage toy chain (encode, decode) over a small state, for the runner and the executor."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pixal3d.staging import (
    Stage,
)


@dataclass
class State:
    x: torch.Tensor
    feats: torch.Tensor | None = None
    scratch: torch.Tensor | None = None
    y: torch.Tensor | None = None
    gen: torch.Generator | None = None
    memo: torch.Tensor | None = None


class Encode(Stage):
    name, needs, inputs, outputs, transient = "encode", ("encoder",), ("x",), ("feats",), ("scratch",)

    def working_set(self) -> int:
        return 10

    def run(self, state, models):
        state.scratch = torch.zeros(3)
        state.feats = models["encoder"](state.x)


class Decode(Stage):
    name, needs, inputs, outputs = "decode", ("decoder",), ("feats",), ("y",)

    def working_set(self) -> int:
        return 0

    def run(self, state, models):
        state.y = models["decoder"](state.feats)
