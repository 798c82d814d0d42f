"""Tiny demo weights: every model of the cascade at toy size, generated deterministically.

The layout mirrors the published sources, so the tiny config goes through exactly the same loading
code as the real one::

    <root>/pixal3d/pipeline.json, ckpts/<stem>.{json,safetensors}   (seven checkpoints)
    <root>/dinov3/config.json, model.safetensors                      (transformers DINOv3ViTModel)
    <root>/naf/naf.json, naf.safetensors                              (NAF, registered model json)
    <root>/moge/model.pt                                              (MoGe-2: {model_config, model})
    <root>/shape_encoder/ckpts/shape_enc_next_dc_f16c32_fp16.*        (TRELLIS.2's shape encoder, for --mesh)

The multi-view demo (``configs/tiny_mv.yaml``, ``generate: tiny-mv``) has its own folder, ``<cache>/tiny/
tiny-mv-v1/pixal3d``: ``pipeline_mv.json`` naming four flows of their own (``ckpts/*_mv``: the same networks,
other values, as upstream's multi-view denoisers) and the three decoders (the same bytes as the single-view
demo's: upstream shares them); it shares DINOv3 and NAF with the single-view demo. Nothing of ``tiny-v6`` changes.

Values come from NumPy's PCG64 seeded with a CRC32 of ``<file>/<tensor>`` and are stored in float32
(the tiny networks compute in float32: bf16/fp16 matmuls are slow on CPUs), so the bytes are the same
on every run and machine (for one transformers version, which writes its version into
``config.json``). Scales follow a fan-in rule (uniform ``±sqrt(3/fan_in)`` for matrices and kernels,
ones/zeros for norm weights/biases, ``±0.02`` for other vectors); buffers such as NAF's RoPE periods
keep their true values. A few tensors are then set so the random networks give a usable structure:
the sparse-structure decoder's output layer (scale and bias: occupancy), the shape decoder's
subdivision biases (most children kept), and MoGe-2's last level (``MOGE_SPECIAL``): the view-plane UV
carried to the points' x/y so that the recovered focal is a lens's (≈ 59° on assets/example.png) and
varies with the image, and the mask biased to valid.
"""
from __future__ import annotations

import io
import json
import logging
import math
import os
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save as safetensors_bytes

from pixal3d.weights_errors import WeightsError
from pixal3d.locks import exclusive_lock

logger = logging.getLogger(__name__)

TINY_VERSION = "tiny-v7"
TINY_MEGABYTES = 10  # what the generated folder takes on disk (about 4 MB), with room to spare

DINO_HIDDEN = 64
LATENT = 8  # tiny shape/texture latent channels (32 in the published models)

DINOV3_CONFIG: dict[str, Any] = dict(
    hidden_size=DINO_HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    num_register_tokens=4, patch_size=16, image_size=64, layerscale_value=1.0)

NAF_ARGS: dict[str, Any] = dict(dim=32, heads_attn=2, heads_rope=2, kernel_size=3, rope_base=100.0, img_layers=1)


def _moge_stack(dim_in: list[int], dim_out: Any) -> dict[str, Any]:
    return {"dim_in": dim_in, "dim_out": dim_out, "dim_res_blocks": [32, 16, 16, 8, 8],
            "num_res_blocks": [0, 1, 1, 1, 0], "res_block_in_norm": "none", "res_block_hidden_norm": "none",
            "resamplers": ["conv_transpose", "conv_transpose", "conv_transpose", "bilinear"]}


MOGE_CONFIG: dict[str, Any] = {  # the released model_config's structure at toy widths; 36 tokens at level 9
    "encoder": {"backbone": "tiny_vit14", "intermediate_layers": [0, 1], "dim_out": 32},
    "neck": _moge_stack([34, 2, 2, 2, 2], None),
    "points_head": _moge_stack([32, 16, 16, 8, 8], [None, None, None, None, 3]),
    "mask_head": _moge_stack([32, 16, 16, 8, 8], [None, None, None, None, 1]),
    "scale_head": {"dims": [32, 32, 1]},
    "remap_output": "exp",
    "num_tokens_range": [16, 36],
}
MOGE_UV_GAIN = 10.0  # UV into the neck's last level, ×10 over the random features
MOGE_FOCAL = 1.3  # points x/y = UV / (gain · focal): a focal of ≈ 1.3 half-diagonals


