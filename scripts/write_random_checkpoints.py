"""Write real-size checkpoints filled with deterministic random weights, for memory benchmarks.

Every tensor named in a manifest (``assets/checkpoints.json``: name, shape, stored dtype of
each of the seven Pixal3D checkpoints, with the config args) is written to
``<cache>/<file>.safetensors`` with a ``<file>.json`` ``{"name": <class>, "args": {...}}`` beside it,
so ``pixal3d.models.loading.load_model(stem)`` reads it like the published file. A real-size DINOv3
ViT-L/16 (``save_pretrained`` layout) and NAF at its released config (``naf/naf_release.safetensors``,
keys of ``pixal3d.models.naf.NAF``) are written the same way.

Values come from a counter-based hash (lowbias32 of ``index * golden ^ seed(file, tensor)``), so any
slice of any tensor can be produced on its own, the bytes are the same on every machine and run, and
~13 GB are written in a few minutes on two cores. Scales follow a fan-in rule so the networks run
without overflow: uniform ``±sqrt(3/fan_in)`` for matrices and kernels, ones for norm weights/gammas,
zeros for norm biases, ``±0.02`` for every other vector. Files are written to a temporary name and
renamed, streamed chunk by chunk (never a whole model in memory), and skipped when an existing file
already has exactly the expected header and size.

    python scripts/write_random_checkpoints.py [--cache ~/.cache/pixal3d/bench] [--only NAME ...]
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import struct
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pixal3d.files import atomic_path  # noqa: E402
from pixal3d.pipeline_json import published_samplers  # noqa: E402

logger = logging.getLogger("write_random_checkpoints")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MANIFEST = REPO / "assets" / "checkpoints.json"  # the published checkpoints' tensors, names and args
DEFAULT_CACHE = Path(os.environ.get("PIXAL3D_BENCH_CACHE", Path.home() / ".cache" / "pixal3d" / "bench"))
GENERATOR_VERSION = "pixal3d-bench-random-v1"
CHUNK = 1 << 22  # elements hashed per step: 16 MiB of float32 scratch

_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}
_TORCH_DTYPE = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_DTYPE_NAME = {v: k for k, v in _TORCH_DTYPE.items()}

# DINOv3 ViT-L/16 (facebook/dinov3-vitl16-pretrain-lvd1689m): the sizes of the published config.
DINOV3_VITL16 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                     num_register_tokens=4, patch_size=16, image_size=224, layerscale_value=1e-5,
                     rope_theta=100.0, use_gated_mlp=False, key_bias=False, query_bias=True, value_bias=True,
                     proj_bias=True, mlp_bias=True, hidden_act="gelu", layer_norm_eps=1e-5)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a checkpoint: its key, shape and stored safetensors dtype (BF16, F16 or F32)."""
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _ITEMSIZE[self.dtype]


def _hash32(counter: np.ndarray, seed: int) -> np.ndarray:
    """lowbias32 (Chris Wellons' integer hash) of ``counter * golden ^ seed``, in place on uint32."""
    x = counter
    x *= np.uint32(0x9E3779B9)
    x ^= np.uint32(seed)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def tensor_seed(file_key: str, tensor_name: str) -> int:
    """A 32-bit seed from the checkpoint file and tensor name (crc32: stable across runs and machines)."""
    return zlib.crc32(f"{GENERATOR_VERSION}/{file_key}/{tensor_name}".encode())


def uniform(seed: int, start: int, count: int) -> np.ndarray:
    """Elements ``start .. start+count`` of the stream ``seed`` as float32 uniform in [-1, 1)."""
    x = _hash32(np.arange(start, start + count, dtype=np.uint32), seed)
    x >>= np.uint32(8)
    out = x.astype(np.float32)
    out *= np.float32(2.0 ** -23)
    out -= np.float32(1.0)
    return out


