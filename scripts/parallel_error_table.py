"""PipeFusion's approximation: relative L2 of each flow stage's latent against the exact result, for
warmup W ∈ {0, 1, 2, 4, 8, S} at fixed patch counts M (issue 13, test 8).

The error depends on (M, W, patch order) only, not on the number of ranks (the distributed runtime is
bitwise the emulator, tests/pixal3d/parallel/test_parallel_ranks.py), so the single-process emulator measures it. The
exact result is the same emulator at W = S (bitwise the single-process sampler).

Models: the tiny config's four flow checkpoints (deterministic random weights, 2 blocks, 32 channels;
``pixal3d/tiny_weights.py``) with each stage's real sampler settings from configs/1024_cascade.yaml
(CFG strength, interval, rescale, rescale_t) at 12 steps (the cascade's count) and 24. Inputs: seeded
random noise and conditions (global 20 tokens, per-token proj), the negative is zeros as in the
cascade; sparse stages on random voxel sets (shape 512: 200 of 8³, shape 1024 / texture: 600 of 16³).
Mean over 8 seeds (one seed's
error moves by about ±2 % between adjacent small W). Random weights are not trained ones: these numbers
show the schedule's behaviour (falls with W, 0 at W = S), not the quality loss of the published models.

    python scripts/parallel_error_table.py            # writes benchmarks/parallel_error.{md,json}
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pixal3d.config import load_config
from pixal3d.pipeline_json import published_samplers, resolve_samplers
from pixal3d.models import load_model
from pixal3d.nn.sparse_tensor import SparseTensor
from pixal3d.parallel import emulate_pipefusion

REPO = Path(__file__).resolve().parents[1]
# stage → (tiny checkpoint registry name, sparse token count or None for the dense 4³ grid)
STAGES = {"structure": ("sparse_structure_flow_model", None), "shape_512": ("shape_slat_flow_model_512", 200),
          "shape_1024": ("shape_slat_flow_model_1024", 600), "texture": ("tex_slat_flow_model_1024", 600)}
WARMUPS = (0, 1, 2, 4, 8)


def stage_inputs(model: torch.nn.Module, tokens: int | None, seed: int) -> tuple:
    """Seeded ``(noise, cond, neg_cond, concat_cond)`` for a flow model."""
    gen = torch.Generator().manual_seed(seed)
    r = model.resolution
    context = torch.randn(1, 20, model.cond_channels, generator=gen)
    if tokens is None:
        noise = torch.randn(1, model.in_channels, r, r, r, generator=gen)
        cond = {"global": context, "proj": torch.randn(1, r ** 3, model.proj_channels, generator=gen)}
        return noise, cond, {k: torch.zeros_like(v) for k, v in cond.items()}, None
    cells = torch.randperm(r ** 3, generator=gen)[:tokens].sort().values
    coords = torch.stack([torch.zeros_like(cells), cells // r ** 2, cells // r % r, cells % r], dim=1).int()
    noise = SparseTensor(torch.randn(tokens, model.out_channels, generator=gen), coords)
    proj = SparseTensor(torch.randn(tokens, model.proj_channels, generator=gen), coords)
    extra = model.in_channels - model.out_channels
    concat = SparseTensor(torch.randn(tokens, extra, generator=gen), coords) if extra else None
    cond = {"global": context, "proj": proj}
    neg = {"global": torch.zeros_like(context), "proj": proj.replace(torch.zeros_like(proj.feats))}
    return noise, cond, neg, concat


def relative_errors(model: torch.nn.Module, tokens: int | None, sampler, patches: int, warmups: list[int],
                    seeds: range) -> dict[int, float]:
    """W → mean over ``seeds`` of ‖latent(M, W) − latent(exact)‖ / ‖latent(exact)‖."""
    out = {w: 0.0 for w in warmups}
    for seed in seeds:
        inputs = stage_inputs(model, tokens, seed)
        exact = _emulate(model, inputs, sampler, patches, sampler.steps)
        for w in warmups:
            out[w] += ((_emulate(model, inputs, sampler, patches, w) - exact).norm() / exact.norm()).item() / len(seeds)
    return out


def _emulate(model: torch.nn.Module, inputs: tuple, sampler, patches: int, warmup: int) -> torch.Tensor:
    noise, cond, neg, concat = inputs
    x = emulate_pipefusion(model, noise, cond=cond, neg_cond=neg, concat_cond=concat, sampler=sampler,
                           patches=patches, warmup=warmup)
    return x.feats if isinstance(x, SparseTensor) else x


def tiny_flow_stems() -> dict[str, Path]:
    """Registry name → stem of the tiny config's flow checkpoints (generated on first use)."""
    import pixal3d.models  # noqa: F401 -- registers every network class
    from pixal3d.hub import cache_root
    from pixal3d.tiny_weights import CHECKPOINTS, ensure_tiny_weights

    root = ensure_tiny_weights(cache_root() / "tiny")
    return {name: root / "pixal3d" / CHECKPOINTS[name][0] for name, _ in STAGES.values()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "parallel_error")
    parser.add_argument("--seeds", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    real = resolve_samplers(load_config(REPO / "configs" / "1024_cascade.yaml"), {"args": published_samplers()})
    stems = tiny_flow_stems()
    rows = []
    for stage, (name, tokens) in STAGES.items():
        model = load_model(stems[name])
        base = getattr(real, stage).sampler
        for steps, patches in ((12, 2), (12, 4), (12, 8), (24, 4)):
            sampler = dataclasses.replace(base, steps=steps)
            start = time.perf_counter()
            errors = relative_errors(model, tokens, sampler, patches, [*WARMUPS, steps], range(args.seeds))
            rows.append({"stage": stage, "tokens": tokens or model.resolution ** 3, "steps": steps, "M": patches,
                         "errors": {str(w): e for w, e in errors.items()}})
            print(stage, steps, patches, " ".join(f"W{w}={e:.5f}" for w, e in errors.items()),
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["| stage | tokens | steps | M | " + " | ".join(f"W = {w}" for w in WARMUPS) + " | W = S |",
             "|---|---|---|---|" + "---|" * (len(WARMUPS) + 1)]
    for row in rows:
        errs = row["errors"]
        cells = [f"{errs[str(w)]:.4f}" for w in WARMUPS] + [f"{errs[str(row['steps'])]:.4f}"]
        lines.append(f"| {row['stage']} | {row['tokens']} | {row['steps']} | {row['M']} | " + " | ".join(cells) + " |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
