"""Stage outputs ↔ safetensors: what one stage wrote to the ``RunState``, as tensors plus a JSON description.

A work directory (``work_dir.py``) keeps every finished stage's outputs so a killed run resumes, and a batch
too large for memory keeps states there between stages; both go through ``encode`` and ``decode``, keyed by
the stage's declared ``outputs``. Each value becomes tensors named ``<field>`` or ``<field>.<part>`` and an
entry in the description saying how to rebuild it:

| value | tensors | description |
|---|---|---|
| ``torch.Tensor`` | ``<field>`` | ``on``: ``cpu`` (noise, drawn on the CPU) or ``run`` (the run's device) |
| ``SparseTensor`` | ``.feats``, ``.coords`` | ``on`` |
| ``DualGridFields``, ``PbrVoxels`` (dataclasses) | one per tensor field | the class, the other fields, ``on`` |
| ``Camera`` (floats) | none | its fields |
| ``ImageFeatures`` | ``.<S>.tokens``, ``.<S>.image`` per size S | the sizes, the global tokens' count, ``on`` |
| ``PosedViews`` | ``.transforms``, ``.fovs``, ``.image<i>`` uint8 ``[H, W, C]`` | modes, names, mesh_scale |
| PIL image | ``<field>`` uint8 ``[H, W, C]`` | ``mode`` |
| ``ExportedMesh`` | ``.glb`` uint8 (the GLB bytes) | the export report; the trimesh is read back from the GLB |
| ``int``, ``float``, ``str``, ``bool``, ``None`` | none | the value (JSON keeps Python floats exactly) |

Tensors are stored bit for bit (safetensors keeps dtype, shape and bytes), so a decoded state fingerprints
as the one that was encoded. Only the classes in ``_DATACLASSES`` are rebuilt: a description never names an
arbitrary class to import. Each ``RunState`` field a stage writes declares its kind (``state.stored``):
``storable`` lists them for the build-time check, and ``encode`` refuses a value of another kind.
"""
from __future__ import annotations

import dataclasses
import io
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from PIL import Image

from pixal3d.mesh.fields import DualGridFields, PbrVoxels
from pixal3d.mesh.records import ExportedMesh, ExportReport, StepReport
from pixal3d.mesh.user_mesh import MeshPose
from pixal3d.models.camera import Camera
from pixal3d.models.conditioning import BackboneFeatures, ImageFeatures
from pixal3d.models.multiview import PosedViews
from pixal3d.nn.sparse_tensor import SparseTensor

_DATACLASSES: dict[str, type] = {"DualGridFields": DualGridFields, "PbrVoxels": PbrVoxels, "MeshPose": MeshPose}
"""Dataclasses of tensors (and plain fields) that ``decode`` may rebuild, by name."""


KINDS = ("value", "tensor", "sparse", "camera", "image", "views", "mesh", "dataclass", "features")
"""The kinds of value this codec stores (the table above)."""


class StateCodecError(ValueError):
    """A value has no encoding, or a stored description does not match its tensors."""


def declared_kinds(state_type: type) -> dict[str, str]:
    """Field → the kind it declares (``state.stored``), for the fields of dataclass ``state_type`` that do."""
    return {f.name: f.metadata["codec"] for f in dataclasses.fields(state_type) if "codec" in f.metadata}


def storable(state_type: type) -> set[str]:
    """The fields of ``state_type`` this codec can store: those that declare one of ``KINDS``."""
    return {name for name, kind in declared_kinds(state_type).items() if kind in KINDS}


