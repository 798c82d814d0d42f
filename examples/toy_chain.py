"""A three-model chain that is not Pixal3D (encoder → denoiser → decoder) run through ``pixal3d.staging``.

    python examples/toy_chain.py

Each stage declares the model it needs, the state fields it reads and writes, and its working set; the
executor runs them in order, the runner loads a model when its stage first asks for it and, under the ``staged`` policy, releases it when
the run moves on. Both policies give the same fingerprints; staged holds one model at a time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pixal3d.staging import Event, Executor, Stage, StageRunner

WIDTH = 512  # one Linear(512, 512) in fp32 is 1 MiB


@dataclass
class ChainState:
    generator: torch.Generator               # the run's own noise source
    image: torch.Tensor                      # [1, WIDTH]
    features: torch.Tensor | None = None     # [1, WIDTH]
    latent: torch.Tensor | None = None       # [1, WIDTH]
    output: torch.Tensor | None = None       # [1, WIDTH]


def toy_model(depth: int, seed: int) -> nn.Module:
    """``depth`` linear layers with weights fixed by ``seed`` (the registry restores the global RNG after)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(depth)]).eval()


LOADERS = {"encoder": lambda: toy_model(2, 1), "denoiser": lambda: toy_model(6, 2), "decoder": lambda: toy_model(3, 3)}


class Encode(Stage):
    name, needs, inputs, outputs = "encode", ("encoder",), ("image",), ("features",)

    def working_set(self) -> int:
        return 2 * WIDTH * 4

    def run(self, state: ChainState, models) -> None:
        state.features = models["encoder"](state.image)


class Denoise(Stage):
    name, needs, inputs, outputs = "denoise", ("denoiser",), ("features", "generator"), ("latent",)
    draws = "generator"  # its noise: a run resumed after this stage must restore the generator too

    def working_set(self) -> int:
        return 3 * WIDTH * 4

    def run(self, state: ChainState, models) -> None:
        x = torch.randn(1, WIDTH, generator=state.generator)
        for _ in range(4):  # a few "denoising" steps conditioned on the features
            x = x - 0.1 * torch.tanh(models["denoiser"](x + state.features))
        state.latent = x


class Decode(Stage):
    name, needs, inputs, outputs = "decode", ("decoder",), ("latent",), ("output",)

    def working_set(self) -> int:
        return 2 * WIDTH * 4

    def run(self, state: ChainState, models) -> None:
        state.output = models["decoder"](state.latent)


class HeldBytes:
    """An event sink that follows the bytes of loaded models and keeps the most held at once."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def __call__(self, event: Event) -> None:
        self.now += event.bytes if event.kind in ("load", "reload") else -event.bytes if event.kind == "release" else 0
        self.peak = max(self.peak, self.now)


def run_chain(policy: str, seed: int = 0) -> tuple[dict[str, str], int]:
    """Fingerprints of every stage's outputs and the peak bytes of models held, under ``policy``."""
    held = HeldBytes()
    state = ChainState(generator=torch.Generator().manual_seed(seed), image=torch.ones(1, WIDTH))
    with StageRunner([Encode(), Denoise(), Decode()], LOADERS, provides=("generator", "image"),
                     state_type=ChainState, policy=policy, events=held) as runner:
        records = Executor(runner).run(state)
    return {k: v for r in records for k, v in r.fingerprints.items()}, held.peak


if __name__ == "__main__":
    eager, eager_peak = run_chain("eager")
    staged, staged_peak = run_chain("staged")
    print(f"fingerprints equal: {eager == staged}")
    print(f"model bytes held at once: eager {eager_peak / 2**20:.1f} MiB, staged {staged_peak / 2**20:.1f} MiB "
          f"(largest model {6 * (WIDTH * WIDTH + WIDTH) * 4 / 2**20:.1f} MiB)")
