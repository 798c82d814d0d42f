"""Peak memory and time of the NAF projection modes at real width (random weights), CPU.

    python scripts/bench_naf_modes.py [--image-size 512] [--naf-size 512] [--points 20000] [--channels 1024]
                                      [--modes map whole full frugal]

For each mode, in a fresh process: ``map`` = the reference algorithm as written (whole T×T×C NAF map,
then bilinear sampling), ``whole`` = ``NAF.sample(..., tiled=False)`` (the same values bit for bit, without
the NAF map; the guidance map whole), ``full`` = ``NAF.sample`` (the same bits again, the guidance map by
``TiledEncoder``: one map per encoder branch), ``frugal`` = banded encoder + pointwise sampling. Prints the measured peak RSS increase over the inputs
(kernel high-water mark, reset before the call), wall time, whether the result equals ``map``'s bit for
bit (when ``map`` ran: it takes ~10 min at 512 px on two cores, far longer at 1024) and ``whole``'s (when it
ran), and ``conditioning.naf_peak_bytes``' estimate.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("map", "whole", "full", "frugal")


def run_one(args) -> None:
    import torch

    from pixal3d.models.conditioning import naf_peak_bytes
    from pixal3d.models.naf import NAF
    from pixal3d.models.projection import sample_map, sample_pointwise
    from pixal3d.telemetry.linux import process_memory, reset_peak

    torch.manual_seed(0)
    naf = NAF().eval()  # the published width: dim 256, 4 heads
    gen = torch.Generator().manual_seed(1)
    image = torch.rand(1, 3, args.image_size, args.image_size, generator=gen)
    patches = args.image_size // 16
    features = torch.randn(1, args.channels, patches, patches, generator=gen)
    grid = torch.rand(args.points, 2, generator=gen) * 2 - 1
    size = (args.naf_size, args.naf_size)
    reset_peak()
    base = process_memory()[0]
    start = time.perf_counter()
    with torch.no_grad():
        if args.mode == "map":
            out = sample_map(naf(image, features, size), grid)
        elif args.mode in ("whole", "full"):
            out = naf.sample(image, features, size, grid, tiled=args.mode == "full")
        else:
            out = sample_pointwise(lambda p: naf.features_at(image, features, size, p), grid, *size)
    seconds = time.perf_counter() - start
    peak = process_memory()[1] - base
    torch.save(out, f"/tmp/bench_naf_{args.mode}.pt")
    estimate = naf_peak_bytes(args.mode, args.image_size, args.naf_size, channels=args.channels,
                              points=args.points) if args.mode in ("full", "frugal") else None  # map, whole: none
    print(json.dumps({"mode": args.mode, "peak_gib": peak / 2**30, "seconds": seconds,
                      "estimate_gib": None if estimate is None else estimate / 2**30}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image-size", type=int, default=512)
    parser.add_argument("--naf-size", type=int, default=512)
    parser.add_argument("--points", type=int, default=20_000)
    parser.add_argument("--channels", type=int, default=1024)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="modes to run (default all)")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        run_one(args)
        return
    import torch

    rows = []
    for mode in args.modes:
        cmd = [sys.executable, __file__, "--mode", mode, "--image-size", str(args.image_size), "--naf-size",
               str(args.naf_size), "--points", str(args.points), "--channels", str(args.channels)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    outputs = {r["mode"]: torch.load(f"/tmp/bench_naf_{r['mode']}.pt") for r in rows}
    print(f"S={args.image_size} T={args.naf_size} C={args.channels} points={args.points}")
    print(f"{'mode':<8} {'peak GiB':>9} {'estimate':>9} {'seconds':>8}  equals map bitwise  equals whole bitwise")
    for r in rows:
        same = [("-" if ref not in outputs else str(torch.equal(outputs[r["mode"]], outputs[ref])))
                for ref in ("map", "whole")]
        estimate = "-" if r["estimate_gib"] is None else f"{r['estimate_gib']:.2f}"
        print(f"{r['mode']:<8} {r['peak_gib']:>9.2f} {estimate:>9} {r['seconds']:>8.1f}  {same[0]:<18}  {same[1]}")
    if "whole" in outputs and "full" in outputs:
        by_mode = {r["mode"]: r for r in rows}
        print(f"full / whole: time {by_mode['full']['seconds'] / by_mode['whole']['seconds']:.2f}x, "
              f"peak {by_mode['full']['peak_gib'] / by_mode['whole']['peak_gib']:.2f}x")


if __name__ == "__main__":
    main()