def _moge_special(state: dict[str, torch.Tensor]) -> None:
    """MoGe-2's last level made to carry the view-plane UV to the points (module docstring), in place."""
    uv_in = torch.zeros_like(state["neck.input_blocks.4.weight"])  # [8, 2, 1, 1]: UV → channels 0, 1
    uv_in[0, 0] = uv_in[1, 1] = MOGE_UV_GAIN
    passed = torch.zeros_like(state["points_head.input_blocks.4.weight"])  # [8, 8, 1, 1]: channels 0, 1 on
    passed[0, 0] = passed[1, 1] = 1.0
    out = state["points_head.output_blocks.4.weight"].clone()  # [3, 8, 1, 1]
    out[:2] = 0.0
    out[0, 0] = out[1, 1] = 1.0 / (MOGE_UV_GAIN * MOGE_FOCAL)
    out[2] *= 0.05  # log-depth: small image-dependent variation around log 2
    state.update({
        "neck.input_blocks.4.weight": uv_in, "neck.input_blocks.4.bias": torch.zeros(8),
        "points_head.input_blocks.4.weight": passed, "points_head.input_blocks.4.bias": torch.zeros(8),
        "points_head.output_blocks.4.weight": out,
        "points_head.output_blocks.4.bias": torch.tensor([0.0, 0.0, math.log(2.0)]),
        "mask_head.output_blocks.4.bias": torch.tensor([2.0]),  # sigmoid ≈ 0.88 before the random part: valid
    })


def _flow(cls: str, resolution: int, cin: int, cout: int, proj: int) -> dict[str, Any]:
    return {"name": cls, "args": dict(
        resolution=resolution, in_channels=cin, out_channels=cout, model_channels=32, cond_channels=DINO_HIDDEN,
        num_blocks=2, num_heads=2, mlp_ratio=2.0, pe_mode="rope", rope_freq=[1.0, 10000.0], dtype="float32",
        share_mod=True, qk_rms_norm=True, qk_rms_norm_cross=True, image_attn_mode="proj",
        proj_in_channels=proj, initialization="scaled")}


def _decoder(cls: str, **extra: Any) -> dict[str, Any]:
    return {"name": cls, "args": dict(
        model_channels=[32, 16, 8], latent_channels=LATENT, num_blocks=[1, 1, 1],
        block_type=["SparseConvNeXtBlock3d"] * 3, up_block_type=["SparseResBlockC2S3d"] * 2,
        use_fp16=False, **extra)}


# registry name → (checkpoint stem, spec, stored dtype)
CHECKPOINTS: dict[str, tuple[str, dict[str, Any], torch.dtype]] = {
    "sparse_structure_flow_model": (
        "ckpts/ss_flow_tiny", _flow("SparseStructureFlowModel", 4, 8, 8, DINO_HIDDEN), torch.float32),
    "sparse_structure_decoder": ("ckpts/ss_dec_tiny", {"name": "SparseStructureDecoder", "args": dict(
        out_channels=1, latent_channels=8, num_res_blocks=1, num_res_blocks_middle=1, channels=[32, 16, 8],
        norm_type="layer", use_fp16=False)}, torch.float32),
    "shape_slat_flow_model_512": (
        "ckpts/shape_flow_512_tiny", _flow("ElasticSLatFlowModel", 8, LATENT, LATENT, 2 * DINO_HIDDEN),
        torch.float32),
    "shape_slat_flow_model_1024": (
        "ckpts/shape_flow_1024_tiny", _flow("ElasticSLatFlowModel", 16, LATENT, LATENT, 2 * DINO_HIDDEN),
        torch.float32),
    "tex_slat_flow_model_1024": (
        "ckpts/tex_flow_1024_tiny", _flow("ElasticSLatFlowModel", 16, 2 * LATENT, LATENT, 2 * DINO_HIDDEN),
        torch.float32),
    "shape_slat_decoder": (
        "ckpts/shape_dec_tiny", _decoder("FlexiDualGridVaeDecoder", resolution=64), torch.float32),
    "tex_slat_decoder": (
        "ckpts/tex_dec_tiny", _decoder("SparseUnetVaeDecoder", out_channels=6, pred_subdiv=False), torch.float32),
}

SHAPE_ENCODER: tuple[str, dict[str, Any], torch.dtype] = (
    "ckpts/shape_enc_next_dc_f16c32_fp16", {"name": "FlexiDualGridVaeEncoder", "args": dict(
        model_channels=[8, 16, 32], latent_channels=LATENT, num_blocks=[1, 1, 1],
        block_type=["SparseConvNeXtBlock3d"] * 3, down_block_type=["SparseResBlockS2C3d"] * 2, use_fp16=False)},
    torch.float32)
"""The mirror of the tiny shape decoder (``tiny-v7``): the 48 grid's dual grid -> the 12 grid's latent."""

# Biases that make random networks produce a usable structure (see the module docstring).
SPECIAL_SCALES: dict[tuple[str, str], float] = {
    ("sparse_structure_decoder", "out_layer.2.weight"): 150.0,  # logits std ≈ 1 instead of ≈ 0.006
}
SPECIAL_BIASES: dict[tuple[str, str], float] = {
    ("sparse_structure_decoder", "out_layer.2.bias"): -1.2,  # ≈ 30 % of the pooled grid occupied
    ("shape_slat_decoder", "blocks.0.1.to_subdiv.bias"): 0.3,
    ("shape_slat_decoder", "blocks.1.1.to_subdiv.bias"): 0.3,
}


