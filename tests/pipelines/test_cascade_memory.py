"""Peak-memory property of the cascade machinery: with four ~256 MB models on disk, one per stage, a staged
run's peak RSS is well below an eager run's (each run in its own process, so peaks do not mix)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pixal3d.models.loading import save_model

REPO = Path(__file__).resolve().parents[2]
MODELS = 4
ELEMENTS = 64 * 2**20  # float32: 256 MiB per model

RUN = textwrap.dedent("""
    import functools, json, sys
    from pathlib import Path
    import psutil, torch
    from torch import nn
    from pixal3d.models.loading import load_model, register_model
    from pixal3d.staging import Executor, Stage, StageRunner
    from pixal3d.telemetry.linux import process_memory

    @register_model("Blob")
    class Blob(nn.Module):
        def __init__(self, elements: int):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(elements))

    class Use(Stage):
        def __init__(self, i):
            self.name, self.needs = f"s{i}", (f"m{i}",)
        def working_set(self):
            return 0
        def run(self, state, models):
            state[self.name] = float(models[self.needs[0]].weight.sum())

    folder, policy, count = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    loaders = {f"m{i}": functools.partial(load_model, folder / f"m{i}", device="cpu") for i in range(count)}
    runner = StageRunner([Use(i) for i in range(count)], loaders, policy=policy)
    sums = {}
    before = psutil.Process().memory_info().rss
    Executor(runner).run(sums)
    # VmHWM: this process's own peak. (ru_maxrss is kept across exec, so it would start at the RSS the
    # parent, a pytest process, had when it forked this one.)
    peak = process_memory()[1]
    runner.close()
    print(json.dumps({"before": before, "peak": peak, "sums": sums}))
""")


@pytest.fixture(scope="module")
def blobs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("blobs")
    generator = torch.Generator().manual_seed(0)
    for i in range(MODELS):
        weight = torch.rand(ELEMENTS, generator=generator)
        save_model(_Holder(weight), {"name": "Blob", "args": {"elements": ELEMENTS}}, folder / f"m{i}")
        del weight
    (folder / "run.py").write_text(RUN)
    return folder


class _Holder(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)


def _peak_growth(folder: Path, policy: str) -> tuple[int, dict]:
    result = subprocess.run([sys.executable, str(folder / "run.py"), str(folder), policy, str(MODELS)],
                            capture_output=True, text=True, cwd=REPO, timeout=300, check=False,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout.strip().splitlines()[-1])
    return data["peak"] - data["before"], data["sums"]


@pytest.mark.skipif(sys.platform != "linux", reason="VmHWM (/proc/self/status) and page accounting checked on Linux")
def test_staged_peak_rss_is_well_below_eager(blobs):
    model_bytes = ELEMENTS * 4
    staged, staged_sums = _peak_growth(blobs, "staged")
    eager, eager_sums = _peak_growth(blobs, "eager")
    assert staged_sums == eager_sums  # same work done
    assert eager > 0.9 * MODELS * model_bytes, f"eager grew {eager / 2**20:.0f} MiB: all four models at once"
    # one model at a time, plus at most one model's worth of load transient (the file's mapped pages)
    assert staged < 2.2 * model_bytes, f"staged grew {staged / 2**20:.0f} MiB: about one model at a time"
    assert staged < 0.6 * eager
    print(f"peak RSS growth: staged {staged / 2**20:.0f} MiB, eager {eager / 2**20:.0f} MiB")
