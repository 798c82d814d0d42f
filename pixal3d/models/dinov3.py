"""DINOv3 backbone features as Pixal3D reads them: tokens after the last block, non-affine layer norm.

``extract_tokens`` runs ``embeddings`` → every layer with the RoPE position embeddings → ``F.layer_norm``
without affine parameters (eps 1e-5), not the model's own affine final norm. Tokens are laid out
``[CLS, registers..., patches row-major]``: 1029 tokens of width 1024 at 512 px for ViT-L/16.

Real weights: ``camenduru/dinov3-vitl16-pretrain-lvd1689m`` (an ungated copy of Meta's) loaded with
``transformers`` from a local folder or the Hub cache. Tests and the offline demo use a tiny config with
deterministic random weights (``tiny_dinov3_config`` / ``write_tiny_dinov3``).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

if TYPE_CHECKING:  # transformers' modeling code costs seconds to import: only where a backbone is built
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    from pixal3d.staging import WeightStream

DINOV3_REPO = "camenduru/dinov3-vitl16-pretrain-lvd1689m"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
STREAM_LISTS = ("model.layer",)
"""What the ``stream`` policy streams of transformers' ``DINOv3ViTModel``: its 24 layers (``model.layer.N``)."""
STREAM_UNIT = r"(?:model\.)?layer\.\d+\."
"""One layer's names in a checkpoint's header: ``model.layer.N.`` as transformers 5 saves it, ``layer.N.`` as
the released file (saved before transformers 5, which renames it on load) may name it."""


def tiny_dinov3_config(**overrides) -> DINOv3ViTConfig:
    """A DINOv3 ViT small enough for CPU tests: width 32, 2 layers, 2 heads, patch 16, 4 registers."""
    args = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "patch_size": 16, "num_register_tokens": 4, "image_size": 512, "layerscale_value": 1.0}
    args.update(overrides)
    from transformers import DINOv3ViTConfig

    return DINOv3ViTConfig(**args)


def _random_dinov3(config: DINOv3ViTConfig, seed: int) -> DINOv3ViTModel:
    """Deterministic random init that leaves the caller's RNG state untouched."""
    from transformers import DINOv3ViTModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DINOv3ViTModel(config)


def write_tiny_dinov3(folder: str | Path, *, seed: int = 0, config: DINOv3ViTConfig | None = None) -> Path:
    """Write a deterministic tiny DINOv3 model folder (``config.json`` + safetensors) for tests and the demo."""
    folder = Path(folder)
    _random_dinov3(config or tiny_dinov3_config(), seed).save_pretrained(folder)
    return folder


def load_dinov3(source: str | Path | DINOv3ViTConfig, device: torch.device | str = "cpu", *,
                dtype: torch.dtype = torch.float32, revision: str | None = None, seed: int = 0) -> DINOv3ViTModel:
    """The backbone in eval mode: from a model folder / Hub repo id, or random-initialised from a config."""
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    if isinstance(source, DINOv3ViTConfig):
        model = _random_dinov3(source, seed)
    else:
        model = DINOv3ViTModel.from_pretrained(str(source), revision=revision, dtype=dtype)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_dinov3_streamed(folder: str | Path, stream: WeightStream, *, pin: bool = False) -> DINOv3ViTModel:
    """The backbone of a model folder for the ``stream`` policy: its layers (``STREAM_LISTS``) stay on ``meta`` and
    stream to ``stream``'s device one at a time as ``extract_tokens`` (or the model's own forward) reaches them,
    the rest loaded whole (``pixal3d.models.loading.stream_safetensors``). transformers' model as
    ``from_pretrained`` builds it (its config, the attention implementation it picks), float32, the file's names
    renamed as transformers 5 renames them (``layer.N`` -> ``model.layer.N``): the same bits as ``load_dinov3``."""
    from transformers import DINOv3ViTConfig, DINOv3ViTModel
    from transformers.models.dinov3_vit.modeling_dinov3_vit import (
        DINOv3ViTRopePositionEmbedding,
    )

    from pixal3d.models.loading import stream_safetensors

    folder = Path(folder)
    config = DINOv3ViTConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        model = DINOv3ViTModel(config)
    with torch.device(stream.device):  # its one buffer (RoPE's inverse frequencies) is derived, not stored
        model.rope_embeddings = DINOv3ViTRopePositionEmbedding(config)
    return stream_safetensors(model, folder / "model.safetensors", STREAM_LISTS, stream, pin=pin,
                              module_key=_module_key)


def _module_key(name: str) -> str:
    return re.sub(r"^layer\.", "model.layer.", name)


def prepare_image(image: Image.Image, size: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Resize to ``size``² (LANCZOS) → ``(normalised [1,3,S,S], raw [1,3,S,S] in [0,1])`` float32 on ``device``."""
    rgb = image.resize((size, size), Image.LANCZOS).convert("RGB")
    raw = torch.from_numpy(np.asarray(rgb, dtype=np.float32) / 255.0).permute(2, 0, 1)[None].to(device)
    mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float32, device=device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=torch.float32, device=device).view(1, 3, 1, 1)
    return (raw - mean) / std, raw


def num_global_tokens(model: DINOv3ViTModel) -> int:
    """CLS + register tokens (5 for the released ViT-L/16)."""
    return 1 + model.config.num_register_tokens


def extract_tokens(model: DINOv3ViTModel, pixel_values: torch.Tensor) -> torch.Tensor:
    """Tokens ``[B, 1 + registers + (S/p)², hidden]`` f32: last block's output, non-affine layer norm (eps 1e-5)."""
    pixel_values = pixel_values.to(model.embeddings.patch_embeddings.weight.dtype)
    hidden = model.embeddings(pixel_values)
    position = model.rope_embeddings(pixel_values)
    layers = model.model.layer if hasattr(model, "model") else model.layer  # transformers 5 vs 4 layout
    for layer in layers:
        hidden = layer(hidden, position_embeddings=position)
    return F.layer_norm(hidden, hidden.shape[-1:], eps=1e-5).float()
