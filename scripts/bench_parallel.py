"""PipeFusion at the real width on the CPU: 2 gloo ranks under torchrun against one process, then a
latency model for N GPUs at the reference token counts.

Measured (real shape-1024 flow: 1536 channels, 30 blocks, bf16, deterministic random weights written
once by scripts/write_random_checkpoints.py; a few hundred random voxels; the shape stage's sampler
settings — CFG 7.5 with rescale 0.5 — over a few steps):

* bytes each rank sent per step, against the formula: tokens × hidden × 2 B (bf16) per pipeline
  boundary per CFG branch for hidden states, tokens × latent channels × 4 B for the latent pieces the
  owner returns to the first rank;
* per-rank peak RSS against the single process's;
* seconds per step, 2 ranks × 1 thread against 1 process × 1 thread (one core standing for one device;
  ``--threads-single 2`` gives the process both cores instead);
* per-block forward time (1 thread) at the whole sequence and at one patch.

Modelled (``simulate``): the schedule of ``pixal3d.parallel.plan_steps`` replayed rank by rank in the
order the ranks execute it, with compute ∝ query tokens × the rank's share of blocks, each directed
link a queue with a bandwidth and a per-message latency, sends overlapping compute. Inputs: a
per-forward time (H200 reference figures quoted in docs/results.md, 67 ms at 4096 tokens and 307 ms at
20000; or this machine's measured one) and the link figures in ``LINKS`` (assumed, stated there).
The model is checked against the 2-rank CPU measurement it can reproduce.

    pixal3d-guard --wait-free 40 -- python scripts/bench_parallel.py      # ~10 min on 2 cores
    python scripts/bench_parallel.py --sweep [--tokens-list 256 1024] [--patches-list 2 4] [--repeats 2]

``--sweep`` (issue 28) measures N = 2 against one process at every tokens x patches point in turn and prints each
point's measured and predicted speed-up with the 1-minute load average before and after every run: run it on an
otherwise idle machine (load under 1) or its numbers say nothing.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pixal3d.config import SamplerConfig
from pixal3d.nn.sparse_tensor import SparseTensor
from pixal3d.parallel.schedule import StepPlan, plan_steps

REPO = Path(__file__).resolve().parents[1]
MODEL = "shape_slat_flow_model_1024"
SHAPE_SAMPLER = SamplerConfig(steps=12, guidance_strength=7.5, guidance_rescale=0.5, guidance_interval=(0.6, 1.0),
                              rescale_t=3.0)
LATENT_CHANNELS, HIDDEN, BLOCKS = 32, 1536, 30
GLOBAL_TOKENS = 5  # the image condition's tokens every block cross-attends to


# -- the latency model ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float   # bytes/s one direction, sustained
    latency: float     # s per message


LINKS = [  # assumptions, not measurements
    Link("PCIe 4.0 x16 (GPU↔GPU through the host, ~20 GB/s)", 20e9, 20e-6),
    Link("Thunderbolt 4 bridge (IP over TB, ~2 GB/s)", 2.0e9, 100e-6),
    Link("10 GbE (TCP, ~1.1 GB/s)", 1.1e9, 60e-6),
]


def simulate(plan: list[StepPlan], *, tokens: int, forward_s: float, cfg: int, pp: int, link: Link | None,
             hidden_bytes: int = HIDDEN * 2, latent_bytes: int = LATENT_CHANNELS * 4) -> float:
    """Seconds for one flow stage: each rank runs its items in the schedule's order (step → piece →
    branch), a piece of l tokens costs ``forward_s · l / tokens`` × the rank's share of the blocks,
    a message of b bytes occupies its directed link for ``b / bandwidth + latency`` (``link`` None:
    free), sends overlap compute. The owner mixes and updates pieces instantly."""
    from pixal3d.parallel.shard import block_ranges

    share = [len(r) / BLOCKS for r in block_ranges(BLOCKS, pp)]
    rank_free: dict[tuple[int, int], float] = collections.defaultdict(float)
    link_free: dict[tuple, float] = collections.defaultdict(float)

    def send(src, dst, ready, nbytes):
        if link is None or src == dst:
            return ready
        start = max(ready, link_free[(src, dst)])
        link_free[(src, dst)] = start + nbytes / link.bandwidth + link.latency
        return link_free[(src, dst)]

    group = {"pos": 0, "neg": min(1, cfg - 1)}
    owner, x_at = (0, pp - 1), {}  # (step, piece index, group) → arrival of the latent piece at the first rank
    for s, step in enumerate(plan):
        done = []
        for i, piece in enumerate(step.pieces):
            length = piece.stop - piece.start
            arrivals = []
            for branch in step.branches:
                c = group[branch]
                ready = x_at.get((s, i, c), 0.0)
                for k in range(pp):
                    start = max(rank_free[(c, k)], ready)
                    rank_free[(c, k)] = start + forward_s * length / tokens * share[k]
                    ready = rank_free[(c, k)]
                    if k < pp - 1:
                        ready = send((c, k), (c, k + 1), ready, length * hidden_bytes)
                arrivals.append(send((c, pp - 1), owner, ready, length * latent_bytes))
            rank_free[owner] = max(rank_free[owner], *arrivals)  # the owner takes the pieces in order
            done.append(rank_free[owner])
            if not step.whole_latent and s + 1 < len(plan):
                _send_next(plan[s + 1], s + 1, done[-1], piece.stop, x_at, send, owner, group)
        if step.whole_latent and s + 1 < len(plan):
            _send_next(plan[s + 1], s + 1, done[-1], tokens, x_at, send, owner, group)
    return max(rank_free.values())


def _send_next(step, s, at, ready_tokens, x_at, send, owner, group):
    for j, piece in enumerate(step.pieces):
        for c in sorted({group[b] for b in step.branches}):
            if (s, j, c) not in x_at and piece.stop <= ready_tokens:
                x_at[(s, j, c)] = send(owner, (c, 0), at, (piece.stop - piece.start) * LATENT_CHANNELS * 4)


def latency_table(forward: dict[str, tuple[int, float, SamplerConfig]], warmup: int) -> list[dict]:
    """Predicted seconds per stage for 1 device, CFG-parallel on 2, PipeFusion on 2/4, both on 4."""
    configs = [("1 device", 1, 1, 1), ("CFG-parallel, 2 devices", 2, 1, 1), ("PipeFusion N=2, M=4", 1, 2, 4),
               ("PipeFusion N=4, M=8", 1, 4, 8), ("CFG × PipeFusion 2×2, M=4", 2, 2, 4)]
    rows = []
    for stage, (tokens, forward_s, sampler) in forward.items():
        single = simulate(plan_steps(sampler, tokens, 1, sampler.steps), tokens=tokens, forward_s=forward_s,
                          cfg=1, pp=1, link=None)
        for name, cfg, pp, patches in configs:
            plan = plan_steps(sampler, tokens, patches, warmup if pp > 1 else sampler.steps)
            row = {"stage": stage, "tokens": tokens, "forward_s": forward_s, "config": name, "single_s": single}
            for link in [None, *LINKS]:
                t = simulate(plan, tokens=tokens, forward_s=forward_s, cfg=cfg, pp=pp, link=link)
                row[link.name if link else "no link cost"] = t
            rows.append(row)
    return rows


# -- measurements -------------------------------------------------------------------------------------------
def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2 ** 30


def bench_inputs(model, tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    r = model.resolution
    cells = torch.randperm(r ** 3, generator=gen)[:tokens].sort().values
    coords = torch.stack([torch.zeros_like(cells), cells // r ** 2, cells // r % r, cells % r], dim=1).int()
    noise = SparseTensor(torch.randn(tokens, LATENT_CHANNELS, generator=gen), coords)
    proj = SparseTensor(torch.randn(tokens, model.proj_channels, generator=gen), coords)
    # Pixal3D's cross-attention context is DINOv3's 5 global tokens (CLS + 4 registers; reference
    # pixal3d-inference.md §conditioning), not TRELLIS.2's 1029: with 1029 the context's K/V projection, a fixed
    # ~10 GFLOP per block call, made a half-sized patch cost ~2/3 of the whole sequence here (0.33 s vs 0.51 s).
    cond = {"global": torch.randn(1, GLOBAL_TOKENS, model.cond_channels, generator=gen), "proj": proj}
    neg = {"global": torch.zeros_like(cond["global"]), "proj": proj.replace(torch.zeros_like(proj.feats))}
    concat = None
    return noise, cond, neg, concat


def with_dtype(model, name: str):
    """``model`` with its blocks (the ones it holds) in ``name``'s dtype (``--dtype``); bfloat16: as released. On a
    CPU without native bf16 (AVX2) bf16 GEMMs are emulated and ~5x slower than fp32; the schedule, the messages
    (hidden states in the block dtype) and the code are the same."""
    dtype = getattr(torch, name)
    if dtype == model.dtype:
        return model
    from pixal3d.parallel.shard import owned_blocks

    for block in owned_blocks(model):
        block.to(dtype)
    model.dtype = dtype
    return model


def run_single(args) -> dict:
    """One process, the whole model, today's sampler; plus per-block times with one thread."""
    from pixal3d.models import load_model
    from pixal3d.parallel import parallel_sample

    torch.set_num_threads(args.threads_single)
    start = time.perf_counter()
    model = with_dtype(load_model(args.stem), args.dtype)
    load_s = time.perf_counter() - start
    noise, cond, neg, concat = bench_inputs(model, args.tokens)
    sampler = dataclasses.replace(SHAPE_SAMPLER, steps=args.steps)
    start = time.perf_counter()
    out = parallel_sample(model, noise, cond=cond, neg_cond=neg, concat_cond=concat, sampler=sampler, runtime=None)
    sample_s = time.perf_counter() - start
    torch.save(out.feats, Path(args.out_dir) / "single.pt")
    blocks = block_times(model, noise, cond, args.tokens, args.patches)
    return {"load_s": load_s, "sample_s": sample_s, "forwards": sum(len(s.branches) for s in
                                                                    plan_steps(sampler, args.tokens, 1, args.steps)),
            "peak_rss_gib": peak_rss_gib(), "threads": args.threads_single, **blocks}


