"""The export's parallel and reordered work gives what the serial, in-order work gives.

The UDF's queries run in Z order and scatter back; the tiled QEM's slabs run in worker processes; the bake's texel
chunks run on threads in Z order. Each is compared with the serial path on the same input, with a control that the
comparison sees a difference where there is one.
"""
import os

import numpy as np
import pytest

from pixal3d.mesh import bake
from pixal3d.mesh.cleanup import clean_mesh, edge_statistics
from pixal3d.mesh.distance import SurfaceDistance, z_order
from pixal3d.mesh.dual_grid import dual_grid_to_mesh
from pixal3d.mesh.export import ExportSettings, export_mesh
from pixal3d.mesh.isolated import can_isolate
from pixal3d.mesh.simplify import tiled_quadric_simplify
from pixal3d.mesh.synthetic import pbr_from_function, sdf_dual_grid, sphere_sdf

RES = 64


@pytest.fixture(scope="module")
def sphere():
    v, f = dual_grid_to_mesh(sdf_dual_grid(sphere_sdf((0, 0, 0), 0.3), RES))
    return clean_mesh(v, f, max_hole_perimeter=3e-2, min_component_area=1e-5)


def _morton(x: int, y: int, z: int, bits: int) -> int:
    """Bit by bit, in plain Python: x's bit b at 3b, y's at 3b + 1, z's at 3b + 2."""
    return sum(((c >> b) & 1) << (3 * b + a) for b in range(bits) for a, c in enumerate((x, y, z)))


def test_z_order_is_a_permutation_along_the_morton_curve():
    rng = np.random.default_rng(0)
    points = rng.random((3000, 3))
    order = z_order(points, bits=4)
    assert np.array_equal(np.sort(order), np.arange(len(points)))
    lo, hi = points.min(0), points.max(0)
    cells = np.minimum(((points - lo) / (hi - lo) * 16).astype(int), 15)
    keys = np.array([_morton(*c, bits=4) for c in cells[order]])
    assert np.all(np.diff(keys) >= 0)
    # control: the keys of the input order are not sorted, so the check above can fail
    assert np.any(np.diff([_morton(*c, bits=4) for c in cells]) < 0)


def test_distances_do_not_depend_on_the_order_of_the_queries(sphere):
    v, f = sphere
    dist = SurfaceDistance(v, f, threads=2)
    rng = np.random.default_rng(1)
    points = rng.uniform(-0.4, 0.4, (70_000, 3))  # three chunks of queries, on two threads
    perm = rng.permutation(len(points))
    d = dist.distance(points)
    assert np.array_equal(dist.distance(points[perm]), d[perm])
    for chunk in (1 << 16, 1 << 12):  # nor on the chunk size
        assert np.array_equal(dist.distance(points, chunk=chunk), d)
    # control: the values differ point to point, so a scatter to the wrong rows would show
    radius = np.abs(np.linalg.norm(points, axis=1) - 0.3)
    assert np.abs(d - radius).max() < 1.0 / RES and np.std(d) > 0.05


@pytest.mark.skipif(not can_isolate(), reason="the slabs run in forked processes only where forking is safe (Linux)")
def test_slabs_on_any_number_of_processes_give_the_serial_result(sphere):
    """The slabs come from the mesh and ``max_tile_faces`` alone (SLAB_SHARE), not the worker count: one worker
    (the slabs one at a time, here), two and three give the same mesh bit for bit, as 1-, 2- and 4-core machines."""
    v, f = sphere
    tile = -(-len(f) // 2)  # 4 slabs of tile // SLAB_SHARE faces
    serial = tiled_quadric_simplify(v, f, 3000, max_tile_faces=tile, workers=1)
    for workers in (2, 3):
        parallel = tiled_quadric_simplify(v, f, 3000, max_tile_faces=tile, workers=workers)
        assert np.array_equal(serial[0], parallel[0]) and np.array_equal(serial[1], parallel[1]), workers
    stats = edge_statistics(serial[1])
    assert stats["boundary"] == 0 and stats["non_manifold"] == 0
    # control: the result does depend on the number of slabs, so the comparison above can fail
    fewer = tiled_quadric_simplify(v, f, 3000, max_tile_faces=2 * tile, workers=1)  # 2 slabs
    assert len(fewer[0]) != len(serial[0]) or not np.array_equal(fewer[0], serial[0])


def _grey_ramp(p):
    out = np.empty((len(p), 6))
    out[:, 0:3] = 0.5 + 0.4 * np.sin(9 * p)
    out[:, 3:5] = 0.5
    out[:, 5] = 1.0
    return out


def test_texel_chunks_on_threads_bake_the_serial_images(monkeypatch):
    fields = sdf_dual_grid(sphere_sdf((0.0, 0.0, 0.0), 0.35), RES)
    pbr = pbr_from_function(fields, _grey_ramp)
    settings = ExportSettings(decimation_target=2000, texture_size=256, quality_samples=0)

    def images(threads: int, chunk: int):
        monkeypatch.setattr(bake, "TEXEL_CHUNK", chunk)
        monkeypatch.setattr(os, "cpu_count", lambda: threads)
        m = export_mesh(fields, pbr, settings=settings, progress=False).mesh.visual.material
        return [np.asarray(img) for img in (m.baseColorTexture, m.metallicRoughnessTexture, m.normalTexture)]

    serial, threaded = images(1, 1 << 19), images(4, 1 << 14)  # one chunk; ~8 chunks of 4096 texels, 4 threads
    for a, b in zip(serial, threaded, strict=True):
        assert np.array_equal(a, b)
    assert serial[0][..., :3].std() > 10  # control: a textured atlas (a misplaced texel would change it)
