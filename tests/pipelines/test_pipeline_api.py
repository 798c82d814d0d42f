"""The library entry point: Pixal3D.from_config(...).run(image, seed=...) -> Result. Seeds, the global
generators, progress reports, stages replaced by name, declarations refused before anything is read."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image

from pipelines import Pixal3D
from pipelines.structure import StructureStage
from pixal3d.staging import StageGraphError
from tests.support.cascade_fixtures import EXAMPLE, REPO, TINY_CONFIG, run_tiny, tiny, tiny_cache  # noqa: F401

FRESH = textwrap.dedent("""
    import json, sys
    from pipelines import Pixal3D
    with Pixal3D.from_config(sys.argv[1], policy="staged", device="cpu", until="shape_1024") as pipe:
        print(json.dumps(pipe.run(sys.argv[2], seed=int(sys.argv[3])).fingerprints()))
""")


def test_two_runs_in_one_process_equal_two_fresh_processes(tiny, tiny_cache):
    children = [subprocess.Popen([sys.executable, "-c", FRESH, str(TINY_CONFIG), str(EXAMPLE), str(seed)], cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for seed in (1, 2)]
    with Pixal3D.from_config(tiny, policy="resident", device="cpu", until="shape_1024") as pipe:
        in_process = [pipe.run(EXAMPLE, seed=seed).fingerprints() for seed in (1, 2)]
    fresh = [json.loads(child.communicate(timeout=120)[0].strip().splitlines()[-1]) for child in children]
    assert [child.returncode for child in children] == [0, 0]
    assert in_process == fresh
    assert in_process[0]["structure"]["ss_noise"] != in_process[1]["structure"]["ss_noise"]  # control


def _consuming(name, load):
    def loader():
        torch.randn(16)  # as a model built with random init would
        return load()
    return loader


@pytest.mark.parametrize("preserve", [True, False])
def test_a_run_leaves_the_global_generator_where_it_was(tiny, preserve):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    result = run_tiny(tiny, "staged", until="shape_512", preserve_rng=preserve, wrap_loader=_consuming)
    assert torch.equal(torch.get_rng_state(), before) == preserve  # False: the control, loads moved it
    reference = run_tiny(tiny, "eager", until="shape_512")
    assert result.fingerprints() == reference.fingerprints()  # the run's own generator is untouched either way


def test_progress_reports_every_stage_and_every_sampler_step(tiny):
    reports = []
    with Pixal3D.from_config(tiny, policy="staged", device="cpu", until="texture") as pipe:
        pipe.run(np.array(Image.open(EXAMPLE)), callback=reports.append)
    stages = [r["stage"] for r in reports if r["kind"] == "stage"]
    assert stages == ["preprocess", "camera", "features", "structure", "shape_512", "upsample", "shape_1024",
                      "texture"]
    steps = [(r["stage"], r["step"], r["steps"]) for r in reports if r["kind"] == "step"]
    assert steps == [(s, k, 2) for s in ("structure", "shape_512", "shape_1024", "texture") for k in (1, 2)]


class _Orphan(StructureStage):
    inputs = (*StructureStage.inputs, "tex_latent")  # written only later, by the texture stage


class _Vague(StructureStage):
    def working_set(self):
        return None


class _Unstorable(StructureStage):
    outputs = (*StructureStage.outputs, "cond")  # transient elsewhere: RunState declares no codec for it


@pytest.mark.parametrize(("stage", "message"), [(_Orphan, r"'structure' reads \['tex_latent'\]"),
                                                (_Vague, "'structure' .*declares no working-set estimate"),
                                                (_Unstorable, r"'structure' writes \['cond'\], which have no "
                                                              r"codec")])
def test_bad_stage_declarations_are_refused_before_any_file_is_read(tiny, monkeypatch, stage, message):
    def no_reading(*args, **kwargs):
        raise AssertionError("nothing may be read before the stages are checked")
    monkeypatch.setattr("pipelines.ranks.planned_sizes", no_reading)  # the plan's step 4 (a rank's sizes)
    with pytest.raises(StageGraphError, match=message):
        Pixal3D.plan(tiny, device="cpu", replace={"structure": stage.from_config(tiny)})


class _FixedCoords(StructureStage):
    """A stage replaced by name: a fixed 2×2×2 block of coords, no models."""

    needs = ()

    def working_set(self):
        return 123

    def run(self, state, models):
        state.ss_noise = state.ss_latent = torch.zeros(1)
        state.coords_lr = torch.tensor([[0, x, y, z] for x in (3, 4) for y in (3, 4) for z in (3, 4)],
                                       dtype=torch.int32)


def test_a_stage_replaced_by_name_runs_and_the_plan_asks_it(tiny):
    plan = Pixal3D.plan(tiny, policy="staged", device="cpu", replace={"structure": _FixedCoords.from_config(tiny)},
                        until="shape_512")
    row = next(s for s in plan.memory.stages if s.name == "structure")
    assert row.working_bytes == 123 and row.models == ()
    with Pixal3D.from_plan(plan) as pipe:
        result = pipe.run(EXAMPLE)
    assert result.state.coords_lr.shape == (8, 4) and result.state.lr_latent.feats.shape[0] == 8
    assert next(r for r in result.stages if r.stage == "structure").used == []
    with pytest.raises(ValueError, match="no mesh to save"):
        result.save("x.glb")
    with pytest.raises(KeyError, match=r"no stage named \['structur'\] to replace"):
        Pixal3D.plan(tiny, device="cpu", replace={"structur": _FixedCoords.from_config(tiny)})


def test_run_refuses_bad_seeds_and_fields_of_view_before_any_work(tiny):
    with Pixal3D.from_config(tiny, policy="staged", device="cpu", until="camera") as pipe:
        for seed in (-1, 2**64, 1.5, True):
            with pytest.raises(ValueError, match="not an integer in"):
                pipe.run(EXAMPLE, seed=seed)
        with pytest.raises(ValueError, match="not in \\(0, 180\\) degrees"):
            pipe.run(EXAMPLE, fov=180.0)
        assert pipe.run(EXAMPLE, seed=2**64 - 1, fov=30.0).state.camera.fov == pytest.approx(np.radians(30.0))