def block_times(model, noise, cond, tokens: int, patches: int) -> dict:
    """Median seconds of one block (1 thread) over the whole sequence and over one patch."""
    from pixal3d.parallel.sequence import FlowSequence

    torch.set_num_threads(1)
    seq = FlowSequence(model, noise, cond, None, None)
    mod = model.modulation(seq.timestep(0.5, noise.device))
    block = model.blocks[0]
    out = {}
    for name, length in (("block_s_whole", tokens), ("block_s_patch", -(-tokens // patches))):
        h = torch.randn(length, HIDDEN).to(model.dtype)
        piece = slice(0, length)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            with torch.no_grad():
                block(h, mod, *seq.block_inputs("pos", piece))
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    return out


def run_rank(args) -> dict:
    """One torchrun rank: its shard, one request, the bytes it sent."""
    from pixal3d.models import read_spec
    from pixal3d.parallel import ParallelSettings, init_parallel, load_flow_shard, parallel_sample

    torch.set_num_threads(1)
    settings = ParallelSettings(mode="pipefusion", pp=int(os.environ["WORLD_SIZE"]), patches=args.patches,
                                warmup=args.warmup, timeout_s=1800)
    runtime = init_parallel(settings)
    topo = runtime.topology
    start = time.perf_counter()
    model = with_dtype(load_flow_shard(args.stem, topo.stage, topo.pp_degree), args.dtype)
    load_s = time.perf_counter() - start
    inputs = (None,) * 4
    if topo.rank == 0:
        from pixal3d.models import build_model
        inputs = bench_inputs(build_model(read_spec(Path(args.stem).with_suffix(".json"))), args.tokens)
    sampler = dataclasses.replace(SHAPE_SAMPLER, steps=args.steps)
    start = time.perf_counter()
    out = parallel_sample(model, inputs[0], cond=inputs[1], neg_cond=inputs[2], concat_cond=inputs[3],
                          sampler=sampler, runtime=runtime)
    sample_s = time.perf_counter() - start
    if topo.rank == 0:
        torch.save(out.feats, Path(args.out_dir) / "parallel.pt")
    result = {"rank": topo.rank, "load_s": load_s, "sample_s": sample_s, "peak_rss_gib": peak_rss_gib(),
              "weights_gib": sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2 ** 30,
              **runtime.last_stats}
    runtime.close()
    return result


def ensure_checkpoint(cache: Path) -> Path:
    sys.path.insert(0, str(REPO / "scripts"))
    import write_random_checkpoints as wrc

    entry = json.loads((REPO / "assets" / "checkpoints.json").read_text())["models"][MODEL]
    return wrc.write_manifest_checkpoint(cache, MODEL, entry)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["main", "single", "rank"], default="main")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--patches", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the flow blocks' dtype (bfloat16: as released; float32: ~5x faster on a CPU without "
                             "native bf16, hidden states sent at 4 bytes a channel)")
    parser.add_argument("--threads-single", type=int, default=1,
                        help="threads of the single process (default 1: one 'device', as each rank has)")
    parser.add_argument("--stem", default=None)
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("PIXAL3D_CACHE", Path.home() / ".cache"
                                                                                          / "pixal3d")) / "bench")
    parser.add_argument("--report", type=Path, default=REPO / "benchmarks" / "parallel")
    parser.add_argument("--report-only", action="store_true", help="rebuild the report from the last run")
    parser.add_argument("--sweep", action="store_true",
                        help="measured speed-up of 2 ranks x 1 thread over 1 process x 1 thread against the latency "
                             "model's, for every --tokens-list x --patches-list point, alternating, with the load "
                             "average before and after each (writes <report>_sweep.json)")
    parser.add_argument("--tokens-list", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--patches-list", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=2, help="--sweep: runs of each side per point")
    args = parser.parse_args()
    if args.role == "single":
        result = run_single(args)
        Path(args.out_dir, "single.json").write_text(json.dumps(result))
        return
    if args.role == "rank":
        result = run_rank(args)
        Path(args.out_dir, f"rank{result['rank']}.json").write_text(json.dumps(result))
        return
    # main: write the checkpoint once, measure in fresh processes, then model.
    start_load = os.getloadavg()
    out_dir = args.cache / "bench_parallel_run"
    if args.report_only:
        args.load_average = json.loads(args.report.with_suffix(".json").read_text()).get("load_average")
        report(args, out_dir)
        return
    stem = ensure_checkpoint(args.cache)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        sweep(args, stem, out_dir)
        return
    common = ["--tokens", str(args.tokens), "--steps", str(args.steps), "--patches", str(args.patches),
              "--warmup", str(args.warmup), "--stem", str(stem), "--out-dir", str(out_dir), "--dtype", args.dtype]
    script = str(Path(__file__).resolve())
    env = dict(os.environ, PYTHONPATH=str(REPO))
    print("single process ...", flush=True)
    subprocess.run([sys.executable, script, "--role", "single", "--threads-single", str(args.threads_single), *common],
                   check=True, env=env)
    print("2 ranks under torchrun ...", flush=True)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script,
                    "--role", "rank", *common], check=True, env=env)
    args.load_average = [start_load, os.getloadavg()]
    report(args, out_dir)


