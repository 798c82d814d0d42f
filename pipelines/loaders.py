"""Loaders: one zero-argument callable per registry model name, built from resolved weight paths.

Each loader builds its network on ``meta`` and fills it straight from the file onto the run's
device (``pixal3d.models.loading``), so a load never initialises random weights and never makes a
CPU copy on the way to the device.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from pixal3d.hub import ResolvedWeights
from pixal3d.models.loading import load_model


def register_model_classes() -> None:
    """Import every network module so its class names are registered for ``build_model``."""
    from pixal3d.models import naf, slat_flow, sparse_structure_decoder, sparse_structure_flow, sparse_unet_vae  # noqa: F401


def checkpoint_loaders(weights: ResolvedWeights, device: torch.device) -> dict[str, Callable[[], nn.Module]]:
    """Loaders for the seven checkpoints ``pipeline.json`` names."""
    register_model_classes()
    return {name: functools.partial(load_model, stem, device=device) for name, stem in weights.checkpoints.items()}


def load_naf_weights(path, device: torch.device) -> nn.Module:
    """NAF from the release ``.pth`` (published defaults) or from a ``<stem>.json`` + safetensors pair."""
    from pixal3d.models.naf import load_naf

    register_model_classes()
    if path.with_suffix(".json").is_file() and path.suffix == ".safetensors":
        return load_model(path.with_suffix(""), device=device)
    return load_naf(path, device=device)


def model_loaders(weights: ResolvedWeights, device: torch.device, *, moge: bool = False,
                  remover: Callable[[], nn.Module] | None = None) -> dict[str, Callable[[], nn.Module]]:
    """Every loader a cascade can use: the seven checkpoints, DINOv3, NAF, optionally MoGe-2 and rembg."""
    from pixal3d.models.dinov3 import load_dinov3

    loaders = checkpoint_loaders(weights, device)
    loaders["dinov3"] = functools.partial(load_dinov3, weights.dinov3, device)
    loaders["naf"] = functools.partial(load_naf_weights, weights.naf, device)
    if moge and weights.moge is not None:
        from pixal3d.models.camera import load_moge

        loaders["moge"] = functools.partial(load_moge, str(weights.moge / "model.pt"), device)
    if remover is not None:
        loaders["rembg"] = remover
    return loaders