def encode(values: Mapping[str, Any], kinds: Mapping[str, str] | None = None
           ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``{field: value}`` → (CPU tensors for safetensors, a JSON-ready description of every field). With
    ``kinds`` (``declared_kinds``), a value of another kind than its field declares is refused."""
    tensors: dict[str, torch.Tensor] = {}
    described = {name: _encode(name, value, tensors) for name, value in values.items()}
    for name, entry in described.items():
        if kinds is not None and values[name] is not None and entry["kind"] != kinds.get(name):
            raise StateCodecError(f"field {name!r} declares {kinds.get(name)!r} but holds a "
                                  f"{type(values[name]).__name__} (stored as {entry['kind']!r})")
    return _unshared(tensors), described


def decode(tensors: Mapping[str, torch.Tensor], described: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """The inverse of ``encode``: ``{field: value}``, tensors that lived on the run's device put on ``device``."""
    return {name: _decode(name, entry, tensors, device) for name, entry in described.items()}


def nbytes(value: Any, seen: set[int] | None = None) -> int:
    """Bytes of memory ``value`` holds in tensors and images (shared storages counted once): what keeping a
    state between stages costs."""
    seen = set() if seen is None else seen
    if value is None or isinstance(value, (bool, int, float, str)):
        return 0
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            return 0
        storage = value.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(value, SparseTensor):
        return nbytes(value.feats, seen) + nbytes(value.coords, seen) + nbytes(value.cache, seen)
    if isinstance(value, ExportedMesh):
        return len(value.glb) + nbytes(value.mesh.vertices, seen) + nbytes(value.mesh.faces, seen)
    if isinstance(value, Image.Image):
        return value.width * value.height * len(value.getbands())
    if isinstance(value, PosedViews):
        return (sum(nbytes(image, seen) for image in value.images) + nbytes(value.transforms, seen)
                + nbytes(value.fovs, seen))
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, Mapping):
        return sum(nbytes(v, seen) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v, seen) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(nbytes(getattr(value, f.name), seen) for f in dataclasses.fields(value))
    return 0


# -- one value ------------------------------------------------------------------------------------
def _on(tensor: torch.Tensor) -> str:
    return "cpu" if tensor.device.type == "cpu" else "run"


def _put(tensors: dict[str, torch.Tensor], key: str, tensor: torch.Tensor) -> None:
    tensors[key] = tensor.detach().to("cpu").contiguous()


