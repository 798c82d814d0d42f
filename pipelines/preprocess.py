"""Preprocess stage: remove the background when the input has no alpha, crop, composite on black
(reference §1.1). An RGBA input with a real alpha channel needs no model."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from PIL import Image
from torch import nn

from pixal3d.config import CascadeConfig
from pixal3d.hub import MissingWeightsError
from pixal3d.models.preprocess import (
    as_image,
    load_background_remover,
    preprocess_image,
    require_alpha,
)
from pixal3d.staging import preserved_rng

from .stage import CascadeStage
from .state import RunState


class PreprocessStage(CascadeStage):
    """``state.image``: the object, cropped and composited on black (RGB)."""

    name = "preprocess"
    section = "weights"  # weights.rembg: the background remover, if any
    inputs = ("input_image",)
    outputs = ("image",)
    caches = ("input_image",)  # the decoded input is dropped after this stage (it can be decoded again)

    def __init__(self, *, remover: str | None):
        self.remover = remover
        self.needs = ("rembg",) if remover is not None else ()

    @classmethod
    def from_config(cls, config: CascadeConfig) -> PreprocessStage:
        return cls(remover=config.weights.rembg)

    def working_set(self) -> int:
        return 0  # a few copies of one image, next to nothing beside the models

    def check_input(self, image: Any) -> None:
        """Without a remover the image must carry the object's mask as alpha: say so before any weight is read."""
        if self.remover is None:
            require_alpha(image if isinstance(image, (str, Path, Image.Image)) else as_image(image))

    def run(self, state: RunState, models: Mapping[str, nn.Module]) -> None:
        remover = _LazyRemover(models) if self.needs else None
        state.image = preprocess_image(state.input_image, remover)


class _LazyRemover:
    """Asks the registry for the background remover only if the image actually needs it."""

    def __init__(self, models: Mapping[str, nn.Module]):
        self._models = models

    def __call__(self, image):
        # The reference removes the background before seeding: the remover must not move the noise draws.
        with preserved_rng():
            return self._models["rembg"](image)


class RemoverModule(nn.Module):
    """The ``rembg`` background remover as a registry model (it holds no tensors; releasing it drops it)."""

    def __init__(self, model_name: str):
        super().__init__()
        self.remover = load_background_remover(model_name)
        try:
            _ = self.remover.session  # create the session now: a missing model fails at load time, clearly
        except Exception as err:  # noqa: BLE001 -- rembg/onnxruntime/pooch raise many types for a model they cannot get
            raise MissingWeightsError(
                f"could not load the background-removal model {model_name!r} ({type(err).__name__}: {err}); "
                f"run once with network access so rembg can download it, or pass an RGBA image whose alpha "
                f"marks the object") from None

    def forward(self, image):
        return self.remover(image)


def rembg_loader(model_name: str) -> Callable[[], nn.Module]:
    """The registry loader for the background remover."""
    return lambda: RemoverModule(model_name)
