"""The GLB container (glTF 2.0 binary: a JSON chunk and a BIN chunk) read and written, and the two changes the
export makes to trimesh's file: the standard names it cannot write, and meshopt compression.

trimesh writes a vertex attribute it does not know under a leading underscore (``_TANGENT``) and has no
``occlusionTexture`` that shares an image; ``finish`` renames TANGENT and points the occlusion texture at the
metallic-roughness image (its red channel, which glTF's metallic-roughness ignores). With
``compression="meshopt"`` every vertex attribute and the index buffer go through meshoptimizer's codecs
(``EXT_meshopt_compression``: the geometry's bufferViews point into a fallback buffer that holds no bytes, the
extension object into the compressed bytes; the extension is required, so a reader without it refuses the file
instead of showing garbage). Images are left as they are (already PNG/WebP).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import numpy as np

GLB_MAGIC = 0x46546C67  # "glTF"
JSON_CHUNK = 0x4E4F534A
BIN_CHUNK = 0x004E4942
MESHOPT = "EXT_meshopt_compression"
COMPONENT_BYTES = {5120: 1, 5121: 1, 5122: 2, 5123: 2, 5125: 4, 5126: 4}
TYPE_COUNT = {"SCALAR": 1, "VEC2": 2, "VEC3": 3, "VEC4": 4, "MAT4": 16}


@dataclass
class Glb:
    """A parsed GLB: the glTF JSON document and the BIN chunk's bytes."""

    gltf: dict
    binary: bytes

    @classmethod
    def parse(cls, data: bytes) -> Glb:
        """Split a GLB's bytes; a ``ValueError`` if they are not one."""
        if len(data) < 20:
            raise ValueError("not a GLB: shorter than its header")
        magic, version, length = struct.unpack_from("<III", data, 0)
        if magic != GLB_MAGIC or version != 2 or length != len(data):
            raise ValueError(f"not a glTF 2.0 GLB (magic {magic:#x}, version {version}, length {length})")
        json_length, kind = struct.unpack_from("<II", data, 12)
        if kind != JSON_CHUNK:
            raise ValueError("GLB's first chunk is not JSON")
        gltf = json.loads(data[20 : 20 + json_length])
        binary = b""
        offset = 20 + json_length
        if offset < len(data):
            bin_length, kind = struct.unpack_from("<II", data, offset)
            if kind != BIN_CHUNK:
                raise ValueError("GLB's second chunk is not BIN")
            binary = data[offset + 8 : offset + 8 + bin_length]
        return cls(gltf, binary)

    def pack(self) -> bytes:
        """The GLB's bytes: the JSON padded with spaces, the BIN with zeros, to 4-byte boundaries."""
        text = json.dumps(self.gltf, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 4)
        binary = self.binary + b"\0" * (-len(self.binary) % 4)
        chunks = struct.pack("<II", len(text), JSON_CHUNK) + text
        if binary:
            chunks += struct.pack("<II", len(binary), BIN_CHUNK) + binary
        return struct.pack("<III", GLB_MAGIC, 2, 12 + len(chunks)) + chunks

    def view_bytes(self, view: dict) -> bytes:
        """The bytes of a bufferView of buffer 0 (the BIN chunk)."""
        start = view.get("byteOffset", 0)
        return self.binary[start : start + view["byteLength"]]


def _rename_tangents(gltf: dict) -> None:
    for mesh in gltf.get("meshes", []):
        for primitive in mesh["primitives"]:
            attributes = primitive["attributes"]
            if "_TANGENT" in attributes:
                attributes["TANGENT"] = attributes.pop("_TANGENT")


def _share_occlusion(gltf: dict) -> None:
    for material in gltf.get("materials", []):
        texture = material.get("pbrMetallicRoughness", {}).get("metallicRoughnessTexture")
        if texture is not None:
            material["occlusionTexture"] = {"index": texture["index"]}


