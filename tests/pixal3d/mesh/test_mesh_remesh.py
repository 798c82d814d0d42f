"""Narrow-band UDF dual contouring: shells, offset distance, orientation, exterior flood fill, slabs."""
import numpy as np
import pytest

from pixal3d.mesh import narrow_band as narrow_band_module
from pixal3d.mesh.cleanup import edge_statistics
from pixal3d.mesh.distance import SurfaceDistance
from pixal3d.mesh.dual_grid import dual_grid_to_mesh
from pixal3d.mesh.narrow_band import RemeshGrid
from pixal3d.mesh.quality import count_components
from pixal3d.mesh.remesh import remesh
from pixal3d.mesh.synthetic import sdf_dual_grid, sphere_sdf

CENTRE = np.array([0.013, -0.021, 0.007])
RADIUS = 0.3
RES = 64


def _components(v, f):
    """Per component: (faces, mean radius about CENTRE, signed volume)."""
    from pixal3d.mesh.cleanup import _vertex_components

    label = _vertex_components(len(v), f)[f[:, 0]]
    out = []
    for c in np.unique(label):
        p = v[f[label == c]].astype(np.float64) - CENTRE
        volume = np.einsum("ij,ij->i", p[:, 0], np.cross(p[:, 1], p[:, 2])).sum() / 6
        out.append((f[label == c], np.linalg.norm(p.mean(1), axis=1).mean(), volume))
    return sorted(out, key=lambda t: -t[1])


@pytest.fixture(scope="module")
def holey_sphere():
    """The decoded sphere at R = 64 with a hole about 2 voxels across (narrower than the 2·eps band)."""
    v, f = dual_grid_to_mesh(sdf_dual_grid(sphere_sdf(CENTRE, RADIUS), RES))
    top = CENTRE + [0, 0, RADIUS]
    f = f[np.linalg.norm(v[f].mean(1) - top, axis=1) > 1.2 / RES]
    assert edge_statistics(f)["boundary"] > 0
    return v, f


@pytest.fixture(scope="module")
def shells(holey_sphere):
    v, f = holey_sphere
    return remesh(v, f, resolution=RES), remesh(v, f, resolution=RES, exterior_only=True)


def _closed_manifold(f):
    stats = edge_statistics(f)
    return stats["boundary"] == 0 and stats["non_manifold"] == 0 and stats["inconsistent"] == 0


def test_sphere_with_a_hole_gives_two_closed_shells_and_exterior_only_one(shells):
    (v2, f2), (v1, f1) = shells
    assert count_components(len(v2), f2) == 2 and _closed_manifold(f2)
    assert count_components(len(v1), f1) == 1 and _closed_manifold(f1)
    (_, outer, _), (_, inner, _) = _components(v2, f2)
    eps = RemeshGrid(RES).eps
    assert outer == pytest.approx(RADIUS + eps, abs=0.25 / RES) and inner == pytest.approx(RADIUS - eps, abs=0.3 / RES)
    assert _components(v1, f1)[0][1] == pytest.approx(outer, abs=1e-6)  # the exterior shell is the outer one


def test_exterior_shell_lies_one_band_from_the_input(holey_sphere, shells):
    v, f = holey_sphere
    _, (v1, f1) = shells
    grid = RemeshGrid(RES)
    d = SurfaceDistance(v, f).distance(v1)
    # every vertex within a quarter cell of the offset distance eps (one cell): within one voxel of the
    # input's offset surface, never on the input itself
    assert np.abs(d - grid.eps).max() < 0.25 * grid.cell
    back = SurfaceDistance(v1, f1).distance(v)  # and the input is covered: no part of it is far from the shell
    assert back.max() < grid.eps + 0.5 * grid.cell


def test_normals_point_away_from_the_band_outward_on_the_outer_shell(shells):
    (v2, f2), (v1, f1) = shells
    (outer_f, _, outer_volume), (inner_f, _, inner_volume) = _components(v2, f2)
    assert outer_volume > 0 > inner_volume  # the inner sheet faces the object's inside

    def facing(v, f):
        p = v[f].astype(np.float64)
        normal = np.cross(p[:, 1] - p[:, 0], p[:, 2] - p[:, 0])
        return np.einsum("ij,ij->i", normal, p.mean(1) - CENTRE)

    assert np.all(facing(v1, f1) > 0)
    assert np.all(facing(v2, outer_f) > 0) and np.all(facing(v2, inner_f) < 0)


def test_a_hole_wider_than_the_band_joins_the_sheets_into_one():
    v, f = dual_grid_to_mesh(sdf_dual_grid(sphere_sdf(CENTRE, RADIUS), RES))
    top = CENTRE + [0, 0, RADIUS]
    f = f[np.linalg.norm(v[f].mean(1) - top, axis=1) > 4 / RES]
    rv, rf = remesh(v, f, resolution=RES)
    assert count_components(len(rv), rf) == 1 and _closed_manifold(rf)
    assert len(remesh(v, f, resolution=RES, exterior_only=True)[1]) == len(rf)  # all of it is exterior


def test_exterior_only_drops_every_enclosed_sheet_of_a_hollow_ball():
    """A ball with a closed cavity (decoded as two closed surfaces): four sheets, one of them outside.
    The cavity's d ≥ 0 corners reach the border only through free cells of several levels."""
    def hollow(p):
        r = np.linalg.norm(p - CENTRE, axis=-1)
        return np.maximum(r - RADIUS, 0.18 - r)

    v, f = dual_grid_to_mesh(sdf_dual_grid(hollow, RES))
    rv, rf = remesh(v, f, resolution=RES)
    assert count_components(len(rv), rf) == 4
    ev, ef = remesh(v, f, resolution=RES, exterior_only=True)
    assert count_components(len(ev), ef) == 1 and _closed_manifold(ef)
    assert _components(ev, ef)[0][1] == pytest.approx(RADIUS + RemeshGrid(RES).eps, abs=0.25 / RES)


def test_many_thin_slabs_give_the_same_mesh_as_one(holey_sphere, monkeypatch):
    v, f = holey_sphere
    whole = remesh(v, f, resolution=RES, exterior_only=True)
    monkeypatch.setattr(narrow_band_module, "SLAB_CELLS", 3 * (RES + 1) ** 2)  # one parent plane per slab
    sliced = remesh(v, f, resolution=RES, exterior_only=True)
    assert np.array_equal(whole[0], sliced[0]) and np.array_equal(whole[1], sliced[1])


@pytest.mark.parametrize("resolution, match", [(63, "even"), (66, "halve evenly")])
def test_grid_rejects_resolutions_it_cannot_refine(resolution, match):
    with pytest.raises(ValueError, match=match):
        RemeshGrid(resolution)