def value_rule(spec: TensorSpec) -> tuple[str, float]:
    """How a tensor is filled: ``("const", value)`` or ``("uniform", half_width)`` (see module doc)."""
    leaf = spec.name.rsplit(".", 1)[-1]
    is_norm = "norm" in spec.name.lower()
    if len(spec.shape) >= 2 and not (is_norm and leaf == "gamma"):
        fan_in = max(1, math.prod(spec.shape[1:]))
        return "uniform", math.sqrt(3.0 / fan_in)
    if is_norm and leaf in ("weight", "gamma"):
        return "const", 1.0
    if is_norm and leaf == "bias":
        return "const", 0.0
    return "uniform", 0.02


def tensor_bytes(file_key: str, spec: TensorSpec, start: int, count: int) -> bytes:
    """The stored bytes of elements ``start .. start+count`` of one tensor (little-endian)."""
    kind, value = value_rule(spec)
    if kind == "const":
        values = np.full(count, value, dtype=np.float32)
    else:
        values = uniform(tensor_seed(file_key, spec.name), start, count)
        values *= np.float32(value)
    # torch rounds float32 -> bf16/f16 to nearest-even, the same on every machine
    return torch.from_numpy(values).to(_TORCH_DTYPE[spec.dtype]).view(torch.uint8).numpy().tobytes()


def safetensors_header(specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None) -> bytes:
    """The 8-byte length plus JSON header of a safetensors file holding ``specs`` in the given order."""
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(text)) + text


def write_safetensors(path: Path, file_key: str, specs: Sequence[TensorSpec],
                      fixed: Mapping[str, torch.Tensor] | None = None) -> bool:
    """Stream a deterministic random safetensors file; return False when an identical one exists.

    ``fixed`` gives the exact values of some tensors (e.g. buffers derived from the config, such as
    NAF's RoPE periods, which must stay meaningful); every other tensor is random."""
    specs = sorted(specs, key=lambda s: s.name)
    fixed = dict(fixed or {})
    header = safetensors_header(specs, {"generator": GENERATOR_VERSION})
    size = len(header) + sum(s.nbytes for s in specs)
    if path.exists() and path.stat().st_size == size:
        with open(path, "rb") as f:
            if f.read(len(header)) == header:
                return False
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(header)
        for spec in specs:
            if spec.name in fixed:
                value = fixed[spec.name].detach().to("cpu", _TORCH_DTYPE[spec.dtype]).contiguous()
                f.write(value.view(torch.uint8).numpy().tobytes())
                continue
            f.writelines(tensor_bytes(file_key, spec, start, min(CHUNK, spec.numel - start)) for start in range(0, spec.numel, CHUNK))
    return True


def manifest_specs(entry: Mapping) -> list[TensorSpec]:
    """The tensors of one checkpoints.json model entry (its stored dtype applies to every tensor)."""
    return [TensorSpec(name, tuple(shape), entry["dtype"]) for name, shape in entry["tensors"].items()]


def write_manifest_checkpoint(cache: Path, key: str, entry: Mapping) -> Path:
    """Write one checkpoints.json model as ``<cache>/<file>.safetensors`` + ``.json``; return the stem."""
    stem = cache / entry["file"]
    t0 = time.perf_counter()
    wrote = write_safetensors(stem.with_name(stem.name + ".safetensors"), entry["file"], manifest_specs(entry))
    stem.with_name(stem.name + ".json").write_text(
        json.dumps({"name": entry["class"], "args": entry["args"]}, indent=2) + "\n")
    logger.info("%s: %s %s (%.1f s)", key, "wrote" if wrote else "reused", stem, time.perf_counter() - t0)
    return stem


def module_specs(module: torch.nn.Module) -> list[TensorSpec]:
    """Tensor specs of a (meta-built) module's state dict, each in the module's own dtype."""
    return [TensorSpec(name, tuple(t.shape), _DTYPE_NAME[t.dtype]) for name, t in module.state_dict().items()]