def _normalization(offset: float) -> dict[str, list[float]]:
    return {"mean": [round(offset + 0.05 * i, 4) for i in range(LATENT)],
            "std": [round(1.0 + 0.1 * i, 4) for i in range(LATENT)]}


def pipeline_json() -> dict[str, Any]:
    """The tiny ``pipeline.json`` (same structure as the published one)."""
    return {"name": "Pixal3DImageTo3DPipeline", "args": {
        "models": {name: stem for name, (stem, _, _) in CHECKPOINTS.items()},
        "shape_slat_normalization": _normalization(0.1),
        "tex_slat_normalization": _normalization(-0.2),
    }}


def deterministic_tensor(label: str, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 values for tensor ``key`` of file ``label``: a pure function of the names and shape."""
    rng = np.random.Generator(np.random.PCG64(zlib.crc32(f"{label}/{key}".encode())))
    leaf = key.rsplit(".", 1)[-1]
    module = key.rsplit(".", 1)[0] if "." in key else ""
    n = int(np.prod(shape)) if shape else 1
    if len(shape) == 1 and ("norm" in module.lower() or leaf == "gamma"):
        values = np.ones(n) if leaf in ("weight", "gamma") else np.zeros(n)
    elif leaf == "gamma" or "lambda" in leaf:
        values = np.ones(n)
    elif len(shape) >= 2 and leaf == "weight":
        bound = math.sqrt(3.0 / max(1, n // shape[0]))
        values = (rng.random(n) * 2 - 1) * bound
    else:
        values = (rng.random(n) * 2 - 1) * 0.02
    return torch.from_numpy(values.astype(np.float32)).reshape(shape)


def checkpoint_state(label: str, spec: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every stored tensor of the model ``spec`` describes: deterministic values for parameters, the true
    (config-derived) values for persistent buffers such as NAF's RoPE periods."""
    from pixal3d.models import build_model  # the package registers every network class

    model = build_model(spec, device="meta", source=label)
    state = {key: deterministic_tensor(label, key, tuple(t.shape)) for key, t in model.state_dict().items()}
    buffers = [name for name, _ in model.named_buffers() if name in state]
    if buffers:
        with torch.random.fork_rng(devices=[]):
            real = dict(build_model(spec, device="cpu", source=label).named_buffers())
        state.update({name: real[name].float() for name in buffers})
    return state


MV_FLOWS = ("sparse_structure_flow_model", "shape_slat_flow_model_512", "shape_slat_flow_model_1024",
            "tex_slat_flow_model_1024")
MV_CHECKPOINTS: dict[str, tuple[str, dict[str, Any], torch.dtype]] = {
    name: (f"{stem}_mv", spec, dtype) if name in MV_FLOWS else (stem, spec, dtype)
    for name, (stem, spec, dtype) in CHECKPOINTS.items()}
"""The multi-view demo's checkpoints: the flows under ``_mv`` stems (their values drawn under ``<name>_mv``), the
decoders as the single-view demo's."""
TINY_MV_VERSION = "tiny-mv-v1"


def mv_pipeline_json() -> dict[str, Any]:
    """The tiny ``pipeline_mv.json``: the multi-view checkpoints, the single-view demo's normalization."""
    data = pipeline_json()
    data["name"] = "Pixal3DMVImageTo3DPipeline"
    data["args"]["models"] = {name: stem for name, (stem, _, _) in MV_CHECKPOINTS.items()}
    return data


def _write_checkpoint(folder: Path, name: str, *, label: str | None = None,
                      table: dict[str, tuple[str, dict[str, Any], torch.dtype]] | None = None) -> None:
    stem, spec, dtype = (table or CHECKPOINTS)[name]
    state = checkpoint_state(label or name, spec)
    for (model, key), value in SPECIAL_SCALES.items():
        if model == name:
            state[key] = state[key] * value
    for (model, key), value in SPECIAL_BIASES.items():
        if model == name:
            state[key] = torch.full_like(state[key], value)
    path = folder / stem
    path.parent.mkdir(parents=True, exist_ok=True)
    _save({k: v.to(dtype).contiguous() for k, v in sorted(state.items())}, path.with_suffix(".safetensors"))
    path.with_suffix(".json").write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")


def _write_dinov3(folder: Path) -> None:
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    config = DINOv3ViTConfig(**DINOV3_CONFIG)
    with torch.device("meta"):
        model = DINOv3ViTModel(config)
    state = {key: deterministic_tensor("dinov3", key, tuple(t.shape)) for key, t in model.state_dict().items()}
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(folder))
    _save(dict(sorted(state.items())), folder / "model.safetensors", metadata={"format": "pt"})


