"""GLB writer: glTF PBR material through trimesh, Pixal3D's output frame, atomic file write.

Frame: TRELLIS.2's ``to_glb`` maps internal ``(x, y, z) → (x, z, −y)`` and Pixal3D then applies
``[[-1,0,0],[0,0,-1],[0,-1,0]]``; together ``(x, y, z) → (−x, y, −z)``, a rotation (det +1), so the
winding is unchanged. UVs: the baked image has row 0 at v ≈ 0; trimesh writes TEXCOORD_0 as
``1 − v`` of what it is given, so it is given ``1 − v`` and the file stores v (glTF: v = 0 is row 0).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from pixal3d.files import write_bytes_atomic

from .settings import ALPHA_MODES, TEXTURE_FORMATS

if TYPE_CHECKING:  # trimesh costs a second to import: only when a mesh is built
    import trimesh

INTERNAL_TO_GLB = np.array([[-1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, -1.0]])


def vertex_normals(vertices: np.ndarray, faces: np.ndarray) -> np.ndarray:
    """Area-weighted unit vertex normals (float32)."""
    v = vertices.astype(np.float64, copy=False)
    n = np.cross(v[faces[:, 1]] - v[faces[:, 0]], v[faces[:, 2]] - v[faces[:, 0]])
    out = np.zeros_like(v)
    for k in range(3):
        _scatter_add(out, faces[:, k], n)
    return (out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-30)).astype(np.float32)


def _scatter_add(out: np.ndarray, index: np.ndarray, values: np.ndarray) -> None:
    for c in range(values.shape[1]):
        out[:, c] += np.bincount(index, weights=values[:, c], minlength=len(out))


def resolve_alpha_mode(mode: str, alpha: np.ndarray, *, threshold: float = 0.01) -> str:
    """``'auto'`` → BLEND only when more than ``threshold`` of texels have alpha < 128, else OPAQUE."""
    if mode not in ALPHA_MODES:
        raise ValueError(f"alpha_mode must be one of {ALPHA_MODES}, got {mode!r}")
    if mode != "auto":
        return mode
    return "BLEND" if float((alpha < 128).mean()) > threshold else "OPAQUE"


def build_mesh(
    vertices: np.ndarray,
    faces: np.ndarray,
    normals: np.ndarray,
    uvs: np.ndarray,
    base_color_rgba: np.ndarray,
    metallic_roughness: np.ndarray,
    *,
    alpha_mode: str = "OPAQUE",
    normal_map: np.ndarray | None = None,
    tangents: np.ndarray | None = None,
) -> trimesh.Trimesh:
    """A textured trimesh in the GLB frame; ``uvs`` in the baker's convention (row 0 at v ≈ 0). With
    ``normal_map`` (and its ``tangents [V, 4]``, the frame it was baked in, rotated like the normals) the
    material's ``normalTexture``; the tangents are a vertex attribute that ``encode_glb`` writes as TANGENT."""
    import trimesh
    from trimesh.visual.material import PBRMaterial
    from trimesh.visual.texture import TextureVisuals

    material = PBRMaterial(
        baseColorTexture=Image.fromarray(base_color_rgba, mode="RGBA"),
        baseColorFactor=[255, 255, 255, 255],
        metallicRoughnessTexture=Image.fromarray(metallic_roughness, mode="RGB"),
        metallicFactor=1.0,
        roughnessFactor=1.0,
        alphaMode=resolve_alpha_mode(alpha_mode, base_color_rgba[..., 3]),
        doubleSided=False,
        normalTexture=None if normal_map is None else Image.fromarray(normal_map, mode="RGB"),
    )
    uv = np.column_stack([uvs[:, 0], 1.0 - uvs[:, 1]])
    mesh = trimesh.Trimesh(
        vertices=vertices.astype(np.float64) @ INTERNAL_TO_GLB.T,
        faces=faces,
        vertex_normals=normals.astype(np.float64) @ INTERNAL_TO_GLB.T,
        visual=TextureVisuals(uv=uv, material=material),
        process=False,
    )
    if normal_map is not None:
        if tangents is None:
            raise ValueError("a normal map needs the tangents it was baked in")
        # the frame is a rotation (det +1): handedness w is unchanged
        frame = np.column_stack([tangents[:, :3].astype(np.float64) @ INTERNAL_TO_GLB.T, tangents[:, 3]])
        mesh.vertex_attributes["TANGENT"] = frame.astype(np.float32)
    return mesh


def build_plain_mesh(vertices: np.ndarray, faces: np.ndarray, normals: np.ndarray) -> trimesh.Trimesh:
    """An untextured trimesh in the GLB frame (a shape-only run's): positions, faces, normals and one plain grey
    material (no texture, no UVs), so that viewers shade it alike."""
    import trimesh
    from trimesh.visual.material import PBRMaterial
    from trimesh.visual.texture import TextureVisuals

    material = PBRMaterial(baseColorFactor=[200, 200, 200, 255], metallicFactor=0.0, roughnessFactor=1.0,
                           alphaMode="OPAQUE", doubleSided=False)
    return trimesh.Trimesh(vertices=vertices.astype(np.float64) @ INTERNAL_TO_GLB.T, faces=faces,
                           vertex_normals=normals.astype(np.float64) @ INTERNAL_TO_GLB.T,
                           visual=TextureVisuals(material=material), process=False)


def encode_glb(mesh: trimesh.Trimesh, *, texture_format: str = "png", occlusion: bool = False,
               compression: str | None = None) -> bytes:
    """The GLB file's bytes for ``mesh`` (textures encoded as PNG or WebP); ``occlusion``: the red channel of the
    metallic-roughness image is ambient occlusion; ``compression``: None or ``"meshopt"`` (``glb_container``)."""
    if texture_format not in TEXTURE_FORMATS:
        raise ValueError(f"texture_format must be one of {TEXTURE_FORMATS}, got {texture_format!r}")
    import trimesh
    from trimesh.exchange.gltf import export_glb

    from .glb_container import finish

    data = export_glb(trimesh.Scene(mesh), include_normals=True, extension_webp=texture_format == "webp")
    return finish(data, occlusion=occlusion, compression=compression)


def write_glb(mesh: trimesh.Trimesh, path: str | os.PathLike, *, texture_format: str = "png") -> int:
    """Encode ``mesh`` as GLB and write it atomically (``pixal3d.files``); returns bytes written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_bytes_atomic(path, encode_glb(mesh, texture_format=texture_format))
