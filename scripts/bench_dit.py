"""Forward time and peak memory of a real-size Pixal3D flow transformer (random weights).

The model is built on ``meta`` at the released config, materialised directly on the target device
(``to_empty``) with the reference dtype placement (bf16 block weights, fp32 norms/embedders) and filled
with random weights there — no full-size fp32 copy on the host. Inputs are random too: for the sparse
models ``N`` distinct voxels of the 64³ grid with their 2048-channel projected features; the dense
sparse-structure model always sees its 16³ = 4096 tokens.

    python scripts/bench_dit.py --model shape --tokens 4096,20000,32768 --device cuda
    python scripts/bench_dit.py --model shape --tokens 1000 --device cpu --blocks 2 --repeats 2

CUDA timings use CUDA events after warm-up forwards and report the median; peak memory is
``torch.cuda.max_memory_allocated`` during the timed forwards; "forward GiB" is that peak minus what was
allocated before the first forward (weights + inputs). On CPU: wall-clock median, the process's peak RSS
(``ru_maxrss``, never reset, so list token counts in ascending order) and its rise over the RSS before
the forwards.
"""
from __future__ import annotations

import argparse
import contextlib
import resource
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pixal3d.models import build_model
from pixal3d.nn.sparse_tensor import SparseTensor

_COMMON = {"model_channels": 1536, "cond_channels": 1024, "num_blocks": 30, "num_heads": 12, "mlp_ratio": 5.3334,
           "pe_mode": "rope", "share_mod": True, "qk_rms_norm": True, "qk_rms_norm_cross": True,
           "image_attn_mode": "proj", "dtype": "bfloat16"}
# The released configs (reference/checkpoints.json args) of the four flow models.
MODELS = {
    "ss": ("SparseStructureFlowModel", dict(resolution=16, in_channels=8, out_channels=8, **_COMMON)),
    "shape512": ("ElasticSLatFlowModel", dict(resolution=32, in_channels=32, out_channels=32,
                                              proj_in_channels=2048, **_COMMON)),
    "shape": ("ElasticSLatFlowModel", dict(resolution=64, in_channels=32, out_channels=32,
                                           proj_in_channels=2048, **_COMMON)),
    "tex": ("ElasticSLatFlowModel", dict(resolution=64, in_channels=64, out_channels=32,
                                         proj_in_channels=2048, **_COMMON)),
}
SDPA_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")


def build_random(name: str, blocks: int | None, device: torch.device) -> torch.nn.Module:
    """The real-size model, materialised on ``device`` with random weights (reference dtype placement)."""
    cls, args = MODELS[name]
    args = dict(args, num_blocks=blocks or args["num_blocks"])
    model = build_model({"name": cls, "args": args}, device="meta").to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("gamma", "norm2.weight")):
                p.fill_(1.0)
            elif p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5, generator=gen)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval().requires_grad_(False)


