"""The bake onto a user's mesh (``--mesh``): its vertices and faces as given, its UVs when it has them.

TRELLIS.2's ``Trellis2TexturingPipeline.postprocess_mesh``: the mesh's UVs kept (else an atlas is made, its vertices
split at the seams only), every texel placed on the mesh and the decoded PBR voxels sampled there (the reference's
``grid_sample_3d``; here the export's own baker, ``bake_textures``, without the projection onto a decoded surface:
the user's mesh is the surface), the gutters filled, a GLB with one PBR material. The mesh is placed in the grid by
the run's ``MeshPose`` for sampling only; the file holds the user's own coordinates. Overlapping UVs (a mirrored or
tiled layout) share texels: the last face baked wins there. No normal or occlusion map is baked (there is no finer
surface than the user's mesh to bake a normal map from).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .export import _Steps, _unwrap
from .fields import PbrVoxels
from .glb import build_mesh, encode_glb, vertex_normals
from .records import ExportedMesh, ExportReport
from .settings import ExportSettings
from .sparse_index import SparseIndex
from .user_mesh import MeshPose, UserMesh
from .uv import UvMesh

ONTO_STEPS = ("uv", "bake", "glb")


def export_onto(mesh: UserMesh, pose: MeshPose, pbr: PbrVoxels, *,
                settings: ExportSettings = ExportSettings(),  # noqa: B008 - frozen: one shared default is safe
                progress: bool = True, on_step: Callable[[str], None] | None = None) -> ExportedMesh:
    """The user's mesh textured from ``pbr``, in memory (see the module's docstring)."""
    steps = _Steps(on_step, progress, False, ONTO_STEPS)
    v = mesh.vertices
    normals, uv = steps.run("uv", _uvs, mesh, settings)
    tex = steps.run("bake", _bake, pose.apply(v), uv, pbr, settings)
    built, data = steps.run("glb", _glb, v, normals, uv, tex, settings)
    steps.bar.close()
    report = ExportReport(steps=steps.reports, vertices=len(uv.uvs), faces=len(uv.faces),
                          texture_size=settings.texture_size, coverage=tex.coverage, file_bytes=len(data))
    return ExportedMesh(built, data, report)


def _uvs(mesh: UserMesh, settings: ExportSettings):
    if mesh.uvs is not None:
        uv = UvMesh(vertex_map=np.arange(len(mesh.vertices)), faces=mesh.faces.astype(np.int32), uvs=mesh.uvs,
                    atlas_size=(settings.texture_size, settings.texture_size), chart_count=0)
        return (vertex_normals(mesh.vertices, mesh.faces), uv), {"kept": True, "uv_vertices": len(mesh.uvs)}
    (normals, uv), detail = _unwrap(mesh.vertices, mesh.faces, settings)
    return (normals, uv), {"kept": False, **detail}


def _bake(placed: np.ndarray, uv: UvMesh, pbr: PbrVoxels, settings: ExportSettings):
    from .bake import bake_textures

    index = SparseIndex(pbr.coords.detach().cpu().numpy(), pbr.resolution, brick=4)  # as the export's bake
    attrs = pbr.attrs.detach().cpu().numpy().astype(np.float32, copy=False)
    tex = bake_textures(placed, uv.faces, uv.uvs, uv.vertex_map, None, index, attrs, pbr.resolution,
                        settings.texture_size)
    return tex, {"coverage": round(tex.coverage, 3)}


def _glb(v: np.ndarray, normals: np.ndarray, uv: UvMesh, tex, settings: ExportSettings):
    built = build_mesh(v[uv.vertex_map], uv.faces, normals[uv.vertex_map], uv.uvs, tex.base_color_rgba,
                       tex.metallic_roughness, alpha_mode=settings.alpha_mode)
    data = encode_glb(built, texture_format=settings.texture_format, compression=settings.compression)
    return (built, data), {"bytes": len(data), "format": settings.texture_format}
