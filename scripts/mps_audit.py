"""MPS op audit of the tiny cascade: every ATen op each stage sends to the device, checked against
the dispatch table of the installed torch (``pixal3d.audit``). Runs on a CPU-only machine.

What it runs, each on the stand-in device (``pixal3d.audit.standin``: the run's device is ``meta:1``,
whose tensors compute on the CPU, so every op shows which side of a Mac run it would be on):

1. the tiny cascade, every stage including the export, with the ``staged`` policy;
2. the same with the ``resident`` policy;
3. ``staged`` again with the published dtype placement (flow models bfloat16, decoders float16 —
   the tiny weights are float32 — and MoGe-2's forward with float16 autocast's casts,
   ``pixal3d.audit.autocast``, as it runs on mps), so the half-precision ops of a real run are audited too.

Then it prints the table (op, dtypes, stages, calls, MPS status) and a summary. Before that, the audit at
real sizes (``scripts/mps_real_size.py``): every device op of the published-size models at the reference's
counts, on ``meta``, judged against torch 2.13's MPS limits (``pixal3d/audit/limits.py``). Exits 1 if any
device op would fail on mps or exceed a limit.

    python scripts/mps_audit.py                              # print the page
    python scripts/mps_audit.py -o benchmarks/mps_audit.md   # also write it (docs/apple-silicon.md's source)
    python scripts/mps_audit.py --skip-real-size             # the tiny cascade only (~1 min instead of ~10)
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

if __package__ in (None, ""):  # run as a script: make the repository importable without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipelines.build import build_stages
from pipelines.loaders import model_loaders
from pipelines.state import PROVIDED, RunState
from pixal3d.audit import STANDIN, MpsAudit, mps_audit, to_standin
from pixal3d.audit.autocast import under_autocast
from pixal3d.config import CascadeConfig, load_config
from pixal3d.models.preprocess import load_image
from pixal3d.pipeline_json import ResolvedWeights, resolve_weights
from pixal3d.staging import StageRecord, StageRunner

logger = logging.getLogger("mps_audit")

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "configs" / "tiny.yaml"
EXAMPLE = REPO / "assets" / "example.png"

# (policy, dtype placement) of each audited run
RUNS: tuple[tuple[str, str], ...] = (("staged", "tiny"), ("resident", "tiny"), ("staged", "published"))

# The published checkpoints' precision switches (shared/reference/checkpoints.json): flows run in
# bfloat16, the three decoders in float16.
PUBLISHED_ARGS: dict[str, dict[str, object]] = {
    "sparse_structure_flow_model": {"dtype": "bfloat16"},
    "shape_slat_flow_model_512": {"dtype": "bfloat16"},
    "shape_slat_flow_model_1024": {"dtype": "bfloat16"},
    "tex_slat_flow_model_1024": {"dtype": "bfloat16"},
    "sparse_structure_decoder": {"use_fp16": True},
    "shape_slat_decoder": {"use_fp16": True},
    "tex_slat_decoder": {"use_fp16": True},
}


# MoGe-2 runs under float16 autocast on mps (camera.moge_precision: auto). The stand-in device has no autocast,
# so the published run gives MoGe-2's forward autocast's casts (pixal3d.audit.autocast).
AUTOCAST_MODELS = ("moge",)


def run_cascade(audit: MpsAudit, config: CascadeConfig, weights: ResolvedWeights, policy: str, *,
                autocast: Sequence[str] = ()) -> list[StageRecord]:
    """Run the tiny cascade over assets/example.png on the stand-in device, naming each stage to ``audit``.

    The cascade's own stages on the generic ``StageRunner`` (what ``Pixal3D.run`` does, with one difference):
    models load on the CPU (safetensors cannot open ``meta:1``) and move to the stand-in device, so a
    loader's own dtype casts show as host ops; everything else follows ``state.device``. ``autocast``: the models
    whose forward runs under ``pixal3d.audit.autocast`` (their float16 autocast on mps)."""
    stages = build_stages(config)
    loaders = {name: _on_standin(loader, autocast=name in autocast)
               for name, loader in model_loaders(weights, torch.device("cpu"), moge="moge" in weights.sources).items()}
    runner = StageRunner(stages, loaders, provides=PROVIDED, state_type=RunState, policy=policy)
    state = RunState(input_image=load_image(EXAMPLE), generator=torch.Generator().manual_seed(config.seed),
                     device=STANDIN, shape_normalization=weights.shape_normalization,
                     tex_normalization=weights.tex_normalization)
    records = []
    try:
        for stage in stages:
            audit.stage = stage.name
            records.append(runner.run_stage(stage, state))
        return records
    finally:
        runner.close()
        audit.stage = "-"


def _on_standin(loader: Callable[[], nn.Module], *, autocast: bool = False) -> Callable[[], nn.Module]:
    return lambda: under_autocast(to_standin(loader())) if autocast else to_standin(loader())


def published_dtypes(weights: ResolvedWeights, folder: Path) -> ResolvedWeights:
    """The tiny checkpoints with the published precision switches (copies of the json specs in ``folder``,
    the safetensors linked): the loader casts each tensor to the dtype the model declares."""
    checkpoints = {}
    for name, stem in weights.checkpoints.items():
        spec = json.loads(stem.with_suffix(".json").read_text())
        spec["args"].update(PUBLISHED_ARGS.get(name, {}))
        target = folder / stem.name
        target.with_suffix(".json").write_text(json.dumps(spec, indent=2) + "\n")
        target.with_suffix(".safetensors").symlink_to(stem.with_suffix(".safetensors").resolve())
        checkpoints[name] = target
    return dataclasses.replace(weights, checkpoints=checkpoints)


def audit_tiny_cascade(runs: Sequence[tuple[str, str]] = RUNS, *, config: CascadeConfig | None = None,
                       weights: ResolvedWeights | None = None) -> MpsAudit:
    """Audit ``runs`` ((policy, "tiny" | "published") pairs) of the tiny cascade into one ``MpsAudit``."""
    config = config if config is not None else load_config(TINY_CONFIG)
    weights = weights if weights is not None else resolve_weights(config.weights, offline=True,
                                                                  need_moge=config.weights.moge is not None)
    with tempfile.TemporaryDirectory(prefix="mps-audit-") as tmp, mps_audit() as audit:
        for i, (policy, placement) in enumerate(runs):
            run_weights, autocast = weights, ()
            if placement == "published":
                folder = Path(tmp) / f"published-{i}"
                folder.mkdir()
                run_weights, autocast = published_dtypes(weights, folder), AUTOCAST_MODELS
            elif placement != "tiny":
                raise ValueError(f"dtype placement {placement!r} is not 'tiny' or 'published'")
            run_cascade(audit, config, run_weights, policy, autocast=autocast)
    return audit


def report(audit: MpsAudit, runs: Sequence[tuple[str, str]], seconds: float) -> str:
    """The tiny cascade's section: how it was made, the summary, the table."""
    s = audit.summary()
    problems = "\n".join(f"- {p}" for p in s["problems"]) or "- none"
    return (
        "## Every op of the tiny cascade has an MPS kernel\n\n"
        f"`python scripts/mps_audit.py -o benchmarks/mps_audit.md` — torch {torch.__version__}, "
        f"{platform.system()} {platform.machine()}, {seconds:.0f} s. Runs: "
        + ", ".join(f"{p} ({d} dtypes)" for p, d in runs) + ". Every stage ran on the stand-in device "
        "(`pixal3d/audit/standin.py`); each op that took or made a device tensor is classified against "
        "torch's `native_functions.yaml` (`pixal3d/audit/dispatch_table.py`). Composite-explicit ops are "
        "listed with the ops their kernels call.\n\n"
        f"- {s['device_ops']} distinct device ops ({s['rows']} op/dtype rows, {s['device_calls']} calls); "
        f"{s['host_ops']} host-side ops ({s['host_calls']} calls) not judged\n"
        f"- bfloat16 on the device (macOS 14+): {', '.join(f'`{o}`' for o in s['bfloat16_ops']) or 'none'}\n"
        f"- complex64 on the device (macOS 14+): {', '.join(f'`{o}`' for o in s['complex64_ops']) or 'none'}\n"
        f"- ops that would fail on mps:\n{problems}\n\n"
        + audit.to_markdown())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--output", type=Path, help="also write the markdown page here")
    parser.add_argument("--skip-real-size", action="store_true", help="audit the tiny cascade only")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    gc.collect()
    gc.freeze()  # as pipelines.cli.main does: keeps the collection in every release cheap
    sections, failed = ["# MPS op audit\n"], False
    if not args.skip_real_size:
        from scripts.mps_real_size import Models, cases, run_cases, untiled_1536_decode
        from scripts.mps_real_size import report as real_size_report

        start = time.perf_counter()
        models = Models()
        sized = run_cases(cases(models))
        before = run_cases([untiled_1536_decode(models)])
        sections.append(real_size_report(sized, before, time.perf_counter() - start))
        failed = bool(sized.problems())
    start = time.perf_counter()
    audit = audit_tiny_cascade(RUNS)
    sections.append(report(audit, RUNS, time.perf_counter() - start))
    page = "\n".join(sections)
    print(page)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(page, encoding="utf-8")
    return 1 if failed or audit.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