def _write_naf(folder: Path) -> None:
    spec = {"name": "NAF", "args": NAF_ARGS}
    state = checkpoint_state("naf", spec)
    folder.mkdir(parents=True, exist_ok=True)
    _save(dict(sorted(state.items())), folder / "naf.safetensors")
    (folder / "naf.json").write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")


def _write_moge(folder: Path) -> None:
    """``model.pt`` as the release stores it: ``{"model_config", "model"}`` (float32 tensors)."""
    from pixal3d.models.moge import IMAGENET_MEAN, IMAGENET_STD, build_moge

    model = build_moge(MOGE_CONFIG, device="meta", source="tiny MoGe-2")
    state = {key: deterministic_tensor("moge", key, tuple(t.shape)) for key, t in model.state_dict().items()}
    state["encoder.image_mean"] = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    state["encoder.image_std"] = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    _moge_special(state)
    folder.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()  # written by Python, as _save does: a full disk is an OSError
    torch.save({"model_config": MOGE_CONFIG, "model": dict(sorted(state.items()))}, buffer)
    (folder / "model.pt").write_bytes(buffer.getvalue())


def _save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``'s bytes, written by Python: a full disk is then an ``OSError``, not
    safetensors' own error type."""
    path.write_bytes(safetensors_bytes(tensors, metadata=metadata))


def write_tiny_weights(folder: Path) -> Path:
    """Write every tiny file into ``folder`` (created), returning it."""
    from pixal3d.staging.rng import preserved_rng

    with preserved_rng():  # nothing here should draw from the global generators; make sure of it
        pipe = folder / "pixal3d"
        pipe.mkdir(parents=True, exist_ok=True)
        (pipe / "pipeline.json").write_text(json.dumps(pipeline_json(), indent=2, sort_keys=True) + "\n")
        for name in CHECKPOINTS:
            _write_checkpoint(pipe, name)
        _write_dinov3(folder / "dinov3")
        _write_naf(folder / "naf")
        _write_moge(folder / "moge")
        _write_checkpoint(folder / "shape_encoder", "shape_encoder", table={"shape_encoder": SHAPE_ENCODER})
    return folder


def write_tiny_mv_weights(folder: Path) -> Path:
    """Write the multi-view demo's ``pixal3d`` folder (``pipeline_mv.json`` + checkpoints) into ``folder``."""
    from pixal3d.staging.rng import preserved_rng

    with preserved_rng():
        pipe = folder / "pixal3d"
        pipe.mkdir(parents=True, exist_ok=True)
        (pipe / "pipeline_mv.json").write_text(json.dumps(mv_pipeline_json(), indent=2, sort_keys=True) + "\n")
        for name in MV_CHECKPOINTS:
            _write_checkpoint(pipe, name, table=MV_CHECKPOINTS, label=f"{name}_mv" if name in MV_FLOWS else name)
    return folder


def ensure_tiny_mv_weights(root: Path) -> Path:
    """``root/<TINY_MV_VERSION>``, generated on first use as ``ensure_tiny_weights`` does."""
    return _ensure(Path(root), TINY_MV_VERSION, write_tiny_mv_weights)


def ensure_tiny_weights(root: Path) -> Path:
    """``root/<TINY_VERSION>``, generated on first use: written to a temporary folder, then renamed.

    Processes starting together (parallel test workers, a batch of first runs) take turns on a lock: the
    first generates, the others wait and find the folder complete; a finished folder is never replaced
    while another process reads it. A cache that cannot be written (read-only, a file where the folder
    should be, a full disk) is a ``WeightsError`` naming the folder and ``PIXAL3D_CACHE``.
    """
    return _ensure(Path(root), TINY_VERSION, write_tiny_weights)


def _ensure(root: Path, version: str, write: Any) -> Path:
    """``root/<version>`` written by ``write(folder)`` on first use (see ``ensure_tiny_weights``)."""
    target = root / version
    if (target / "COMPLETE").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(target.parent / f".{version}.lock", wait=True):
            if not (target / "COMPLETE").is_file():  # not finished by another process while this one waited
                _generate(target, version, write)
    except OSError as err:
        reason = err.strerror or str(err)
        raise WeightsError(f"cannot write the offline demo weights into {target.parent} ({reason}"
                           f"{': ' + str(err.filename) if err.filename else ''}); set PIXAL3D_CACHE to a writable "
                           f"folder with at least {TINY_MEGABYTES} MB free") from None
    return target


def _generate(target: Path, version: str, write: Any) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=target.parent))
    try:
        write(tmp)
        (tmp / "COMPLETE").write_text(version + "\n")
        if target.exists():
            shutil.rmtree(target)  # an attempt that never completed (no COMPLETE: nobody reads it)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("tiny demo weights written to %s", target)