def sweep(args, stem: Path, out_dir: Path) -> None:
    """``--sweep``: per (tokens, patches) point, the single process and the 2 ranks in turn (``--repeats`` times
    each), the median seconds of each, the measured speed-up and the latency model's for the same schedule fed
    with the single run's own per-forward time (no link cost: loopback), and the load average around each run."""
    script, env = str(Path(__file__).resolve()), dict(os.environ, PYTHONPATH=str(REPO))
    rows = []
    for tokens in args.tokens_list:
        for patches in args.patches_list:
            common = ["--tokens", str(tokens), "--steps", str(args.steps), "--patches", str(patches), "--warmup",
                      str(args.warmup), "--stem", str(stem), "--out-dir", str(out_dir), "--dtype", args.dtype]
            single_s, ranks_s, loads, forward, waits = [], [], [], [], []
            for _ in range(args.repeats):
                before = os.getloadavg()[0]
                subprocess.run([sys.executable, script, "--role", "single", "--threads-single", "1", *common],
                               check=True, env=env, stdout=subprocess.DEVNULL)
                single = json.loads((out_dir / "single.json").read_text())
                single_s.append(single["sample_s"])
                forward.append(single["block_s_whole"] * BLOCKS)
                subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                "2", script, "--role", "rank", *common], check=True, env=env,
                               stdout=subprocess.DEVNULL)
                ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
                ranks_s.append(max(r["sample_s"] for r in ranks))
                waits.append([{"sample_s": r["sample_s"], **r.get("waited_s", {})} for r in ranks])
                loads.append((before, os.getloadavg()[0]))
            sampler = dataclasses.replace(SHAPE_SAMPLER, steps=args.steps)
            fwd = statistics.median(forward)
            one = simulate(plan_steps(sampler, tokens, 1, sampler.steps), tokens=tokens, forward_s=fwd, cfg=1, pp=1,
                           link=None)
            two = simulate(plan_steps(sampler, tokens, patches, args.warmup), tokens=tokens, forward_s=fwd, cfg=1,
                           pp=2, link=None)
            row = {"tokens": tokens, "patches": patches, "warmup": args.warmup, "steps": args.steps, "dtype": args.dtype,
                   "single_s": statistics.median(single_s), "two_ranks_s": statistics.median(ranks_s),
                   "runs_single_s": single_s, "runs_two_ranks_s": ranks_s, "forward_s_1thread": fwd,
                   "predicted_single_s": one, "predicted_two_ranks_s": two, "load_average_1min": loads,
                   "rank_waits_s": waits}
            row["measured_speedup"] = row["single_s"] / row["two_ranks_s"]
            row["predicted_speedup"] = one / two
            rows.append(row)
            print(f"tokens {tokens:5d} M={patches}: single {row['single_s']:.2f} s, 2 ranks {row['two_ranks_s']:.2f} s"
                  f" -> {row['measured_speedup']:.2f}x measured, {row['predicted_speedup']:.2f}x predicted; load "
                  + ", ".join(f"{a:.2f}->{b:.2f}" for a, b in loads), flush=True)
            # after every point, so that a sweep stopped half-way keeps what it measured
            Path(f"{args.report}_sweep.json").write_text(json.dumps({"cpu_count": os.cpu_count(), "rows": rows},
                                                                    indent=1) + "\n")