def _compress_meshopt(glb: Glb) -> Glb:
    """Every primitive's vertex attributes (mode ATTRIBUTES) and indices (mode TRIANGLES) through meshoptimizer."""
    try:
        import meshoptimizer
    except ImportError:
        raise ValueError("compression 'meshopt' needs the meshoptimizer package: pip install "
                         "'pixal3d-staged[compress]' (or export without --compression)") from None

    gltf = glb.gltf
    accessors, views = gltf["accessors"], gltf["bufferViews"]
    geometry: dict[int, tuple[str, int, int, int]] = {}  # view → (mode, count, stride, vertex count)
    for mesh in gltf.get("meshes", []):
        for primitive in mesh["primitives"]:
            vertex_count = accessors[primitive["attributes"]["POSITION"]]["count"]
            for a in primitive["attributes"].values():
                acc = accessors[a]
                stride = COMPONENT_BYTES[acc["componentType"]] * TYPE_COUNT[acc["type"]]
                geometry[acc["bufferView"]] = ("ATTRIBUTES", acc["count"], stride, vertex_count)
            if "indices" in primitive:
                acc = accessors[primitive["indices"]]
                geometry[acc["bufferView"]] = ("TRIANGLES", acc["count"], COMPONENT_BYTES[acc["componentType"]],
                                               vertex_count)
    out = bytearray()
    fallback_length = 0
    for i, view in enumerate(views):
        raw = glb.view_bytes(view)
        out += b"\0" * (-len(out) % 4)
        if i not in geometry:
            view["byteOffset"] = len(out)
            out += raw
            continue
        mode, count, stride, vertex_count = geometry[i]
        if mode == "ATTRIBUTES":
            if stride % 4:
                raise ValueError(f"bufferView {i}: a meshopt attribute stride must be a multiple of 4, got {stride}")
            packed = meshoptimizer.encode_vertex_buffer(np.frombuffer(raw, np.uint8).reshape(count, stride),
                                                        count, stride)
        else:
            dtype = np.uint32 if stride == 4 else np.uint16
            packed = meshoptimizer.encode_index_buffer(np.frombuffer(raw, dtype).astype(np.uint32), count,
                                                       vertex_count)
        extension = {"buffer": 0, "byteOffset": len(out), "byteLength": len(packed), "byteStride": stride,
                     "count": count, "mode": mode}
        out += packed
        fallback_length += -fallback_length % 4
        view.update(buffer=1, byteOffset=fallback_length)
        view.setdefault("extensions", {})[MESHOPT] = extension
        fallback_length += view["byteLength"]
    gltf["buffers"] = [{"byteLength": len(out)},
                       {"byteLength": fallback_length, "extensions": {MESHOPT: {"fallback": True}}}]
    for key in ("extensionsUsed", "extensionsRequired"):
        gltf[key] = sorted({*gltf.get(key, []), MESHOPT})
    return Glb(gltf, bytes(out))


def decompress_meshopt(glb: Glb) -> dict[int, bytes]:
    """The uncompressed bytes of every meshopt-compressed bufferView (view index → bytes): how a reader loads
    the geometry back (the tests' check that a compressed file decodes to the same mesh)."""
    import meshoptimizer

    out = {}
    for i, view in enumerate(glb.gltf["bufferViews"]):
        ext = view.get("extensions", {}).get(MESHOPT)
        if ext is None:
            continue
        data = glb.binary[ext["byteOffset"] : ext["byteOffset"] + ext["byteLength"]]
        if ext["mode"] == "ATTRIBUTES":
            # one opaque element per vertex: the binding allocates ``count`` elements of ``dtype``
            decoded = meshoptimizer.decode_vertex_buffer(ext["count"], ext["byteStride"], data,
                                                         dtype=np.dtype((np.void, ext["byteStride"])))
        else:
            decoded = meshoptimizer.decode_index_buffer(ext["count"], ext["byteStride"], data)
        out[i] = np.ascontiguousarray(decoded).tobytes()
    return out


def uncompressed(data: bytes) -> bytes:
    """A GLB without ``EXT_meshopt_compression``: the geometry decoded back into buffer 0 (``data`` itself when
    nothing is compressed), for readers that do not know the extension (trimesh)."""
    glb = Glb.parse(data)
    if MESHOPT not in glb.gltf.get("extensionsUsed", []):
        return data
    decoded = decompress_meshopt(glb)
    out = bytearray()
    for i, view in enumerate(glb.gltf["bufferViews"]):
        raw = decoded[i] if i in decoded else glb.view_bytes(view)
        out += b"\0" * (-len(out) % 4)
        view.pop("extensions", None)
        view.update(buffer=0, byteOffset=len(out), byteLength=len(raw))
        out += raw
    glb.gltf["buffers"] = [{"byteLength": len(out)}]
    for key in ("extensionsUsed", "extensionsRequired"):
        rest = [e for e in glb.gltf.get(key, []) if e != MESHOPT]
        if rest:
            glb.gltf[key] = rest
        else:
            glb.gltf.pop(key, None)
    return Glb(glb.gltf, bytes(out)).pack()


def finish(data: bytes, *, occlusion: bool, compression: str | None) -> bytes:
    """trimesh's GLB with TANGENT named, the occlusion texture shared (``occlusion``) and, with ``compression``,
    its geometry compressed."""
    glb = Glb.parse(data)
    _rename_tangents(glb.gltf)
    if occlusion:
        _share_occlusion(glb.gltf)
    if compression == "meshopt":
        glb = _compress_meshopt(glb)
    elif compression is not None:
        raise ValueError(f"compression must be 'meshopt' or None, got {compression!r}")
    return glb.pack()
