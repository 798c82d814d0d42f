"""Loaders: one zero-argument callable per registry model name, built from resolved weight paths.

Each loader builds its network on ``meta`` and fills it straight from the file onto the run's
device (``pixal3d.models.loading``), so a load never initialises random weights and never makes a
CPU copy on the way to the device.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from pixal3d.models.loading import (
    load_model,  # the package import registers every network class
)
from pixal3d.nn.attention import check_route, set_attention_route
from pixal3d.pipeline_json import ResolvedWeights


def load_naf_weights(path: Path, device: torch.device) -> nn.Module:
    """NAF from the release ``.pth`` (published defaults) or from a ``<stem>.json`` + safetensors pair."""
    from pixal3d.models.naf import load_naf

    if path.with_suffix(".json").is_file() and path.suffix == ".safetensors":
        return load_model(path.with_suffix(""), device=device)
    return load_naf(path, device=device)


def model_loaders(weights: ResolvedWeights, device: torch.device, *, moge: bool = False,
                  remover: Callable[[], nn.Module] | None = None) -> dict[str, Callable[[], nn.Module]]:
    """Every loader a cascade can use: the seven checkpoints, DINOv3, NAF, optionally MoGe-2 and rembg."""
    from pixal3d.models.dinov3 import load_dinov3

    loaders = {name: functools.partial(load_model, stem, device=device) for name, stem in weights.checkpoints.items()}
    if weights.dinov3 is not None:
        loaders["dinov3"] = functools.partial(load_dinov3, weights.dinov3, device)
    if weights.naf is not None:
        loaders["naf"] = functools.partial(load_naf_weights, weights.naf, device)
    if moge and weights.moge is not None:
        from pixal3d.models.moge import MOGE_FILE, load_moge

        loaders["moge"] = functools.partial(load_moge, weights.moge / MOGE_FILE, device)
    if remover is not None:
        loaders["rembg"] = remover
    return loaders


def with_attention_route(loaders: dict[str, Callable[[], nn.Module]], route: str
                         ) -> dict[str, Callable[[], nn.Module]]:
    """``loaders`` whose models run their attention layers on ``route`` (``pixal3d.nn.attention``; the
    config's ``runtime.attention``). ``auto`` changes nothing: each layer picks by device."""
    if check_route(route) == "auto":
        return loaders
    return {name: functools.partial(_routed, load, route) for name, load in loaders.items()}


def _routed(load: Callable[[], nn.Module], route: str) -> nn.Module:
    model = load()
    return set_attention_route(model, route) if isinstance(model, nn.Module) else model  # rembg is no module