def markdown(rows: list[dict]) -> str:
    """The latency model as a table: seconds per stage and speed-up over one device, per link."""
    links = ["no link cost", *[link.name for link in LINKS]]
    lines = ["| stage (tokens, forward) | configuration | " + " | ".join(links) + " |",
             "|---|---|" + "---|" * len(links)]
    for row in rows:
        cells = [f"{row[name]:.2f} s ({row['single_s'] / row[name]:.2f}×)" for name in links]
        lines.append(f"| {row['stage']} ({row['tokens']}, {row['forward_s'] * 1000:.0f} ms) | {row['config']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(args, out_dir: Path) -> None:
    single = json.loads((out_dir / "single.json").read_text())
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
    exact = torch.load(out_dir / "single.pt")
    approx = torch.load(out_dir / "parallel.pt")
    sampler = dataclasses.replace(SHAPE_SAMPLER, steps=args.steps)
    plan = plan_steps(sampler, args.tokens, args.patches, args.warmup)
    L = args.tokens
    act_formula = sum(len(s.branches) for s in plan) * L * HIDDEN * 2 / len(plan)  # per step, the one boundary
    x_formula = (len(plan) - 1) * L * LATENT_CHANNELS * 4 / len(plan)
    measured = {"act": ranks[0]["bytes_sent"]["act"] / len(plan), "x": ranks[1]["bytes_sent"]["x0"] / len(plan)}
    cpu_forward_1t = single["block_s_whole"] * BLOCKS
    predicted = simulate(plan, tokens=L, forward_s=cpu_forward_1t, cfg=1, pp=2, link=None)
    results = {"args": {k: v for k, v in vars(args).items() if k in ("tokens", "steps", "patches", "warmup",
                                                                     "threads_single")},
               "load_average": args.load_average,
               "single": single, "ranks": ranks,
               "bytes_per_step": {"act_measured": measured["act"], "act_formula": act_formula,
                                  "x_measured": measured["x"], "x_formula": x_formula},
               "relative_l2_vs_single": ((approx - exact).norm() / exact.norm()).item(),
               "model_check": {"forward_s_1thread": cpu_forward_1t, "predicted_2rank_s": predicted,
                               "measured_2rank_s": max(r["sample_s"] for r in ranks)}}
    h200 = {"structure": (4096, 0.067, SamplerConfig(steps=12, guidance_strength=7.5, guidance_rescale=0.7,
                                                     guidance_interval=(0.6, 1.0), rescale_t=5.0)),
            "shape_512": (4096, 0.067, SHAPE_SAMPLER), "shape_1024": (20000, 0.307, SHAPE_SAMPLER),
            "texture": (20000, 0.307, SamplerConfig(steps=12, guidance_strength=1.0, guidance_rescale=0.0,
                                                    guidance_interval=(0.6, 0.9), rescale_t=3.0))}
    results["latency_model_h200"] = latency_table(h200, warmup=1)
    results["latency_model_cpu"] = latency_table({"shape_1024 (this CPU, 1 thread/rank)": (
        L, cpu_forward_1t, SHAPE_SAMPLER)}, warmup=1)
    args.report.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: v for k, v in results.items() if not k.startswith("latency")}, indent=1))
    print(markdown(results["latency_model_h200"]))
    print(markdown(results["latency_model_cpu"]))


if __name__ == "__main__":
    main()
