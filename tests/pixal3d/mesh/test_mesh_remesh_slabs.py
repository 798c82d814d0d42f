"""The remesh slab by slab (remesh_slabs.py): one slab is the whole remesh, bit for bit; cut slabs stitch back into
exactly its triangles; with the pre-pass, the closed contour stays closed and lands near its face budget."""
import os
import sys
from itertools import pairwise

import numpy as np
import pytest

from pixal3d.mesh.cleanup import edge_statistics
from pixal3d.mesh.distance import SurfaceDistance
from pixal3d.mesh.dual_grid import dual_grid_to_mesh
from pixal3d.mesh.isolated import can_isolate
from pixal3d.mesh.narrow_band import RemeshGrid, band_parents
from pixal3d.mesh.remesh import remesh
from pixal3d.mesh.remesh_slabs import remesh_presimplified, slab_bounds, slab_mesh
from pixal3d.mesh.synthetic import blobby_sdf, sdf_dual_grid

RES = 128


@pytest.fixture(scope="module")
def blob():
    v, f = dual_grid_to_mesh(sdf_dual_grid(blobby_sdf(1.0, 0), RES, project=False))
    return v, f, remesh(v, f, resolution=RES)


def _triangles(v, f):
    """Each triangle as its sorted corner positions (a set that does not depend on vertex or face order)."""
    corners = v[f].reshape(len(f), 3, 3)
    return {tuple(sorted(map(tuple, t))) for t in corners.tolist()}


def test_one_slab_is_the_whole_remesh_bit_for_bit(blob):
    v, f, (rv, rf) = blob
    (sv, sf), detail = remesh_presimplified(v, f, resolution=RES, target=10 * len(rf))
    assert detail["slabs"] == 1 and not detail["presimplified"]
    assert np.array_equal(sv, rv) and np.array_equal(sf, rf)


def test_cut_slabs_stitch_into_the_whole_remesh(blob):
    v, f, (rv, rf) = blob
    udf, grid = SurfaceDistance(v, f), RemeshGrid(RES)
    parents, _ = band_parents(udf, grid)
    bounds = slab_bounds(parents, 5)
    assert len(bounds) == 5 and bounds[0][0] == parents[0, 0] and bounds[-1][1] == parents[-1, 0] + 1
    assert all(a[1] == b[0] for a, b in pairwise(bounds))  # consecutive, no plane twice or left out
    parts = [slab_mesh(udf, grid, parents, b) for b in bounds]
    cut = sum(len(p[0]) for p in parts) - len(rv)
    assert cut > 0  # the cuts' vertices are in two slabs each ...
    stitched = np.unique(np.concatenate([p[0] for p in parts]), axis=0)
    assert len(stitched) == len(rv)  # ... at bit-identical positions
    got = set().union(*(_triangles(*p) for p in parts))
    assert sum(len(p[1]) for p in parts) == len(rf) and got == _triangles(rv, rf)
    # control: a slab left out loses its triangles, so the comparison can fail
    assert set().union(*(_triangles(*p) for p in parts[:-1])) != _triangles(rv, rf)


@pytest.mark.skipif(not can_isolate(), reason="the slabs run in forked processes only where forking is safe (Linux)")
@pytest.mark.parametrize("workers", [1, 2])
def test_presimplified_slabs_stay_closed_near_the_prepass_budget(blob, workers):
    v, f, (rv, rf) = blob
    target = len(rf) // 12
    (sv, sf), detail = remesh_presimplified(v, f, resolution=RES, target=target, max_tile_faces=len(rf) // 3,
                                            workers=workers)
    assert detail["presimplified"] and detail["slabs"] >= 3
    assert abs(len(sf) - 3 * target) < 0.05 * 3 * target
    stats = edge_statistics(sf)
    # closed; non-manifold only where the contour already was (its two sheets touch at a few edges of this shape)
    assert stats["boundary"] == 0 and stats["non_manifold"] <= edge_statistics(rf)["non_manifold"]
    d = SurfaceDistance(rv, rf).distance(sv)
    assert d.max() < 1.5 / RES  # the pre-pass keeps to the contour


@pytest.mark.skipif(not can_isolate(), reason="the slabs run in forked processes only where forking is safe (Linux)")
def test_presimplified_mesh_does_not_depend_on_how_many_workers_run(blob):
    """The slab cuts come from the contour's size alone (SLAB_SHARE, not the worker count): 1, 2 and 3 workers give
    the same mesh bit for bit, as a 1-, 2- or 4-core machine would."""
    v, f, (_, rf) = blob
    target, tile = len(rf) // 12, len(rf) // 3

    def run(workers, max_tile_faces=tile):
        return remesh_presimplified(v, f, resolution=RES, target=target, max_tile_faces=max_tile_faces,
                                    workers=workers)

    (v1, f1), d1 = run(1)
    for workers in (2, 3):
        (vw, fw), dw = run(workers)
        assert dw["slabs"] == d1["slabs"] and np.array_equal(vw, v1) and np.array_equal(fw, f1), workers
    # control: other cuts (smaller slabs) give another pre-pass mesh, so the comparison can fail
    (vc, fc), dc = run(1, max_tile_faces=tile // 3)
    assert dc["slabs"] != d1["slabs"] and not (len(fc) == len(f1) and np.array_equal(fc, f1) and np.array_equal(vc, v1))


_PID_LOG: list = []  # [path, the real slab job] while the test below runs (read in the forked children)


def _logged_slab_job(item):
    path, job = _PID_LOG
    with open(path, "a") as out:
        out.write(f"{os.getpid()}\n")
    return job(item)


@pytest.mark.skipif(not can_isolate(), reason="the slabs run in forked processes only where forking is safe (Linux)")
def test_with_one_worker_each_slab_runs_in_a_child_of_its_own(blob, tmp_path, monkeypatch):
    """One worker (what the plan sets under a tight budget): each slab in a fresh forked child, so the quadric
    simplifier's buffers, which it keeps until its process exits, and the slab's heap go when the slab ends; the
    process pool of several workers reuses its processes (the control: the pids tell the two apart)."""
    from pixal3d.mesh import remesh_slabs

    v, f, (_, rf) = blob
    log = tmp_path / "pids"
    monkeypatch.setattr(sys.modules[__name__], "_PID_LOG", [log, remesh_slabs._slab_job])
    monkeypatch.setattr(remesh_slabs, "_slab_job", _logged_slab_job)

    def pids(workers):
        log.write_text("")
        (_, _), detail = remesh_presimplified(v, f, resolution=RES, target=len(rf) // 12,
                                              max_tile_faces=len(rf) // 3, workers=workers)
        seen = [int(p) for p in log.read_text().split()]
        assert len(seen) == detail["slabs"] >= 4
        return seen

    one = pids(1)
    assert len(set(one)) == len(one) and os.getpid() not in one
    two = pids(2)
    assert len(set(two)) <= 2 < len(two) and os.getpid() not in two