def write_dinov3(cache: Path) -> Path:
    """Write a real-size DINOv3 ViT-L/16 in the ``save_pretrained`` layout (float32, like the hub file)."""
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    folder = cache / "dinov3-vitl16"
    config = DINOv3ViTConfig(**DINOV3_VITL16)
    with torch.device("meta"):
        model = DINOv3ViTModel(config)
    t0 = time.perf_counter()
    wrote = write_safetensors(folder / "model.safetensors", "dinov3-vitl16", module_specs(model))
    config.save_pretrained(folder)
    logger.info("dinov3: %s %s (%.1f s)", "wrote" if wrote else "reused", folder, time.perf_counter() - t0)
    return folder


def write_naf(cache: Path) -> Path:
    """Write NAF at its released config as ``<cache>/naf/naf_release.safetensors`` (float32, as published).

    The RoPE ``periods`` buffer keeps its true values (it is a function of the config); the weights are random.
    """
    from pixal3d.models.naf import NAF

    model = NAF()  # 0.66 M parameters: cheap to build on the CPU, and the buffer gets its real values
    path = cache / "naf" / "naf_release.safetensors"
    t0 = time.perf_counter()
    wrote = write_safetensors(path, "naf/naf_release", module_specs(model), fixed=dict(model.named_buffers()))
    logger.info("naf: %s %s (%.1f s)", "wrote" if wrote else "reused", path, time.perf_counter() - t0)
    return path


def write_pipeline_json(cache: Path, manifest: Path = DEFAULT_MANIFEST, channels: int = 32) -> Path:
    """``<cache>/pipeline.json`` naming the manifest's checkpoints, with identity latent normalization and the
    reference's sampler intervals."""
    models = json.loads(Path(manifest).read_text())["models"]
    identity = {"mean": [0.0] * channels, "std": [1.0] * channels}
    pipeline = {"name": "Pixal3DImageTo3DPipeline", "args": {
        "models": {key: entry["file"] for key, entry in models.items()},
        "shape_slat_normalization": identity, "tex_slat_normalization": identity,
        **published_samplers()}}
    path = cache / "pipeline.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(pipeline, indent=1) + "\n")
    return path


def write_all(cache: Path, manifest: Path = DEFAULT_MANIFEST, only: Iterable[str] | None = None, *,
              jobs: int = 1) -> dict[str, Path]:
    """Write (or reuse) every manifest checkpoint plus DINOv3 and NAF; return {model name: stem or path}.

    ``jobs`` > 1 writes the files in that many processes (each file is still written by one)."""
    models = json.loads(Path(manifest).read_text())["models"]
    wanted = set(only) if only else None
    unknown = (wanted or set()) - set(models) - {"dinov3", "naf"}
    if unknown:
        raise SystemExit(f"--only names {sorted(unknown)} are not in {manifest}; known: {sorted(models)} + dinov3, naf")
    tasks = [(key, write_manifest_checkpoint, (cache, key, entry))
             for key, entry in models.items() if wanted is None or key in wanted]
    tasks += [(key, fn, (cache,)) for key, fn in (("dinov3", write_dinov3), ("naf", write_naf))
              if wanted is None or key in wanted]
    if jobs <= 1:
        return {key: fn(*fn_args) for key, fn, fn_args in tasks}
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = {key: pool.submit(fn, *fn_args) for key, fn, fn_args in tasks}
        return {key: future.result() for key, future in futures.items()}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="output folder (default %(default)s)")
    parser.add_argument("--manifest", type=Path, default=DEFAULT_MANIFEST)
    parser.add_argument("--only", nargs="*", help="model names to write (default: all, plus dinov3 and naf)")
    parser.add_argument("--jobs", type=int, default=1, help="files written in parallel (default %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    t0 = time.perf_counter()
    paths = write_all(args.cache.expanduser(), args.manifest, args.only, jobs=args.jobs)
    write_pipeline_json(args.cache.expanduser(), args.manifest)
    logger.info("%d checkpoints ready under %s in %.1f s", len(paths), args.cache, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
