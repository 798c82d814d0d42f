"""Correctness and memory checks that need a CUDA device, as one short script (prints a table).

1. The tiny cascade on CUDA under the eager, staged and offload policies: identical fingerprints
   (and how many stages also match the CPU golden bits, for information).
2. A tiny sparse flow model in bf16 on CUDA vs the same weights in float32 on the CPU
   (relative error ‖cuda − ref‖ / ‖ref‖; bf16 operands land between 1e-3 and 1e-2).
3. Sparse convolution in fp16 on CUDA vs float64 on the CPU.
4. NAF at real width (random weights), T = 512 and 1024: the frugal point path vs the full map —
   peak allocated memory, time, and the largest difference at the sampled pixels.

Usage: ``python scripts/cuda_checks.py [--out DIR]``
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pixal3d import kernels  # noqa: E402
from pixal3d.models.naf import NAF  # noqa: E402
from pixal3d.models.slat_flow import SLatFlowModel  # noqa: E402
from pixal3d.nn.sparse_conv import sparse_conv3d  # noqa: E402
from pixal3d.nn.sparse_tensor import SparseTensor  # noqa: E402

ROWS: list[tuple[str, str, str]] = []


def row(check: str, result: str, detail: str) -> None:
    ROWS.append((check, result, detail))
    print(f"[{result}] {check}: {detail}", flush=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm())


def check_cascade(out: Path) -> None:
    prints = {}
    for policy in ("eager", "staged", "offload"):
        target = out / f"tiny_{policy}.glb"
        cmd = [sys.executable, str(REPO / "scripts" / "image_to_mesh.py"), str(REPO / "assets" / "example.png"),
               "--config", str(REPO / "configs" / "tiny.yaml"), "--device", "cuda", "--memory-policy", policy,
               "-o", str(target), "--quiet"]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            row(f"tiny cascade ({policy})", "FAIL", proc.stderr.strip().splitlines()[-1] if proc.stderr else "?")
            return
        record = json.loads(target.with_suffix(".run.json").read_text())
        prints[policy] = {r["stage"]: r["fingerprints"] for r in record["stages"]}
        row(f"tiny cascade ({policy})", "ok", f"{time.perf_counter() - start:.1f} s")
    same = prints["eager"] == prints["staged"] == prints["offload"]
    row("eager == staged == offload fingerprints on CUDA", "PASS" if same else "FAIL",
        f"{len(prints['eager'])} stages compared")
    cpu_key = kernels.key(kernels.recommended_pins())  # the tests' kernels on this machine's CPU
    golden_file = REPO / "tests" / "golden" / f"tiny_{cpu_key}.json"
    if not golden_file.exists():
        row("CUDA vs CPU golden (information)", "info", f"no CPU golden for kernels {cpu_key}")
        return
    golden = json.loads(golden_file.read_text())["stages"]
    equal = [s for s in prints["eager"] if golden.get(s) == prints["eager"][s]]
    row(f"CUDA vs CPU golden {golden_file.name} (information)", "info", f"bit-equal stages: {equal}")


def check_flow(device: torch.device) -> None:
    torch.manual_seed(0)
    args = dict(resolution=16, in_channels=8, out_channels=8, model_channels=128, cond_channels=64,
                num_blocks=2, num_heads=2, mlp_ratio=4.0, proj_in_channels=128, dtype="bfloat16")
    model = SLatFlowModel(**args).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    coords = torch.unique(torch.randint(0, 16, (3000, 3)), dim=0)
    coords = torch.cat([torch.zeros(len(coords), 1, dtype=torch.long), coords], 1).int()
    n = len(coords)
    x = torch.randn(n, 8)
    cond_g = torch.randn(1, 5, 64)
    cond_p = torch.randn(n, 128)
    t = torch.tensor([700.0])

    def run(m, dev, dtype=None):
        xs = SparseTensor(x.to(dev, dtype or torch.float32), coords.to(dev))
        cond = {"global": cond_g.to(dev, dtype or torch.float32), "proj": xs.replace(cond_p.to(dev, dtype or torch.float32))}
        with torch.no_grad():
            return m(xs, t.to(dev, dtype or torch.float32), cond).feats

    out = run(model.to(device), device)
    ref_model = SLatFlowModel(**{**args, "dtype": "float32"}).eval()
    ref_model.load_state_dict({k: v.float().cpu() for k, v in model.state_dict().items()})
    ref = run(ref_model, torch.device("cpu"))
    err = rel_err(out, ref)
    row(f"sparse flow bf16 CUDA vs float32 CPU ({n} tokens)", "PASS" if err < 2e-2 else "FAIL", f"rel err {err:.2e}")


def check_conv(device: torch.device) -> None:
    torch.manual_seed(1)
    coords = torch.unique(torch.randint(0, 48, (60000, 3)), dim=0)
    coords = torch.cat([torch.zeros(len(coords), 1, dtype=torch.long), coords], 1).int()
    feats = torch.randn(len(coords), 64)
    weight = torch.randn(96, 3, 3, 3, 64) / 40
    bias = torch.randn(96)
    out = sparse_conv3d(SparseTensor(feats.to(device).half(), coords.to(device)), weight.to(device).half(),
                        bias.to(device).half()).feats
    ref = sparse_conv3d(SparseTensor(feats.double(), coords), weight.double(), bias.double()).feats
    err = rel_err(out, ref)
    row(f"sparse conv fp16 CUDA vs float64 CPU ({len(coords)} voxels)", "PASS" if err < 5e-3 else "FAIL",
        f"rel err {err:.2e}")


def check_naf(device: torch.device) -> None:
    torch.manual_seed(2)
    naf = NAF().to(device).eval()
    for size, patches, target in ((512, 32, 512), (1024, 64, 512), (1024, 64, 1024)):
        image = torch.rand(1, 3, size, size, device=device)
        feats = torch.randn(1, 1024, patches, patches, device=device)
        pixels = torch.stack([torch.randint(0, target, (80000,)), torch.randint(0, target, (80000,))], 1)
        pixels = torch.unique(pixels, dim=0).to(device)
        results = {}
        for mode in ("frugal", "full"):
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            start = time.perf_counter()
            with torch.no_grad():
                if mode == "frugal":
                    values = naf.features_at(image, feats, (target, target), pixels)
                else:
                    full = naf(image, feats, (target, target))
                    values = full[0, :, pixels[:, 0], pixels[:, 1]].T
                    del full
            torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated(device) - base
            results[mode] = (values.float(), seconds, peak)
        diff = float((results["frugal"][0] - results["full"][0]).abs().max())
        row(f"NAF S={size} T={target}, {len(pixels)} pixels", "PASS" if diff < 1e-4 else "FAIL",
            f"frugal {results['frugal'][2] / 2**30:.2f} GiB {results['frugal'][1] * 1e3:.0f} ms | "
            f"full {results['full'][2] / 2**30:.2f} GiB {results['full'][1] * 1e3:.0f} ms | max diff {diff:.1e}")


def check_naf_sample(device: torch.device) -> None:
    """``NAF.sample`` (naf_mode 'full') against the reference algorithm, the whole map then grid_sample:
    bitwise on the CPU; on CUDA a batch-size-dependent matmul kernel could change the last bits. And its tiled
    encoder against the whole one (``tiled=False``): bitwise on the CPU; on CUDA cuDNN may pick another
    convolution algorithm for a band than for the whole map."""
    from pixal3d.models.projection import sample_map

    torch.manual_seed(3)
    naf = NAF().to(device).eval()
    for size, patches, target in ((512, 32, 512), (1024, 64, 1024)):
        image = torch.rand(1, 3, size, size, device=device)
        feats = torch.randn(1, 1024, patches, patches, device=device)
        grid = torch.rand(20000, 2, device=device) * 2 - 1
        peaks = {}
        for mode in ("map", "sample", "whole"):
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            with torch.no_grad():
                out = sample_map(naf(image, feats, (target, target)), grid) if mode == "map" else \
                    naf.sample(image, feats, (target, target), grid, tiled=mode == "sample")
            torch.cuda.synchronize(device)
            peaks[mode] = (out, torch.cuda.max_memory_allocated(device) - base)
        same = torch.equal(peaks["map"][0], peaks["sample"][0])
        diff = float((peaks["map"][0] - peaks["sample"][0]).abs().max())
        row(f"NAF sample == map+grid_sample S={size} T={target}", "PASS" if diff < 1e-6 else "FAIL",
            f"bitwise {same}, max diff {diff:.1e} | map {peaks['map'][1] / 2**30:.2f} GiB, "
            f"sample {peaks['sample'][1] / 2**30:.2f} GiB")
        tiled = torch.equal(peaks["whole"][0], peaks["sample"][0])
        row(f"NAF tiled encoder == whole encoder S={size} T={target}", "PASS" if tiled else "FAIL",
            f"bitwise {tiled} (on the CPU it is), max diff "
            f"{float((peaks['whole'][0] - peaks['sample'][0]).abs().max()):.1e} | whole "
            f"{peaks['whole'][1] / 2**30:.2f} GiB, tiled {peaks['sample'][1] / 2**30:.2f} GiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/cuda_checks"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}", flush=True)
    for check in (lambda: check_cascade(args.out), lambda: check_flow(device), lambda: check_conv(device),
                  lambda: check_naf(device), lambda: check_naf_sample(device)):
        try:
            check()
        except Exception as err:  # report every check, even after one breaks
            row(getattr(check, "__name__", "check"), "ERROR", f"{type(err).__name__}: {err}")
    print("\n| check | result | detail |\n|---|---|---|")
    for check, result, detail in ROWS:
        print(f"| {check} | {result} | {detail} |")
    return 0 if all(r[1] in ("ok", "PASS", "info") for r in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
