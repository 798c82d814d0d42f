"""A four-model stand-in pipeline for staging tests, shaped like a real cascade.

Every stage draws noise from the global CPU generator (seeded once, at the start of ``run``)
before it asks for its models, and builds use PyTorch's random initialisation (which draws from
that same generator) before loading fixed weights, as a model built on the CPU would. So a model
built mid-run shifts every later draw unless the build is wrapped in ``preserved_rng()``.
Reuse: ``make_loaders()``, ``STAGES``, ``run(models, enter=registry.enter)``, ``fingerprint``.
"""
from __future__ import annotations

import hashlib
import zlib
from collections import Counter
from collections.abc import Callable, Mapping

import torch
from torch import nn

WIDTH = 32


class Encoder(nn.Module):
    """Image stand-in → features; holds a persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, WIDTH)
        self.register_buffer("scale", torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale


class Denoiser(nn.Module):
    """Two blocks with tied weights (one storage behind two linears)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(WIDTH, WIDTH)
        self.outer = nn.Linear(WIDTH, WIDTH)
        self.outer.weight = self.inner.weight

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.tanh(self.inner(x) + cond))

    def velocity_scale(self) -> float:
        """A public method other than forward (release must guard it too)."""
        return float(self.inner.weight.abs().mean())


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(WIDTH, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x)


class Refiner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.net(x)


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "encoder": Encoder,
    "denoiser": Denoiser,
    "decoder": Decoder,
    "refiner": Refiner,
}

STAGES: dict[str, tuple[str, ...]] = {
    "encode": ("encoder",),
    "denoise": ("encoder", "denoiser"),
    "decode": ("decoder",),
    "refine": ("decoder", "refiner"),
}


def build(name: str) -> nn.Module:
    """Construct with random init (draws the global CPU generator), then load fixed weights."""
    module = BUILDERS[name]()
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    weights = {k: torch.randn(v.shape, generator=gen) * 0.3 for k, v in module.state_dict().items()}
    module.load_state_dict(weights)
    return module.eval().requires_grad_(False)


def make_loaders(counter: Counter | None = None) -> dict[str, Callable[[], nn.Module]]:
    """One zero-argument loader per model; ``counter[name]`` counts builds when given."""

    def loader(name: str) -> Callable[[], nn.Module]:
        def load() -> nn.Module:
            if counter is not None:
                counter[name] += 1
            return build(name)

        return load

    return {name: loader(name) for name in BUILDERS}


def fingerprint(tensor: torch.Tensor) -> str:
    """sha256 of dtype, shape and bytes."""
    h = hashlib.sha256(f"{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    h.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def run(
    models: Mapping[str, nn.Module], *, enter: Callable[[str], None] = lambda stage: None, seed: int = 0
) -> dict[str, str]:
    """Run the four stages; return stage → fingerprint of its output."""
    torch.manual_seed(seed)
    prints = {}
    with torch.no_grad():
        enter("encode")
        image = torch.randn(2, 16)
        feats = models["encoder"](image)
        prints["encode"] = fingerprint(feats)

        enter("denoise")
        x = torch.randn(2, WIDTH)
        for _ in range(3):
            x = x - 0.1 * models["denoiser"](x, models["encoder"](image))
        prints["denoise"] = fingerprint(x)

        enter("decode")
        noise = torch.randn(2, 8) * 0.01
        y = models["decoder"](x) + noise
        prints["decode"] = fingerprint(y)

        enter("refine")
        noise = torch.randn(2, 8) * 0.01
        z = models["refiner"](models["decoder"](x) + y + noise)
        prints["refine"] = fingerprint(z)
    return prints
