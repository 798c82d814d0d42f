"""The voxeliser benchmark's mesh: closed, inside the unit cube, about the asked face count."""
import numpy as np

from pixal3d.mesh.cleanup import edge_statistics
from scripts.bench_voxelize import bumpy_torus


def test_bumpy_torus_is_a_closed_manifold_inside_the_cube_with_the_asked_faces():
    v, f = bumpy_torus(20_000)
    assert abs(len(f) - 20_000) < 200
    assert np.abs(v).max() < 0.5
    stats = edge_statistics(f)
    assert stats["boundary"] == 0 and stats["non_manifold"] == 0 and stats["inconsistent"] == 0
    assert len(v) - stats["edges"] + len(f) == 0  # a torus: Euler characteristic 0
