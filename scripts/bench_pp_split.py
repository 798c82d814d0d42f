"""PipeFusion's split at real sizes on ``meta``: per-rank bytes of the even split and of ``--pp-split auto`` on two
mismatched devices, for the 1024 cascade's four flow models at its token counts (issue 28).

    PYTHONPATH=$PWD python scripts/bench_pp_split.py [--devices 12,16 12,24] [--out benchmarks/pp_split.md]

Nothing is loaded: each flow model is built on ``meta`` from its published config (``assets/checkpoints.json``) and
cut into the shard each rank would hold (``build_flow_shard``), so the weight bytes are the real ones. Per rank and
flow stage the table adds what that rank holds while the stage runs under the staged policy (one flow at a time):

* its shard's weights;
* PipeFusion's K/V buffers: its blocks x K and V x 2 CFG branches x the stage's planned tokens (4096 dense,
  ~3.9k LR, ~20k HR) x 1536 channels x bf16 (``pipelines.parallel.kv_bytes_per_block``, what the plan prints);
* the stage's working set as the plan estimates it for one process (``stage.working_set()``), counted in full on
  every rank (an upper bound: a rank works on patches of the sequence);
* on rank 0 only, the stage's other models (DINOv3 ViT-L, NAF, the structure decoder), which rank 0 also runs.

A rank fits when its largest stage is within the plan's usable share of its device (``staging.policy.usable``).
The resident columns hold every flow's shard at once (and on rank 0 every other model but the background
remover), plus the largest stage's K/V and work.
``auto`` divides blocks as ``Pixal3D.plan`` does: in proportion to each rank's usable memory less the other models
its largest flow stage holds (rank 0's DINOv3 and NAF; nothing on the other ranks).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipelines.build import build_stages  # noqa: E402
from pipelines.parallel import flow_stages, kv_bytes_per_block, stage_tokens  # noqa: E402
from pixal3d.config import load_config  # noqa: E402
from pixal3d.parallel import build_flow_shard, parameter_bytes  # noqa: E402
from pixal3d.parallel.split import describe_split, model_split  # noqa: E402
from pixal3d.staging.policy import usable  # noqa: E402

GIB = 2**30
MANIFEST = REPO / "assets" / "checkpoints.json"


def gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def other_models(stage_needs: tuple[str, ...], manifest: dict) -> int:
    """Bytes of a flow stage's other models on rank 0: decoders from the manifest, DINOv3 ViT-L and NAF built on
    meta at their published widths (scripts/mps_real_size.py)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from mps_real_size import meta_dinov3, meta_naf

    total = 0
    for name in stage_needs:
        if name == "dinov3":
            total += parameter_bytes(meta_dinov3())
        elif name == "naf":
            total += parameter_bytes(meta_naf())
        elif name in manifest and name not in FLOWS:
            spec = manifest[name]
            total += spec["params"] * {"F16": 2, "BF16": 2, "F32": 4}[spec["dtype"]]
    return total


FLOWS: set[str] = set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", nargs="+", default=["12,16", "12,24"], help="GiB of each rank's device")
    parser.add_argument("--config", default=str(REPO / "configs" / "1024_cascade.yaml"))
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    args = parser.parse_args(argv)
    manifest = json.loads(MANIFEST.read_text())["models"]
    stages = [s for s in build_stages(load_config(args.config))]
    flows = flow_stages(stages)
    FLOWS.update(s.flow_model for s in flows)
    extras = {s.name: other_models(tuple(s.needs), manifest) for s in flows}
    shard_bytes: dict[tuple[str, tuple[int, ...], int], int] = {}

    def shard(name: str, split: tuple[int, ...], k: int) -> int:
        key = (name, split, k)
        if key not in shard_bytes:
            spec = manifest[name]
            shard_bytes[key] = parameter_bytes(build_flow_shard({"name": spec["class"], "args": spec["args"]}, k,
                                                                len(split), split=split))
        return shard_bytes[key]

    resident_extra = other_models(tuple(dict.fromkeys(m for st in stages for m in st.needs if m != "rembg")), manifest)
    lines = ["| devices (GiB) | split | rank | usable GiB | blocks per flow | largest stage | shard GiB | K/V GiB | "
             "work GiB | rank-0 models GiB | staged peak GiB | fits | resident peak GiB | fits |", "|" + "---|" * 14]
    for pair in args.devices:
        devices = [int(x) * GIB for x in pair.split(",")]
        room = [usable(d) for d in devices]
        # what Pixal3D.plan gathers for auto: usable memory less the other models of the rank's largest flow stage
        beside = max(extras.values())
        capacities = [max(0, r - (beside if k == 0 else 0)) for k, r in enumerate(room)]
        for kind in ("even", "auto"):
            splits = {s.flow_model: model_split(None if kind == "even" else "auto",
                                                manifest[s.flow_model]["args"]["num_blocks"], len(devices), capacities)
                      for s in flows}
            for k in range(len(devices)):
                rows = []
                for s in flows:
                    split = splits[s.flow_model]
                    kv = split[k] * kv_bytes_per_block(stage_tokens(s))
                    work = int(s.working_set())
                    extra = extras[s.name] if k == 0 else 0
                    weights = shard(s.flow_model, split, k)
                    rows.append((weights + kv + work + extra, s.name, weights, kv, work, extra))
                peak, name, weights, kv, work, extra = max(rows)
                # resident: every flow's shard (and, on rank 0, every other model) held, plus the largest stage's work
                resident = (sum(shard(s.flow_model, splits[s.flow_model], k) for s in flows)
                            + max(r[3] + r[4] for r in rows) + (resident_extra if k == 0 else 0))
                blocks = ", ".join(sorted({describe_split(v) for v in splits.values()}))
                lines.append(f"| {pair.replace(',', ' + ')} | {kind} | {k} | {gib(room[k])} | {blocks} | {name} | "
                             f"{gib(weights)} | {gib(kv)} | {gib(work)} | {gib(extra)} | {gib(peak)} | "
                             f"{'yes' if peak <= room[k] else 'no'} | {gib(resident)} | "
                             f"{'yes' if resident <= room[k] else 'no'} |")
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    raise SystemExit(main())
