"""The note a shape-only GLB carries: the shape latent it was decoded from, so texturing it reproduces the full run.

TRELLIS.2's shape encoder is not the inverse of the shape flow: encoding a decoded mesh gives another latent than the
one it was decoded from, and so another texture. A shape-only run of this project (``--shape-only``) therefore
writes into its GLB what texturing needs to continue where it stopped: the shape latent (coordinates and features),
the run's CPU generator state after ``shape_1024`` (the texture noise is the next draw), and a sha256 of the mesh as
the file stores it (its POSITION and index bytes). ``--mesh`` of that file, unchanged, with ``--mesh-pose aligned``
uses the latent and the generator state instead of encoding the mesh: the texture latent is then the full run's, bit
for bit. A file whose mesh was changed (any vertex or face), or a compressed one, is encoded as any other mesh.

Layout: ``asset.extras.pixal3d_shape_latent`` names three bufferViews of the BIN chunk (``coords`` int32 ``[N, 4]``,
``feats`` float32 ``[N, C]``, ``generator`` uint8) and the mesh's sha256; viewers ignore both (a validator reports the
views as unused).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from .glb_container import Glb

KEY = "pixal3d_shape_latent"


@dataclass
class ShapeNote:
    """A shape-only GLB's note: the latent, the generator state, and whether the mesh still is the one it holds."""

    latent: object  # pixal3d.nn.sparse_tensor.SparseTensor
    generator_state: torch.Tensor
    matches: bool


def geometry_digest(glb: Glb) -> str | None:
    """sha256 of the first primitive's POSITION and index bytes as the file stores them (None: no such primitive)."""
    try:
        primitive = glb.gltf["meshes"][0]["primitives"][0]
        accessors = [glb.gltf["accessors"][primitive["attributes"]["POSITION"]],
                     glb.gltf["accessors"][primitive["indices"]]]
    except (KeyError, IndexError, TypeError):
        return None
    h = hashlib.sha256()
    for accessor in accessors:
        view = glb.gltf["bufferViews"][accessor["bufferView"]]
        start = view.get("byteOffset", 0) + accessor.get("byteOffset", 0)
        h.update(glb.binary[start:start + view["byteLength"] - accessor.get("byteOffset", 0)])
    return h.hexdigest()


def add_note(data: bytes, latent, generator_state: torch.Tensor) -> bytes:
    """``data`` (an uncompressed GLB) with the note of ``latent`` and ``generator_state`` added."""
    glb = Glb.parse(data)
    digest = geometry_digest(glb)
    if digest is None:
        return data
    binary = bytearray(glb.binary)
    views = glb.gltf.setdefault("bufferViews", [])
    named = {}
    for name, array in (("coords", latent.coords.detach().cpu().to(torch.int32).contiguous().numpy()),
                        ("feats", latent.feats.detach().cpu().to(torch.float32).contiguous().numpy()),
                        ("generator", generator_state.detach().cpu().to(torch.uint8).numpy())):
        binary += b"\0" * (-len(binary) % 4)
        views.append({"buffer": 0, "byteOffset": len(binary), "byteLength": array.nbytes})
        binary += array.tobytes()
        named[name] = len(views) - 1
    glb.gltf["buffers"][0]["byteLength"] = len(binary) + (-len(binary) % 4)
    glb.gltf.setdefault("asset", {}).setdefault("extras", {})[KEY] = {
        **named, "tokens": int(latent.coords.shape[0]), "channels": int(latent.feats.shape[1]), "mesh_sha256": digest}
    glb.binary = bytes(binary)
    return glb.pack()


def read_note(data: bytes) -> ShapeNote | None:
    """The note of a GLB's bytes, or None (not a GLB, no note, an unreadable one)."""
    from pixal3d.nn.sparse_tensor import SparseTensor

    try:
        glb = Glb.parse(data)
        note = glb.gltf["asset"]["extras"][KEY]
        n, c = int(note["tokens"]), int(note["channels"])
        coords = np.frombuffer(glb.view_bytes(glb.gltf["bufferViews"][note["coords"]]), np.int32).reshape(n, 4)
        feats = np.frombuffer(glb.view_bytes(glb.gltf["bufferViews"][note["feats"]]), np.float32).reshape(n, c)
        state = np.frombuffer(glb.view_bytes(glb.gltf["bufferViews"][note["generator"]]), np.uint8)
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    latent = SparseTensor(torch.from_numpy(feats.copy()), torch.from_numpy(coords.copy()))
    return ShapeNote(latent, torch.from_numpy(state.copy()), geometry_digest(glb) == note.get("mesh_sha256"))


def usable_note(mesh) -> ShapeNote | None:
    """The note of a ``UserMesh`` read from this project's own unchanged shape-only GLB, else None."""
    note = mesh.extras.get("note")
    return note if note is not None and note.matches else None
