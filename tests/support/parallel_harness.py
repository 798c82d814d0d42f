"""Helpers of the multi-process tests: small flow checkpoints of the real classes, their inputs, and a
launcher that starts ranks the way torchrun does (env:// variables on loopback, a free port).

Workers live here (module level) so that spawned children can import them.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from pixal3d.config import SamplerConfig
from pixal3d.models import build_model, save_model
from pixal3d.nn.sparse_tensor import SparseTensor

SMALL = dict(model_channels=32, cond_channels=16, num_heads=2, mlp_ratio=2.0, pe_mode="rope", share_mod=True,
             qk_rms_norm=True, qk_rms_norm_cross=True, image_attn_mode="proj", dtype="float32")
SPECS = {
    "dense": {"name": "SparseStructureFlowModel", "args": dict(resolution=4, in_channels=8, out_channels=8, **SMALL)},
    "sparse": {"name": "SLatFlowModel", "args": dict(resolution=8, in_channels=16, out_channels=8,
                                                      proj_in_channels=12, **SMALL)},
}
# The structure stage's sampler settings (CFG 7.5, rescale 0.7, rescale_t 5) in 4 steps, t = 1, 0.94, 0.83,
# 0.62: with the interval [0.7, 1] the first three steps are guided (both branches, CFG rescale over
# the whole latent) and in the last one the negative branch stops (positive only, per-patch update).
SAMPLER = SamplerConfig(steps=4, guidance_strength=7.5, guidance_rescale=0.7, guidance_interval=(0.7, 1.0),
                        rescale_t=5.0)
# An interval that starts below t = 1: the negative branch joins at the third step.
SAMPLER_LATE = dataclasses.replace(SAMPLER, guidance_interval=(0.6, 0.9))
SAMPLERS = {"default": SAMPLER, "late": SAMPLER_LATE}


def write_flow(folder: Path, kind: str, blocks: int = 6) -> Path:
    """A small ``kind`` ("dense" / "sparse") flow of the real class with deterministic random weights."""
    spec = {"name": SPECS[kind]["name"], "args": dict(SPECS[kind]["args"], num_blocks=blocks)}
    model = build_model(spec, device="meta").to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1234 + blocks)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.uniform_(-1, 1, generator=gen).mul_((3 / p.shape[-1]) ** 0.5)
            elif name.endswith(("gamma", "norm2.weight")):
                p.fill_(1.0)
            else:
                p.uniform_(-0.05, 0.05, generator=gen)
    stem = folder / f"{kind}_{blocks}"
    save_model(model, spec, stem)
    return stem


def zeros_like_cond(cond: dict[str, Any]) -> dict[str, Any]:
    """The cascade's CFG negative (``conditioning.negative_condition``, without importing DINOv3's stack)."""
    return {k: v.replace(torch.zeros_like(v.feats)) if isinstance(v, SparseTensor) else torch.zeros_like(v)
            for k, v in cond.items()}


def flow_inputs(kind: str, seed: int) -> dict[str, Any]:
    """Noise and conditions for the ``kind`` flow of ``write_flow`` (the negative is zeros, as in the cascade)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "dense":
        noise = torch.randn(1, 8, 4, 4, 4, generator=gen)
        cond = {"global": torch.randn(1, 5, 16, generator=gen), "proj": torch.randn(1, 64, 16, generator=gen)}
        return {"noise": noise, "cond": cond, "neg_cond": zeros_like_cond(cond), "concat_cond": None}
    grid = torch.randperm(8 ** 3, generator=gen)[:70].sort().values
    coords = torch.stack([torch.zeros_like(grid), grid // 64, grid // 8 % 8, grid % 8], dim=1).int()
    n = coords.shape[0]
    noise = SparseTensor(torch.randn(n, 8, generator=gen), coords)
    proj = SparseTensor(torch.randn(n, 12, generator=gen), coords)
    cond = {"global": torch.randn(1, 5, 16, generator=gen), "proj": proj}
    concat = SparseTensor(torch.randn(n, 8, generator=gen), coords)
    return {"noise": noise, "cond": cond, "neg_cond": zeros_like_cond(cond), "concat_cond": concat}


def features(latent: Any) -> torch.Tensor:
    return latent.feats if isinstance(latent, SparseTensor) else latent


# -- launching ranks --------------------------------------------------------------------------------
@dataclass
class RankRun:
    results: list[Any]          # per rank: what the worker returned (None when it failed)
    exitcodes: list[int | None]
    errors: list[str]           # per rank: "" or the exception's text
    seconds: float


# Ranks fork from a server that imported torch and pixal3d.parallel once (a fresh interpreter per rank
# costs seconds on a small machine); the server itself never ran a kernel, so forking it is safe.
mp.set_forkserver_preload(["torch", "pixal3d.parallel", "tests.support.parallel_harness"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, folder: str, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        result = fn(rank, *args)
    except BaseException as err:
        Path(folder, f"rank{rank}.err").write_text(f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        raise SystemExit(1) from err
    torch.save(result, Path(folder, f"rank{rank}.pt"))


def spawn(world: int, fn: Callable, *args: Any, folder: Path, timeout_s: float = 60.0) -> RankRun:
    """Run ``fn(rank, *args)`` in ``world`` fresh processes joined by env:// on a free loopback port."""
    folder.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    ctx = mp.start_processes(_entry, args=(world, free_port(), str(folder), fn, args), nprocs=world, join=False,
                             start_method="forkserver")
    for proc in ctx.processes:
        proc.join(max(0.0, timeout_s - (time.monotonic() - start)))
    seconds = time.monotonic() - start
    for proc in ctx.processes:  # our own children only
        if proc.is_alive():
            proc.kill()
            proc.join()
    results, errors = [], []
    for rank in range(world):
        out, err = Path(folder, f"rank{rank}.pt"), Path(folder, f"rank{rank}.err")
        results.append(torch.load(out, weights_only=False) if out.exists() else None)
        errors.append(err.read_text() if err.exists() else "")
    return RankRun(results, [p.exitcode for p in ctx.processes], errors, seconds)


# -- workers ----------------------------------------------------------------------------------------
def sample_worker(rank: int, settings: Any, jobs: list[tuple[str, str, int, int, int, str]]) -> list[torch.Tensor]:
    """Join the job and run ``jobs`` [(checkpoint stem, kind, seed, M, W, sampler name)] in a row through
    the same ranks (each rank loads its shard of each checkpoint once); the latents' features."""
    from pixal3d.parallel import init_parallel, load_flow_shard, parallel_sample

    runtime = init_parallel(settings)
    shards: dict[str, Any] = {}
    out = []
    for stem, kind, seed, patches, warmup, sampler in jobs:
        if stem not in shards:
            shards[stem] = load_flow_shard(stem, runtime.topology.stage, runtime.topology.pp_degree)
        runtime.settings = dataclasses.replace(settings, patches=patches, warmup=warmup)
        inputs = flow_inputs(kind, seed) if rank == 0 else dict.fromkeys(("noise", "cond", "neg_cond", "concat_cond"))
        latent = parallel_sample(shards[stem], inputs["noise"], cond=inputs["cond"], neg_cond=inputs["neg_cond"],
                                 concat_cond=inputs["concat_cond"], sampler=SAMPLERS[sampler], runtime=runtime)
        out.append(features(latent).clone())
    runtime.close()
    return out


def split_worker(rank: int, settings: Any, jobs: list[tuple[str, str, int, int, int]],
                 memory: list[int] | None = None) -> dict[str, Any]:
    """Join the job, agree on each rank's blocks (``settings.pp_split``; ``auto``: this rank reports
    ``memory[rank]`` bytes and every rank reads rank 0's list), load this rank's shard of each checkpoint with
    that split and run ``jobs`` [(stem, kind, seed, M, W)]. Returns the latents' features, the split, this
    rank's block range and the capacities every rank agreed on."""
    from pixal3d.models.loading import read_spec
    from pixal3d.parallel import init_parallel, load_flow_shard, parallel_sample
    from pixal3d.parallel.shard import shard_info
    from pixal3d.parallel.split import model_split

    runtime = init_parallel(settings)
    topo = runtime.topology
    capacities = runtime.gather_memory(memory[rank]) if memory is not None else None
    out, splits, ranges = [], [], []
    for stem, kind, seed, patches, warmup in jobs:
        blocks = read_spec(Path(stem).with_suffix(".json"))["args"]["num_blocks"]
        split = model_split(settings.pp_split, blocks, topo.pp_degree, capacities)
        shard = load_flow_shard(stem, topo.stage, topo.pp_degree, split=split)
        runtime.settings = dataclasses.replace(settings, patches=patches, warmup=warmup)
        inputs = flow_inputs(kind, seed) if rank == 0 else dict.fromkeys(("noise", "cond", "neg_cond", "concat_cond"))
        latent = parallel_sample(shard, inputs["noise"], cond=inputs["cond"], neg_cond=inputs["neg_cond"],
                                 concat_cond=inputs["concat_cond"], sampler=SAMPLER, runtime=runtime)
        out.append(features(latent).clone())
        splits.append(split)
        ranges.append(shard_info(shard).blocks)
    runtime.close()
    return {"latents": out, "splits": splits, "ranges": ranges, "capacities": capacities}
