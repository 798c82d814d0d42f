"""``mesh_export`` (the bake onto a given mesh) on this CPU: time and peak anonymous memory of ``export_onto`` for an
icosphere of ``--faces`` faces (no UVs: the atlas is made) with PBR voxels covering its surface at 1024.

    python scripts/bench_mesh_bake.py --subdivisions 7 --texture-size 2048
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--subdivisions", type=int, default=7)
    parser.add_argument("--texture-size", type=int, default=2048)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    import numpy as np
    import torch
    import trimesh

    from pixal3d.mesh.fields import PbrVoxels
    from pixal3d.mesh.onto import export_onto
    from pixal3d.mesh.settings import ExportSettings
    from pixal3d.mesh.user_mesh import MeshPose, UserMesh
    from scripts.bench_memory import _status
    from scripts.bench_stream import (
        AnonPeak,  # the anonymous-memory sampler the stream benchmarks use
    )

    ball = trimesh.creation.icosphere(subdivisions=args.subdivisions, radius=0.4)
    points = trimesh.sample.sample_surface_even(ball, 4_000_000, seed=0)[0]
    coords = np.unique(np.floor((points + 0.5) * 1024).astype(np.int32), axis=0)
    rng = np.random.default_rng(0)
    pbr = PbrVoxels(torch.from_numpy(coords), torch.from_numpy(rng.random((len(coords), 6), dtype=np.float32)), 1024)
    mesh = UserMesh(np.asarray(ball.vertices), np.asarray(ball.faces), None, "ball")
    settings = ExportSettings(texture_size=args.texture_size)
    before = _status()["RssAnon"]
    t0 = time.perf_counter()
    with AnonPeak() as peak:
        out = export_onto(mesh, MeshPose(), pbr, settings=settings, progress=False)
    seconds = time.perf_counter() - t0
    print(json.dumps({"faces": len(ball.faces), "pbr_voxels": len(coords), "texture_size": args.texture_size,
                      "seconds": round(seconds, 1), "work_gib": round((peak.peak - before) / 2**30, 3),
                      "coverage": round(out.report.coverage, 3),
                      "steps": {s.name: round(s.seconds, 1) for s in out.report.steps}}))


if __name__ == "__main__":
    main()
