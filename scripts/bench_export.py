"""Benchmark the CPU export on a synthetic shape of realistic size: time and peak RSS per step.

    python scripts/bench_export.py --voxels 3000000 [--resolution 1024] [--texture-size 4096]
        [--target 1000000] [--out /tmp/bench.glb] [--cache /tmp/bench_fields.npz]

The shape is ``pixal3d.mesh.synthetic.blobby_sdf`` (smooth union of spheres and tori with a ripple),
scaled (and, past the grid's size, repeated k³ times) so that its shell has about ``--voxels``
voxels at ``--resolution``; PBR attributes are a
smooth colour function of position. Generating the fields is not part of the timed export.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import psutil
import torch

from pixal3d.mesh.export import ExportSettings, export_glb
from pixal3d.mesh.fields import DualGridFields
from pixal3d.mesh.synthetic import (
    blobby_sdf,
    pbr_from_function,
    repeated_sdf,
    sdf_dual_grid,
)


def _color(p: np.ndarray) -> np.ndarray:
    out = np.empty((len(p), 6), np.float32)
    out[:, 0:3] = 0.5 + 0.45 * np.sin(p * np.array([17.0, 23.0, 29.0]))
    out[:, 3] = 0.2 + 0.6 * (p[:, 1] > 0)
    out[:, 4] = 0.5 + 0.4 * np.cos(11 * p[:, 0])
    out[:, 5] = 1.0
    return out


MAX_SCALE = 1.25  # blobby_sdf(scale) stays inside [-0.5, 0.5]³ up to here


def make_fields(voxels: int, resolution: int, seed: int) -> DualGridFields:
    """Scale (and if needed repeat k³ times) the blobby shape so its shell has about ``voxels`` voxels."""
    probe_res = 128
    probe = len(sdf_dual_grid(blobby_sdf(1.0, seed), probe_res, project=False).coords)
    per_unit = probe * (resolution / probe_res) ** 2  # surface voxels grow as (scale · R)²; k³ copies → ×k
    copies = max(1, int(np.ceil(voxels / (per_unit * MAX_SCALE**2))))
    scale = float(np.sqrt(voxels / (per_unit * copies)))
    sdf = blobby_sdf(scale, seed)
    if copies > 1:
        sdf = repeated_sdf(sdf, copies)
    return sdf_dual_grid(sdf, resolution, project=False, seed=seed)


def load_or_make(args) -> DualGridFields:
    if args.cache and Path(args.cache).exists():
        data = np.load(args.cache)
        return DualGridFields(*(torch.from_numpy(data[k]) for k in ("coords", "dual_vertices", "intersected", "split_weight")),
                              resolution=int(data["resolution"]))
    fields = make_fields(args.voxels, args.resolution, args.seed)
    if args.cache:
        np.savez(args.cache, coords=fields.coords.numpy(), dual_vertices=fields.dual_vertices.numpy(),
                 intersected=fields.intersected.numpy(), split_weight=fields.split_weight.numpy(),
                 resolution=fields.resolution)
    return fields


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--voxels", type=int, default=3_000_000)
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--texture-size", type=int, default=4096)
    parser.add_argument("--target", type=int, default=1_000_000)
    parser.add_argument("--format", choices=("png", "webp"), default="png")
    parser.add_argument("--projection", choices=("tangent", "exact"), default="tangent")
    parser.add_argument("--remesh", action="store_true", help="the release setting's remesh (configs/1024_cascade.yaml)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="/tmp/bench_export.glb")
    parser.add_argument("--cache", default=None, help="npz to reuse the generated fields across runs")
    parser.add_argument("--json", default=None, help="also write the report as JSON here")
    parser.add_argument("--workers", type=int, default=None,
                        help="the remesh's and simplifier's forked workers (default: one per core, at most 4)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    start = time.perf_counter()
    fields = load_or_make(args)
    pbr = pbr_from_function(fields, _color)
    print(f"synthetic fields: {len(fields.coords):,} voxels at R={fields.resolution} "
          f"in {time.perf_counter() - start:.1f} s (not timed below); RSS {psutil.Process().memory_info().rss / 2**30:.2f} GiB")
    settings = ExportSettings(decimation_target=args.target, texture_size=args.texture_size,
                              texture_format=args.format, projection=args.projection, remesh=args.remesh,
                              workers=args.workers)
    report = export_glb(fields, pbr, args.out, settings=settings, progress=False, exact_peak_rss=True)
    print(report.table())
    print(f"output: {report.faces:,} faces, {report.vertices:,} vertices, coverage {report.coverage:.1%}, "
          f"{report.file_bytes / 2**20:.1f} MiB → {report.path}")
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=1))


if __name__ == "__main__":
    main()
