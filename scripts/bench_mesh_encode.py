"""The shape encoder (``--mesh``) at its released width on this CPU: peak anonymous memory and time, whole and over
tiles, on a sphere's band of voxels at 1024 (a stand-in for a mesh's dual grid), each in a fresh process; the tiled
latents are checked equal to the whole one's (bit for bit).

    python scripts/bench_mesh_encode.py --voxels 400000 --levels 0 2 3 --out benchmarks/mesh_encode.json

``--levels 0``: whole; ``k``: the first k stages over tiles of ``--tile-voxels`` level-0 voxels. Random weights
(deterministic, fp16 torso as released); the weights' bytes are in every peak.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(voxels: int, levels: int, tile_voxels: int, threads: int) -> dict:
    sys.path.insert(0, str(REPO))
    import torch

    from pixal3d.mesh.fields import DualGridFields
    from pixal3d.models import build_model
    from pixal3d.models.shape_encoder import EncodeTiles
    from scripts.bench_memory import _status
    from scripts.bench_stream import (
        AnonPeak,  # the anonymous-memory sampler the stream benchmarks use
    )
    from tests.support.header_hub import SHAPE_ENCODER_RELEASED

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_model(SHAPE_ENCODER_RELEASED, device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32).to(p.dtype) * (1.0 / math.sqrt(max(1, p[0].numel()))))
    model.eval()
    # a band of a sphere's surface at 1024 with about ``voxels`` voxels (area 4πr² · 1024² · ~1.6 voxels per unit)
    r = math.sqrt(voxels / (4 * math.pi * 1.6)) / 1024
    n = math.ceil(r * 1024) + 3
    axis = torch.arange(512 - n, 512 + n)
    cube = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), -1).reshape(-1, 3)
    d = ((cube.float() + 0.5 - 512) / 1024).norm(dim=1) - r
    coords = cube[d.abs() < 0.8 / 1024].int()
    g = torch.Generator().manual_seed(1)
    fields = DualGridFields(coords, torch.rand(len(coords), 3, generator=g), torch.rand(len(coords), 3, generator=g)
                            > 0.5, torch.ones(len(coords)), 1024)
    del cube, d
    start_anon = _status()["RssAnon"]
    t0 = time.perf_counter()
    with AnonPeak() as peak, torch.no_grad():
        latent = model.encode(fields).latent if levels == 0 else \
            model.encode_tiled(fields, EncodeTiles(levels=levels, tile_voxels=tile_voxels))
    seconds = time.perf_counter() - t0
    digest = hashlib.sha256(latent.feats.numpy().tobytes() + latent.coords.numpy().tobytes()).hexdigest()[:16]
    return {"voxels": len(coords), "tokens": len(latent.coords), "levels": levels, "tile_voxels": tile_voxels,
            "seconds": round(seconds, 1), "peak_anon_gib": round(peak.peak / 2**30, 3),
            "before_gib": round(start_anon / 2**30, 3), "work_gib": round((peak.peak - start_anon) / 2**30, 3),
            "latent_sha": digest}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--voxels", type=int, default=400_000)
    parser.add_argument("--levels", type=int, nargs="+", default=[0, 2, 3])
    parser.add_argument("--tile-voxels", type=int, default=1 << 18)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", nargs=4, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    rows = []
    for levels in args.levels:
        out = subprocess.run([sys.executable, __file__, "--child", str(args.voxels), str(levels),
                              str(args.tile_voxels), str(args.threads)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    same = len({r["latent_sha"] for r in rows}) == 1
    print(f"latents equal across runs: {same}")
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows, "latents_equal": same},
                                       indent=2) + "\n")


if __name__ == "__main__":
    main()