def random_inputs(name: str, model: torch.nn.Module, tokens: int, device: torch.device):
    """``(args, kwargs, token count)`` for one forward of ``model``."""
    gen = torch.Generator(device=device).manual_seed(1)
    t = torch.tensor([500.0], device=device)
    context = torch.randn(1, 5, model.cond_channels, device=device, generator=gen)
    if name == "ss":
        r = model.resolution
        x = torch.randn(1, model.in_channels, r, r, r, device=device, generator=gen)
        proj = torch.randn(1, r ** 3, model.proj_channels, device=device, generator=gen)
        return (x, t, {"global": context, "proj": proj}), {}, r ** 3
    grid = model.resolution
    if tokens > grid ** 3:
        raise SystemExit(f"--tokens {tokens} exceeds the {grid}³ grid of model {name!r}")
    flat = torch.randperm(grid ** 3, device=device, generator=gen)[:tokens].sort().values
    xyz = torch.stack([flat // grid ** 2, flat // grid % grid, flat % grid], dim=1)
    coords = torch.cat([torch.zeros_like(xyz[:, :1]), xyz], dim=1).int()
    noise_channels = model.in_channels - (32 if name == "tex" else 0)
    x = SparseTensor(torch.randn(tokens, noise_channels, device=device, generator=gen), coords)
    cond = {"global": context, "proj": x.replace(torch.randn(tokens, model.proj_channels, device=device,
                                                             generator=gen))}
    kwargs = {"concat_cond": x.replace(torch.randn(tokens, 32, device=device, generator=gen))} if name == "tex" else {}
    return (x, t, cond), kwargs, tokens


def sdpa_scope(backend: str):
    """Scoped SDPA backend choice (``auto`` = PyTorch's own dispatch)."""
    if backend == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kinds = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    return sdpa_kernel(kinds[backend])


def time_forward(model, args, kwargs, device: torch.device, warmup: int,
                 repeats: int) -> tuple[list[float], float, float]:
    """Per-forward milliseconds, peak memory and its rise over the pre-forward level (GiB)."""
    if device.type == "cuda":
        before = torch.cuda.memory_allocated(device) / 2 ** 30
    else:
        before = psutil.Process().memory_info().rss / 2 ** 30
    with torch.inference_mode():
        for _ in range(warmup):
            model(*args, **kwargs)
        times = []
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                model(*args, **kwargs)
                end.record()
                torch.cuda.synchronize(device)
                times.append(start.elapsed_time(end))
            peak = torch.cuda.max_memory_allocated(device) / 2 ** 30
        else:
            for _ in range(repeats):
                begin = time.perf_counter()
                model(*args, **kwargs)
                times.append((time.perf_counter() - begin) * 1e3)
            scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2 ** 30
    return times, peak, peak - before


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="shape")
    parser.add_argument("--tokens", default="20000", help="comma-separated token counts (sparse models)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", type=int, default=None, help="build fewer than the 30 blocks (quick CPU runs)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed forwards first (default 3 cuda, 1 cpu)")
    parser.add_argument("--repeats", type=int, default=None, help="timed forwards (default 10 cuda, 3 cpu)")
    parser.add_argument("--sdpa", choices=SDPA_BACKENDS, default="auto", help="force one SDPA backend")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each block (dynamic shapes) to measure what kernel fusion would gain")
    opts = parser.parse_args(argv)

    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but torch.cuda.is_available() is False; use --device cpu")
    cuda = device.type == "cuda"
    warmup = opts.warmup if opts.warmup is not None else (3 if cuda else 1)
    repeats = opts.repeats if opts.repeats is not None else (10 if cuda else 3)
    token_counts = [int(n) for n in opts.tokens.split(",") if n.strip()]

    model = build_random(opts.model, opts.blocks, device)
    if opts.compile:
        for block in model.blocks:
            block.compile(dynamic=True)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 30
    label = torch.cuda.get_device_name(device) if cuda else f"cpu ({torch.get_num_threads()} threads)"
    print(f"model {opts.model}: {len(model.blocks)} blocks, {weights:.2f} GiB weights, {label}, "
          f"torch {torch.__version__}, sdpa {opts.sdpa}{', compiled' if opts.compile else ''}, warmup {warmup}, repeats {repeats}")
    header = f"{'tokens':>7} {'median ms':>10} {'min ms':>9} {'peak GiB':>9} {'forward GiB':>12}"
    print(header)
    print("-" * len(header))
    for tokens in (token_counts if opts.model != "ss" else token_counts[:1]):
        args, kwargs, n = random_inputs(opts.model, model, tokens, device)
        with sdpa_scope(opts.sdpa):
            times, peak, rise = time_forward(model, args, kwargs, device, warmup, repeats)
        print(f"{n:>7} {statistics.median(times):>10.1f} {min(times):>9.1f} {peak:>9.2f} {rise:>12.2f}", flush=True)
        del args, kwargs
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