def _encode(name: str, value: Any, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"kind": "value", "value": value}
    if isinstance(value, torch.Tensor):
        _put(tensors, name, value)
        return {"kind": "tensor", "on": _on(value)}
    if isinstance(value, SparseTensor):
        _put(tensors, f"{name}.feats", value.feats)
        _put(tensors, f"{name}.coords", value.coords)
        return {"kind": "sparse", "on": _on(value.feats)}
    if isinstance(value, Camera):
        return {"kind": "camera", "fields": dataclasses.asdict(value)}
    if isinstance(value, ImageFeatures):
        for size, features in value.by_size.items():
            _put(tensors, f"{name}.{size}.tokens", features.tokens)
            _put(tensors, f"{name}.{size}.image", features.image)
        first = next(iter(value.by_size.values()), None)  # every size: the same backbone, the same device
        return {"kind": "features", "sizes": list(value.sizes), "num_global": first.num_global if first else 0,
                "on": _on(first.tokens) if first else "cpu"}
    if isinstance(value, Image.Image):
        _put(tensors, name, torch.from_numpy(np.array(value)))
        return {"kind": "image", "mode": value.mode}
    if isinstance(value, PosedViews):
        _put(tensors, f"{name}.transforms", value.transforms)
        _put(tensors, f"{name}.fovs", value.fovs)
        for i, image in enumerate(value.images):
            _put(tensors, f"{name}.image{i}", torch.from_numpy(np.array(image)))
        return {"kind": "views", "modes": [image.mode for image in value.images], "names": list(value.names),
                "mesh_scale": value.mesh_scale}
    if isinstance(value, ExportedMesh):
        _put(tensors, f"{name}.glb", torch.frombuffer(bytearray(value.glb), dtype=torch.uint8))
        for suffix, data in value.extras.items():  # a printable mesh's STL and 3MF
            _put(tensors, f"{name}.extra{suffix}", torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return {"kind": "mesh", "report": dataclasses.asdict(value.report), "extras": sorted(value.extras)}
    if type(value).__name__ in _DATACLASSES and isinstance(value, _DATACLASSES[type(value).__name__]):
        plain, on = {}, "cpu"
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if isinstance(item, torch.Tensor):
                _put(tensors, f"{name}.{f.name}", item)
                on = _on(item)
            else:
                plain[f.name] = item
        return {"kind": "dataclass", "class": type(value).__name__, "plain": plain, "on": on}
    raise StateCodecError(f"field {name!r} holds a {type(value).__name__}, which has no encoding; "
                          f"add one to pipelines/state_codec.py (see its table)")


def _get(tensors: Mapping[str, torch.Tensor], key: str, on: str, device: torch.device) -> torch.Tensor:
    if key not in tensors:
        raise StateCodecError(f"the stored record has no tensor {key!r}")
    tensor = tensors[key]
    return tensor if on == "cpu" else tensor.to(device)


def _decode(name: str, entry: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], device: torch.device) -> Any:
    kind = entry.get("kind")
    if kind == "value":
        return entry["value"]
    if kind == "tensor":
        return _get(tensors, name, entry["on"], device)
    if kind == "sparse":
        return SparseTensor(_get(tensors, f"{name}.feats", entry["on"], device),
                            _get(tensors, f"{name}.coords", entry["on"], device))
    if kind == "camera":
        return Camera(**entry["fields"])
    if kind == "features":
        return ImageFeatures({int(size): BackboneFeatures(_get(tensors, f"{name}.{size}.tokens", entry["on"], device),
                                                           _get(tensors, f"{name}.{size}.image", entry["on"], device),
                                                           int(entry["num_global"]))
                              for size in entry["sizes"]})
    if kind == "image":
        return Image.fromarray(_get(tensors, name, "cpu", device).numpy(), mode=entry["mode"])
    if kind == "views":
        images = tuple(Image.fromarray(_get(tensors, f"{name}.image{i}", "cpu", device).numpy(), mode=mode)
                       for i, mode in enumerate(entry["modes"]))
        return PosedViews(images, _get(tensors, f"{name}.transforms", "cpu", device),
                          _get(tensors, f"{name}.fovs", "cpu", device), float(entry["mesh_scale"]),
                          tuple(entry["names"]))
    if kind == "mesh":
        extras = {suffix: bytes(_get(tensors, f"{name}.extra{suffix}", "cpu", device).numpy().tobytes())
                  for suffix in entry.get("extras", [])}
        return _mesh(bytes(_get(tensors, f"{name}.glb", "cpu", device).numpy().tobytes()), entry["report"], extras)
    if kind == "dataclass" and entry.get("class") in _DATACLASSES:
        cls = _DATACLASSES[entry["class"]]
        values = dict(entry["plain"])
        for f in dataclasses.fields(cls):
            if f.name not in values:
                values[f.name] = _get(tensors, f"{name}.{f.name}", entry["on"], device)
        return cls(**values)
    raise StateCodecError(f"field {name!r}: unknown stored kind {kind!r} (class {entry.get('class')!r})")


def _mesh(glb: bytes, report: Mapping[str, Any], extras: dict[str, bytes]) -> ExportedMesh:
    import trimesh

    from pixal3d.mesh.glb_container import uncompressed

    steps = [StepReport(**step) for step in report["steps"]]
    mesh = trimesh.load(io.BytesIO(uncompressed(glb)), file_type="glb", force="mesh", process=False)
    return ExportedMesh(mesh=mesh, glb=glb, report=ExportReport(**{**report, "steps": steps}), extras=extras)


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (a SparseTensor's coords may be another field):
    the second user of a storage gets its own copy."""
    seen: set[int] = set()
    out = {}
    for key, tensor in tensors.items():
        pointer = tensor.untyped_storage().data_ptr()
        if tensor.numel() and pointer in seen:
            tensor = tensor.clone()
        seen.add(pointer)
        out[key] = tensor
    return out
