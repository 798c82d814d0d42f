"""From decoder outputs to a textured GLB, on CPU, in bounded memory.

``export_mesh`` keeps everything in memory (``ExportedMesh``: the textured mesh, its GLB bytes, the
report); ``export_glb`` also writes the file. Steps (each timed, with its peak RSS): 1. dual grid → raw
mesh; 2. reference surface (degenerate and duplicate faces out, small holes filled) — the surface every
texel is projected onto; 3. optional remesh (narrow-band UDF dual contouring, the reference's release
setting; slab by slab in a child process, ``settings.workers`` of them at once); 4. simplify to the face budget (in a child process where it can: ``isolated.py``); 5. cleanup
(+ outward orientation without remesh; the remesh is oriented already; a printable mesh is checked closed);
6. normals + UV atlas; 7. quality metrics against the reference surface; 8. the shading maps' inputs (tangent
frames, per-vertex occlusion, the decoded surface's normal field: ``maps.py``); 9. bake; 10. GLB encoding (+ STL
and 3MF for a printable mesh). The metrics run before the maps and the bake, and the bake takes the reference
surface over, so that the largest structures of those steps never coexist (benchmarks/export_speed.md#memory). ``export_shape``: a shape-only run's steps 1-5, normals and an untextured GLB
(``SHAPE_STEPS``), the same mesh as ``export_mesh`` makes before its atlas.
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from pixal3d.staging.stream import release_freed_heap

from .bake import (
    BakedTextures,
    SurfaceMaps,
    SurfaceProjector,
    bake_texels,
    finish_textures,
    rasterize_atlas,
)
from .cleanup import (
    clean_mesh,
    fill_small_holes,
    remove_degenerate_faces,
    remove_duplicate_faces,
    remove_face_pairs,
    remove_unreferenced_vertices,
)
from .distance import SurfaceDistance
from .dual_grid import dual_grid_to_mesh
from .fields import DualGridFields, PbrVoxels
from .glb import build_mesh, build_plain_mesh, encode_glb, vertex_normals
from .isolated import run_isolated
from .narrow_band import RemeshGrid
from .quality import mesh_quality
from .records import ExportedMesh, ExportReport, StepReport
from .remesh import remesh
from .remesh_slabs import remesh_presimplified
from .rss import PeakRss
from .settings import ExportSettings
from .simplify import simplify_mesh
from .sparse_index import SparseIndex
from .uv import UvMesh, uv_unwrap

log = logging.getLogger(__name__)

STEPS = ("extract", "reference", "remesh", "simplify", "cleanup", "uv", "quality", "maps", "bake", "glb")
SHAPE_STEPS = ("extract", "reference", "remesh", "simplify", "cleanup", "normals", "glb")


class _Steps:
    """Runs named steps, timing each and recording its peak RSS; tells ``on_step`` when each starts."""

    def __init__(self, on_step: Callable[[str], None] | None, progress: bool, exact_rss: bool,
                 steps: tuple[str, ...] = STEPS) -> None:
        self.reports: list[StepReport] = []
        self.on_step = on_step
        self.exact_rss = exact_rss
        self.bar = tqdm(total=len(steps), desc="export", disable=not progress)

    def run(self, name: str, fn: Callable[..., tuple], *args):
        """``fn(*args)`` returns ``(result, detail)``; records the step and returns ``result``."""
        if self.on_step is not None:
            self.on_step(name)
        self.bar.set_postfix_str(name)
        gc.collect()
        release_freed_heap()  # what the last step freed leaves this step's RSS (glibc malloc_trim)
        start = time.perf_counter()
        with PeakRss(exact=self.exact_rss) as rss:
            result, detail = fn(*args)
        self.reports.append(StepReport(name, time.perf_counter() - start, rss.peak, detail))
        log.info("export %s: %.2f s, peak %.2f GiB, %s", name, self.reports[-1].seconds, rss.peak / 2**30, detail)
        self.bar.update(1)
        return result


def _check_inputs(fields: DualGridFields, pbr: PbrVoxels) -> None:
    if fields.resolution != pbr.resolution:
        raise ValueError(
            f"shape resolution {fields.resolution} != texture resolution {pbr.resolution}: "
            "decode both latents at the same resolution"
        )
    if pbr.attrs.ndim != 2 or pbr.attrs.shape[1] != 6 or pbr.attrs.shape[0] != pbr.coords.shape[0]:
        raise ValueError(f"PbrVoxels.attrs must be [M, 6] matching coords [M, 3], got {tuple(pbr.attrs.shape)}")
    _check_fields(fields)


def _check_fields(fields: DualGridFields) -> None:
    if len(fields.coords) == 0:
        raise ValueError("the shape decoder produced no voxels: nothing to export")


def _extract(fields: DualGridFields):
    v, f = dual_grid_to_mesh(fields)
    return (v, f), {"vertices": len(v), "faces": len(f)}


def _reference(raw: list, settings: ExportSettings):
    v, f = raw.pop()  # handed over: the raw mesh lives only until its cleaned copy replaces it (0.3 GB at 9M voxels)
    voxels = len(v)  # the raw mesh has one vertex per decoded voxel, in the voxels' order
    f = remove_duplicate_faces(remove_degenerate_faces(v, f))
    v, f = fill_small_holes(v, f, settings.max_hole_perimeter)
    v, f, kept = remove_unreferenced_vertices(v, f)
    voxel_of_vertex = kept[kept < voxels].astype(np.int32)  # the first len(...) vertices are voxels' (normal map)
    return (v, f, voxel_of_vertex), {"vertices": len(v), "faces": len(f)}


def _remesh_grid(settings: ExportSettings, decode_resolution: int) -> RemeshGrid:
    return RemeshGrid(settings.remesh_resolution or decode_resolution, settings.remesh_band)


def _remesh(v: np.ndarray, f: np.ndarray, settings: ExportSettings, decode_resolution: int):
    if not settings.remesh:
        return (v, f), {"enabled": False}
    grid = _remesh_grid(settings, decode_resolution)
    detail = {}
    if settings.exterior_only:  # the exterior flood fill wants the whole band at once
        v, f = remesh(v, f, resolution=grid.resolution, band=grid.band, exterior_only=True)
    else:  # slab by slab, with the simplifier's pre-pass where the contour is large (remesh_slabs.py); in a child
        # process where it can: its distance index and slabs (~1.5 GB at 9M voxels with one worker) leave this
        # process's heap fragmented for the later steps (+0.3 GiB in each, measured) when they run here
        (v, f), detail = run_isolated(functools.partial(
            remesh_presimplified, resolution=grid.resolution, band=grid.band, target=settings.decimation_target,
            workers=settings.workers), v, f)
    if len(f) == 0:
        raise ValueError("the remesh found no surface: the decoded shape is empty or degenerate")
    return (v, f), {"vertices": len(v), "faces": len(f), "resolution": grid.resolution,
                    "exterior_only": settings.exterior_only} | detail


def _simplify(v: np.ndarray, f: np.ndarray, settings: ExportSettings, resolution: int):
    # in a child process: the quadric simplifier keeps ~1 GB of buffers at 20-40M faces until its process exits
    v, f = run_isolated(functools.partial(simplify_mesh, voxel_size=1.0 / resolution, workers=settings.workers), v, f,
                        settings.decimation_target)
    return (v, f), {"faces": len(f)}


def _cleanup(v: np.ndarray, f: np.ndarray, settings: ExportSettings):
    if settings.remesh:  # the contour is closed and oriented (the reference does nothing here)
        f = remove_face_pairs(f)  # bubbles QEM squeezed flat; removing one side would open a hole
        v, f, _ = remove_unreferenced_vertices(v, f)
    else:
        v, f = clean_mesh(v, f, max_hole_perimeter=settings.max_hole_perimeter,
                          min_component_area=settings.min_component_area)
    if len(f) == 0:
        raise ValueError("no faces left after cleanup: the decoded shape is only tiny fragments")
    detail = {"vertices": len(v), "faces": len(f)}
    if settings.printable:
        from .printable import check_printable

        detail["volume"] = round(check_printable(v, f).volume, 6)
    return (v, f), detail


def _unwrap(v: np.ndarray, f: np.ndarray, settings: ExportSettings):
    edge = float(np.linalg.norm(v[f[:, 1]] - v[f[:, 0]], axis=1).mean())
    uv = uv_unwrap(v, f, cell=settings.chart_cell_edges * edge, padding=settings.uv_padding,
                   texture_size=settings.texture_size)
    return (vertex_normals(v, f), uv), {"charts": uv.chart_count, "uv_vertices": len(uv.uvs)}


def _maps(v: np.ndarray, normals: np.ndarray, uv: UvMesh, ref_v: np.ndarray, ref_f: np.ndarray,
          voxel_of_vertex: np.ndarray, fields: DualGridFields, settings: ExportSettings):
    if not (settings.normal_map or settings.occlusion_map):
        return None, {"normal_map": False, "occlusion_map": False}
    import torch

    from .maps import (
        VoxelNormals,
        as_tensor,
        occupancy_grid,
        vertex_occlusion,
        vertex_tangents,
    )

    uv_normals = normals[uv.vertex_map]
    tangents = vertex_tangents(as_tensor(v[uv.vertex_map]), as_tensor(uv_normals), as_tensor(uv.uvs),
                               as_tensor(uv.faces)).numpy()
    voxel_normals = occlusion = None
    coords = fields.coords.detach().cpu().numpy()
    if settings.normal_map:
        voxel_normals = VoxelNormals(ref_v, ref_f, coords[voxel_of_vertex], fields.resolution)
    if settings.occlusion_map:
        grid, _ = occupancy_grid(coords, fields.resolution)
        with torch.no_grad():
            per_vertex = vertex_occlusion(as_tensor(v), as_tensor(normals), grid, rays=settings.occlusion_rays,
                                          distance=settings.occlusion_distance).numpy()
        occlusion = per_vertex[uv.vertex_map]
    detail = {"normal_map": settings.normal_map, "occlusion_map": settings.occlusion_map}
    if occlusion is not None:
        detail["mean_occlusion"] = round(float(occlusion.mean()), 3)
    return SurfaceMaps(uv_normals, tangents, voxel_normals, occlusion), detail


def _bake(v: np.ndarray, uv: UvMesh, reference: list, pbr: PbrVoxels, maps: SurfaceMaps | None,
          settings: ExportSettings):
    ref_v, ref_f = reference  # handed over: once the projector is built, nothing needs the reference surface
    reference.clear()
    raster = rasterize_atlas(uv.uvs, uv.faces, settings.texture_size)  # first: its temporaries before the rest
    release_freed_heap()  # and those temporaries (the atlas-sized images, 0.2 GB at 4096²) given back, not kept
    projector = None
    if settings.projection is not None:
        # The remesh sits remesh_band cells off the reference surface: let the projection cover that too.
        offset = _remesh_grid(settings, pbr.resolution).eps if settings.remesh else 0.0
        projector = SurfaceProjector(ref_v, ref_f, mode=settings.projection, max_shift=2.0 / pbr.resolution + offset)
    del ref_v, ref_f  # the projector keeps what it needs (the vertices; in "exact" mode the faces too)
    release_freed_heap()  # the normals' sums and the tree's build temporaries
    # bricks of 4³: at 9M voxels 201 MiB against 8³'s 282 (a shell fills small bricks better), and faster to build
    # and read; the same rows
    index = SparseIndex(pbr.coords.detach().cpu().numpy(), pbr.resolution, brick=4)
    attrs = pbr.attrs.detach().cpu().numpy().astype(np.float32, copy=False)
    texels = bake_texels(v, uv.faces, uv.uvs, uv.vertex_map, projector, index, attrs, pbr.resolution,
                         settings.texture_size, maps=maps, raster=raster)
    del raster, projector, index, attrs  # the gutter fill needs none of them (~0.6 GB at 9M voxels)
    tex = finish_textures(texels)
    return tex, {"coverage": round(tex.coverage, 3)}


def _quality(v: np.ndarray, f: np.ndarray, uv: UvMesh, ref_v: np.ndarray, ref_f: np.ndarray, resolution: int,
             settings: ExportSettings):
    if settings.quality_samples == 0:
        return {}, {"enabled": False}
    quality = mesh_quality(v, f, uv.faces, len(uv.uvs), SurfaceDistance(ref_v, ref_f), resolution,
                           samples=settings.quality_samples).to_dict()
    return quality, quality


def _glb(v: np.ndarray, f: np.ndarray, normals: np.ndarray, uv: UvMesh, tex: BakedTextures,
         maps: SurfaceMaps | None, settings: ExportSettings):
    mesh = build_mesh(v[uv.vertex_map], uv.faces, normals[uv.vertex_map], uv.uvs,
                      tex.base_color_rgba, tex.metallic_roughness, alpha_mode=settings.alpha_mode,
                      normal_map=tex.normal, tangents=None if maps is None else maps.tangents)
    data = encode_glb(mesh, texture_format=settings.texture_format, occlusion=tex.occlusion,
                      compression=settings.compression)
    extras = {}
    if settings.printable:
        from .printable import print_files

        extras = print_files(v, f)
    detail = {"bytes": len(data), "format": settings.texture_format, "compression": settings.compression}
    detail |= {suffix.lstrip("."): len(b) for suffix, b in extras.items()}
    return (mesh, data, extras), detail


def _plain_glb(v: np.ndarray, f: np.ndarray, normals: np.ndarray, settings: ExportSettings):
    mesh = build_plain_mesh(v, f, normals)
    data = encode_glb(mesh, compression=settings.compression)
    extras = {}
    if settings.printable:
        from .printable import print_files

        extras = print_files(v, f)
    detail = {"bytes": len(data), "compression": settings.compression, "textured": False}
    detail |= {suffix.lstrip("."): len(b) for suffix, b in extras.items()}
    return (mesh, data, extras), detail


def export_glb(fields: DualGridFields, pbr: PbrVoxels, path: str | Path, **kwargs) -> ExportReport:
    """``export_mesh`` (same keyword arguments), then write the GLB to ``path`` atomically."""
    exported = export_mesh(fields, pbr, **kwargs)
    exported.save(path)
    exported.report.path = str(path)
    return exported.report


def export_mesh(
    fields: DualGridFields,
    pbr: PbrVoxels,
    *,
    settings: ExportSettings = ExportSettings(),  # noqa: B008 - frozen: one shared default is safe
    progress: bool = True,
    on_step: Callable[[str], None] | None = None,
    exact_peak_rss: bool = False,
) -> ExportedMesh:
    """Mesh, simplify, unwrap, bake and encode as GLB, in memory; returns the mesh, bytes and report.

    ``on_step(name)`` is called as each step in ``STEPS`` starts (telemetry sub-windows).
    ``exact_peak_rss`` measures each step's peak with the kernel's high-water mark instead of
    sampling; it resets that mark process-wide (see ``pixal3d.mesh.rss``), so keep it for benchmarks.
    """
    _check_inputs(fields, pbr)
    steps = _Steps(on_step, progress, exact_peak_rss)
    # 1-2. raw dual-grid mesh → the reference surface that texels are projected onto
    raw = [steps.run("extract", _extract, fields)]
    ref_v, ref_f, voxel_of_vertex = steps.run("reference", _reference, raw, settings)
    # 3-5. the output mesh
    v, f = steps.run("remesh", _remesh, ref_v, ref_f, settings, fields.resolution)
    v, f = steps.run("simplify", _simplify, v, f, settings, fields.resolution)
    v, f = steps.run("cleanup", _cleanup, v, f, settings)
    # 6-10. atlas, metrics, textures, file. The metrics come before the maps and the bake so that neither their
    # textures nor the decoded surface's normal field are held beside the metrics' distance index; the bake takes
    # the reference surface over (its faces go once its projector is built).
    normals, uv = steps.run("uv", _unwrap, v, f, settings)
    quality = steps.run("quality", _quality, v, f, uv, ref_v, ref_f, fields.resolution, settings)
    maps = steps.run("maps", _maps, v, normals, uv, ref_v, ref_f, voxel_of_vertex, fields, settings)
    reference = [ref_v, ref_f]
    del ref_v, ref_f, voxel_of_vertex
    tex = steps.run("bake", _bake, v, uv, reference, pbr, maps, settings)
    if maps is not None:  # the decoded surface's normal field (~24 B per voxel) is the bake's alone
        maps = dataclasses.replace(maps, voxel_normals=None)
    mesh, data, extras = steps.run("glb", _glb, v, f, normals, uv, tex, maps, settings)
    steps.bar.close()
    report = ExportReport(steps=steps.reports, vertices=len(uv.uvs), faces=len(uv.faces),
                          texture_size=settings.texture_size, coverage=tex.coverage, file_bytes=len(data),
                          quality=quality)
    return ExportedMesh(mesh, data, report, extras)


def export_shape(
    fields: DualGridFields,
    *,
    settings: ExportSettings = ExportSettings(),  # noqa: B008 - frozen: one shared default is safe
    progress: bool = True,
    on_step: Callable[[str], None] | None = None,
    exact_peak_rss: bool = False,
) -> ExportedMesh:
    """The untextured mesh of a shape-only run, in memory: ``export_mesh``'s steps 1-5 (the same surface, remesh,
    simplification and cleanup), then vertex normals and a GLB with one plain material (``SHAPE_STEPS``). The
    texture settings are not used; the report's ``texture_size`` and ``coverage`` are 0."""
    _check_fields(fields)
    steps = _Steps(on_step, progress, exact_peak_rss, SHAPE_STEPS)
    # 1-5. as export_mesh: raw dual-grid mesh, reference surface, remesh, simplify, cleanup
    raw = [steps.run("extract", _extract, fields)]
    ref_v, ref_f, _ = steps.run("reference", _reference, raw, settings)
    v, f = steps.run("remesh", _remesh, ref_v, ref_f, settings, fields.resolution)
    del ref_v, ref_f
    v, f = steps.run("simplify", _simplify, v, f, settings, fields.resolution)
    v, f = steps.run("cleanup", _cleanup, v, f, settings)
    # 6-7. normals, the file
    normals = steps.run("normals", lambda: (vertex_normals(v, f), {"vertices": len(v)}))
    mesh, data, extras = steps.run("glb", _plain_glb, v, f, normals, settings)
    steps.bar.close()
    report = ExportReport(steps=steps.reports, vertices=len(v), faces=len(f), file_bytes=len(data))
    return ExportedMesh(mesh, data, report, extras)
