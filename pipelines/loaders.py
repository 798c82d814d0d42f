"""Loaders: one zero-argument callable per registry model name, built from resolved weight paths.

Each loader builds its network on ``meta`` and fills it straight from the file onto the run's
device (``pixal3d.models.loading``), so a load never initialises random weights and never makes a
CPU copy on the way to the device. Under the ``stream`` policy the flow transformers, the decoders, DINOv3 and
MoGe-2 load their small parts only and stream their blocks (``load_streamed``, ``ModelSource.load_streamed``;
``STREAM_UNITS`` says which, for the plan).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn

from pixal3d.models import dinov3
from pixal3d.models.flow_transformer import FlowTransformer
from pixal3d.models.loading import (
    in_process_memory,
    load_model,  # the package import registers every network class
    load_streamed,
)
from pixal3d.models.moge import MoGe2
from pixal3d.models.sparse_unet_vae import SparseUnetVaeDecoder
from pixal3d.nn.attention import check_route, set_attention_route
from pixal3d.pipeline_json import ResolvedWeights
from pixal3d.staging import WeightStream
from pixal3d.weight_sources import BY_NAME, MODEL_SOURCES, load_naf_weights  # noqa: F401 -- re-exported

from .preprocess import rembg_loader

STREAM_UNITS: dict[str, str] = {
    "sparse_structure_flow_model": FlowTransformer.stream_unit,
    "shape_slat_flow_model_512": FlowTransformer.stream_unit,
    "shape_slat_flow_model_1024": FlowTransformer.stream_unit,
    "tex_slat_flow_model_1024": FlowTransformer.stream_unit,
    "shape_slat_decoder": SparseUnetVaeDecoder.stream_unit,
    "tex_slat_decoder": SparseUnetVaeDecoder.stream_unit,
    "dinov3": dinov3.STREAM_UNIT,
    "moge": MoGe2.stream_unit,
}
"""The models the ``stream`` policy streams, and the header names of one block (a regular expression): the flows'
30 blocks, the decoders' blocks stage by stage, DINOv3's 24 layers, MoGe-2's 24 ViT blocks. The sparse-structure
decoder (0.15 GB) and NAF (0.2 GB) load whole."""


def model_loaders(weights: ResolvedWeights, device: torch.device, *, moge: bool = False,
                  remover: Callable[[], nn.Module] | None = None, stream: WeightStream | None = None,
                  streamed: Collection[str] = (), pin: bool = False,
                  copied: bool = False) -> dict[str, Callable[[], nn.Module]]:
    """Every loader a cascade can use: the seven checkpoints, DINOv3, NAF, optionally MoGe-2 and rembg. The models
    in ``streamed`` stream their blocks through ``stream`` (from pinned host copies with ``pin``); ``copied`` (the
    CPU only: ``runtime.cpu_weights``) copies every other model into process memory once loaded."""
    loaders = {name: functools.partial(load_model, stem, device=device) for name, stem in weights.checkpoints.items()}
    for row in MODEL_SOURCES:  # DINOv3, NAF, MoGe-2 (asked for with ``moge``), the shape encoder (when located)
        path = weights.path(row.name)
        if path is not None and (moge or row.name != "moge"):
            loaders[row.name] = functools.partial(row.load, path, device)
    for name in streamed:
        row = BY_NAME.get(name)
        if stream is not None and name in weights.checkpoints:
            loaders[name] = functools.partial(load_streamed, weights.checkpoints[name], stream, pin=pin)
        elif stream is not None and name in loaders and row is not None and row.load_streamed is not None:
            loaders[name] = functools.partial(row.load_streamed, weights.path(name), stream, pin)
        else:
            raise ValueError(f"{name} cannot stream: it needs a WeightStream and blocks it can stream")
    if copied and device.type == "cpu":
        loaders = {name: (load if name in streamed else functools.partial(_copied, load))
                   for name, load in loaders.items()}
    if remover is not None:
        loaders["rembg"] = remover
    return loaders


def planned_loaders(plan: Any, weights: ResolvedWeights, stream: WeightStream | None
                    ) -> dict[str, Callable[[], nn.Module]]:
    """``model_loaders`` as a ``RunPlan`` asks for them: MoGe-2 when a stage needs it, the config's background
    remover, the plan's streamed models through ``stream`` (pinned where it says), copies in process memory where
    ``runtime.cpu_weights`` says."""
    config = plan.config
    remover = rembg_loader(config.weights.rembg) if config.weights.rembg is not None else None
    return model_loaders(weights, plan.device, moge="moge" in plan.model_names(), remover=remover, stream=stream,
                         streamed=tuple(plan.memory.streamed), pin=plan.stream_pinned,
                         copied=config.runtime.cpu_weights == "copied")


def _copied(load: Callable[[], nn.Module]) -> nn.Module:
    return in_process_memory(load())


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
