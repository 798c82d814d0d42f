"""The cascade and the command under torchrun's conditions (issue 13, phase 2): ranks joined by env:// on
loopback, gloo, the tiny config (``tests/support/parallel_cascade_harness.py``). Rank 0 runs the cascade; the
others join its four flow stages holding their shards.

Bitwise comparisons need the same kernels on the same shapes, and thread counts change CPU matmul
rounding: the reference fingerprints (the session's eager run, ``tests/support/cascade_fixtures.py``) are those of
the suite's thread count (``tests/conftest.py``), so the exact comparisons run their ranks with that many
threads; the PipeFusion comparison runs ranks and the single-process oracle with one thread each.
"""
from __future__ import annotations

import functools
import json
import time

import pytest

from pipelines import Pixal3D, cli, flow_stage
from pipelines.ranks import Rank
from pixal3d.config import SamplerConfig
from pixal3d.parallel import ParallelConfigError, ParallelSettings, emulate_pipefusion
from pixal3d.pipeline_json import resolve_weights
from tests.support.cascade_fixtures import EXAMPLE, TINY_CONFIG, first_difference, tiny, tiny_cache, tiny_reference  # noqa: F401
from tests.support.parallel_cascade_harness import FLOWS, cli_worker, library_worker
from tests.support.parallel_harness import spawn

from tests.conftest import THREADS as REFERENCE_THREADS  # the reference run's thread count


def _torchrun_env(monkeypatch, rank: int, world: int) -> None:
    for key, value in dict(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=1).items():
        monkeypatch.setenv(key, str(value))


# -- one process ---------------------------------------------------------------------------------
def test_parallel_none_is_todays_code_path_and_gives_the_eager_fingerprints(tiny, tiny_reference, monkeypatch):
    """Test 1: ``parallel=ParallelSettings()`` (mode none, N = 1, no CFG-parallel) runs today's sampler —
    parallel_sample is never called — and gives the eager run's fingerprints; run.json has no parallel entry."""
    def refuse(*args, **kwargs):
        raise AssertionError("parallel_sample called with --parallel none")
    monkeypatch.setattr(flow_stage, "parallel_sample", refuse)
    with Pixal3D.from_config(tiny, policy="staged", device="cpu", until="decode", parallel=ParallelSettings()) as pipe:
        assert pipe.parallel is None and not pipe.is_follower and type(pipe.run_plan.role) is Rank
        result = pipe.run(EXAMPLE)
    assert result.fingerprints() == tiny_reference, first_difference(result.fingerprints(), tiny_reference)
    assert result.parallel is None and "parallel" not in result.record()


@pytest.mark.parametrize("argv, env, words", [
    (["--parallel", "cfg"], dict(RANK=0, WORLD_SIZE=3), ["needs 2 processes", "WORLD_SIZE is 3"]),
    (["--parallel", "pipefusion", "--pp", "2", "--patches", "0"], dict(RANK=0, WORLD_SIZE=2), ["--patches 0", ">= 1"]),
    (["--parallel", "both", "--pp", "2"], dict(RANK=0, WORLD_SIZE=2), ["needs 4 processes"]),
    (["--pp", "2"], {}, ["--pp needs --parallel pipefusion or both"]),
    ([], dict(RANK=0, WORLD_SIZE=2), ["torchrun started 2 processes but --parallel is none"]),
    (["--parallel", "cfg"], {}, ["runs under torchrun", "--nproc-per-node 2"]),
])
def test_bad_parallel_settings_are_one_line_on_rank_0_and_exit_2_on_every_rank(tmp_path, capsys, monkeypatch,
                                                                                argv, env, words):
    """Settings that do not fit the job are refused before any rendezvous, identically on every rank:
    rank 0 prints one line, every rank exits 2 (the other ranks silently)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for rank in range(2 if env else 1):
        for key, value in {**env, **({"RANK": rank} if env else {})}.items():
            monkeypatch.setenv(key, str(value))
        code = cli.main([str(EXAMPLE), "--config", str(TINY_CONFIG), "-o", str(tmp_path / "o.glb"), *argv])
        out, err = capsys.readouterr()
        assert code == 2
        if rank == 0:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("pixal3d-image-to-mesh: error: "), err
            assert all(w in lines[0] for w in words), lines[0]
        else:
            assert err == "" and out == ""
    assert not list(tmp_path.iterdir())


def test_warmup_above_a_stages_steps_is_refused_by_the_plan(tiny, monkeypatch):
    """W > steps (the tiny stages have 2) is found from the config before any weight is read, naming the
    stage; W = steps is accepted."""
    _torchrun_env(monkeypatch, 0, 2)
    with pytest.raises(ParallelConfigError, match=r"warmup=3 is more than stage structure's 2 sampler steps"):
        Pixal3D.plan(tiny, device="cpu", parallel=ParallelSettings(mode="pipefusion", pp=2, warmup=3))
    plan = Pixal3D.plan(tiny, device="cpu", parallel=ParallelSettings(mode="pipefusion", pp=2, warmup=2))
    assert plan.rank == 0 and not plan.follower and "rank 0 of 2 runs every stage" in plan.table()
    _torchrun_env(monkeypatch, 1, 2)
    follower = Pixal3D.plan(tiny, device="cpu", parallel=ParallelSettings(mode="pipefusion", pp=2, warmup=2))
    assert follower.follower and follower.model_names() == list(FLOWS)  # only the flow models (as shards)
    assert [s.name for s in follower.stages] == ["structure", "shape_512", "shape_1024", "texture", "between_images"]


def test_the_plan_counts_each_ranks_shard_of_the_flow_models(tiny, monkeypatch):
    """Under PipeFusion a rank holds ~1/N of each flow model: the plan's model sizes are the shard's tensor
    bytes from the checkpoint header (not the whole file), the two ranks' shards together hold every block
    once, and CFG-parallel alone (whole models on each rank) counts whole files."""
    from pixal3d.hub import read_safetensors_header
    from pixal3d.parallel.shard import shard_tensor_names

    def tensor_bytes(tensors, names):
        return sum(tensors[n]["data_offsets"][1] - tensors[n]["data_offsets"][0] for n in names)

    settings = ParallelSettings(mode="pipefusion", pp=2, warmup=1)
    plans = []
    for rank in (0, 1):
        _torchrun_env(monkeypatch, rank, 2)
        plans.append(Pixal3D.plan(tiny, device="cpu", parallel=settings))
    _torchrun_env(monkeypatch, 0, 2)
    cfg = Pixal3D.plan(tiny, device="cpu", parallel=ParallelSettings(mode="cfg"))
    weights = resolve_weights(tiny.weights)
    for name in FLOWS:
        tensors = read_safetensors_header(f"{weights.checkpoints[name]}.safetensors")
        whole = tensor_bytes(tensors, tensors)
        shards = [plan.memory.model_bytes[name] for plan in plans]
        assert shards == [tensor_bytes(tensors, shard_tensor_names(tensors, k, 2)) for k in (0, 1)], name
        assert max(shards) < whole, name
        shared = tensor_bytes(tensors, [n for n in tensors if n.split(".")[0] not in ("blocks", "input_layer",
                                                                                     "out_layer")])
        assert sum(shards) == whole + shared, name  # every block, the input and output layers once
        assert cfg.memory.model_bytes[name] == whole, name
    assert "counted below as its shard" in plans[1].table()


def test_ranks_on_one_machine_plan_with_their_share_of_its_memory(tiny, monkeypatch):
    """torchrun's LOCAL_WORLD_SIZE ranks on one machine share its memory (on the CPU, as on a Mac, device and
    host are one pool): each plans with 1/n of what is available, and says so; a rank alone on its machine
    plans with all of it (control). On a discrete GPU only the host memory is shared."""
    from pipelines.parallel import machine_share
    from pixal3d.parallel.topology import Topology
    from pixal3d.staging import Machine

    settings = ParallelSettings(mode="cfg")
    _torchrun_env(monkeypatch, 0, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    shared = Pixal3D.plan(tiny, device="cpu", parallel=settings)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    alone = Pixal3D.plan(tiny, device="cpu", parallel=settings)
    assert shared.machine.device_available < 0.6 * alone.machine.device_available
    assert any(r.startswith("2 ranks of this job run on this machine") for r in shared.reasons)
    assert not any("ranks of this job" in r for r in alone.reasons)
    gpu = Machine("cuda:0", "GPU", False, 80 * 2**30, 70 * 2**30, 256 * 2**30, 200 * 2**30)
    share, _ = machine_share(gpu, Topology(rank=0, world_size=4, local_rank=0, cfg_degree=2, pp_degree=2,
                                           local_world_size=4))
    assert (share.device_available, share.host_available) == (70 * 2**30, 50 * 2**30)


def test_a_follower_rank_fetches_only_the_flow_checkpoints(tiny, monkeypatch, tmp_path):
    """A follower loads flow shards and nothing else, so a machine joining the job needs neither DINOv3 nor
    NAF: with both sources pointing at an empty folder the follower resolves its weights; rank 0, which needs
    them, refuses (control)."""
    import dataclasses

    from pixal3d.config import WeightSource
    from pixal3d.hub import MissingWeightsError

    empty = WeightSource(local=str(tmp_path))
    config = dataclasses.replace(tiny, weights=dataclasses.replace(tiny.weights, dinov3=empty, naf=empty))
    settings = ParallelSettings(mode="pipefusion", pp=2, warmup=1)
    _torchrun_env(monkeypatch, 1, 2)
    weights = Pixal3D.plan(config, device="cpu", parallel=settings).resolved_weights()
    assert weights.path("dinov3") is None and weights.path("naf") is None and set(weights.checkpoints) >= set(FLOWS)
    _torchrun_env(monkeypatch, 0, 2)
    with pytest.raises(MissingWeightsError, match=r"weights\.dinov3"):
        Pixal3D.plan(config, device="cpu", parallel=settings)


# -- several processes ----------------------------------------------------------------------------
@pytest.mark.golden
def test_cfg_parallel_through_the_cascade_gives_the_eager_fingerprints(tiny_cache, tiny_reference, tmp_path):
    """Test 4 at the cascade level: rank 0 runs the whole cascade, rank 1 the negative CFG passes of its
    four flow stages with its own (whole) flow models: the eager run's fingerprints, bit for bit. The record
    holds both ranks' per-stage peaks; rank 1 loaded the four flow models and nothing else. (That this
    comparison can fail: the PipeFusion test below shows cascade fingerprints that differ from the exact
    ones.)"""
    run = spawn(2, library_worker, str(tiny_cache), ParallelSettings(mode="cfg", timeout_s=60),
                [(str(EXAMPLE), 42)], REFERENCE_THREADS, "decode", folder=tmp_path, timeout_s=150)
    assert run.exitcodes == [0, 0], run.errors
    leader, follower = run.results
    assert leader["fingerprints"] == [tiny_reference]
    assert follower["images"] == 1
    assert follower["loads"] == [(name, 0, 1) for name in FLOWS]  # whole models: the one shard of one stage
    record = leader["parallel"][0]
    assert (record["mode"], record["world_size"], record["backend"]) == ("cfg", 2, "gloo")
    assert [r["rank"] for r in record["ranks"]] == [0, 1]
    assert [s["stage"] for s in record["ranks"][1]["stages"]][1:] == [
        "structure", "shape_512", "shape_1024", "texture", "between_images"]
    assert all(r["peak_process_bytes"] > 0 for r in record["ranks"])


def _emulating(patches: int, warmup: int):
    """``sample_flow_euler``'s signature over the single-process PipeFusion emulator (the oracle)."""
    def sample(flow, noise, *, cond, neg_cond, progress, callback, **params):
        partial = isinstance(flow, functools.partial)
        model, concat = (flow.func, flow.keywords["concat_cond"]) if partial else (flow, None)
        return emulate_pipefusion(model, noise, cond=cond, neg_cond=neg_cond, concat_cond=concat,
                                  sampler=SamplerConfig(**params), patches=patches, warmup=warmup)
    return sample


def test_pipefusion_cascade_equals_the_emulator_and_images_in_a_row_equal_fresh_runs(tiny, tiny_cache, tmp_path,
                                                                                     monkeypatch, one_thread):
    """PipeFusion N = 2, M = 2, W = 0 through the cascade (each rank holds half of each flow's blocks):
    two images in a row through the same ranks give, stage by stage, the fingerprints of two fresh
    single-process cascades whose flow stages run the emulator of the same schedule (test 3 and test 5 at
    the cascade level; W = 0 makes every streamed step read the K/V buffers, so a buffer left from the
    first image would show). Control: the exact sampler gives other latents."""
    runs = [(str(EXAMPLE), 42), (str(EXAMPLE), 7)]
    run = spawn(2, library_worker, str(tiny_cache), ParallelSettings(mode="pipefusion", pp=2, patches=2, warmup=0,
                                                                      timeout_s=60),
                runs, 1, "decode", folder=tmp_path, timeout_s=150)
    assert run.exitcodes == [0, 0], run.errors
    leader, follower = run.results
    exact = Pixal3D.from_config(tiny, policy="staged", device="cpu", until="decode").run(EXAMPLE, seed=42)
    monkeypatch.setattr(flow_stage, "sample_flow_euler", _emulating(patches=2, warmup=0))
    for (image, seed), got in zip(runs, leader["fingerprints"], strict=True):
        fresh = Pixal3D.from_config(tiny, policy="staged", device="cpu", until="decode").run(image, seed=seed)
        assert got == fresh.fingerprints(), seed
    first = leader["fingerprints"][0]
    assert first["shape_512"]["lr_latent.feats"] != exact.fingerprints()["shape_512"]["lr_latent.feats"]
    assert first["texture"] != leader["fingerprints"][1]["texture"]
    # every rank loaded its half of each flow, per image (staged: released when the run left the stage)
    assert follower["images"] == 2
    assert follower["loads"] == [(name, 1, 2) for name in FLOWS] * 2
    assert [load for load in leader["loads"] if load[0] in FLOWS] == [(name, 0, 2) for name in FLOWS] * 2
    assert [r["pipeline_stage"] for r in leader["parallel"][1]["ranks"]] == [0, 1]
    # the split of every flow (2 blocks each: one per rank) is recorded, and each rank's own part of it
    assert leader["parallel"][1]["blocks"] == {name: [1, 1] for name in FLOWS}
    assert leader["parallel"][1]["pp_split"] is None
    assert [r["blocks"] for r in leader["parallel"][1]["ranks"]] == [dict.fromkeys(FLOWS, 1)] * 2


def test_an_image_that_fails_before_its_flow_stages_is_skipped_and_the_job_goes_on(tiny_cache, tmp_path):
    """The command on 2 ranks (CFG-parallel), two inputs whose first passes every check before the run but
    holds no object (fully transparent): rank 0 fails on it in preprocessing, before any flow stage, so the
    follower never joined it; that image is one line, the second is written, the summary and batch.json end
    the job with exit 1, and the follower ends cleanly having followed one image."""
    from PIL import Image

    bad = tmp_path / "in" / "a_empty.png"
    bad.parent.mkdir()
    Image.new("RGBA", (64, 64), (255, 255, 255, 0)).save(bad)
    (tmp_path / "in" / "b.png").write_bytes(EXAMPLE.read_bytes())
    out = tmp_path / "out"
    argv = [tmp_path / "in", "--config", TINY_CONFIG, "-o", out, "--quiet", "--parallel", "cfg",
            "--parallel-timeout", "120"]
    run = spawn(2, cli_worker, str(tiny_cache), argv, str(tmp_path), 1, folder=tmp_path, timeout_s=150)
    assert [(tmp_path / f"rank{r}.code").read_text() for r in (0, 1)] == ["1", "0"], run.exitcodes
    rank0 = (tmp_path / "rank0.stderr").read_text().strip().splitlines()
    assert len(rank0) == 2 and rank0[0].startswith("pixal3d-image-to-mesh: skipped a_empty.png: no object found"), \
        rank0
    assert rank0[1].startswith("1 written, 1 failed: a_empty.png: no object found"), rank0
    assert (tmp_path / "rank1.stderr").read_text().strip() == ""
    assert sorted(p.name for p in out.iterdir()) == ["b.glb", "b.run.json", "batch.json"]
    record = json.loads((out / "b.run.json").read_text())
    assert record["parallel"]["mode"] == "cfg" and len(record["parallel"]["ranks"]) == 2
    batch = json.loads((out / "batch.json").read_text())
    assert [(i["name"], i["status"]) for i in batch["images"]] == [("a_empty", "failed"), ("b", "written")]


def test_a_failure_on_rank_0_after_the_follower_joined_stops_every_rank_naming_it(tiny_cache, tmp_path):
    """Rank 0 runs out of memory in the decode stage, after the flow stages the follower joined: both ranks
    exit non-zero well within the 120 s timeout, rank 1 naming rank 0 and its error; nothing is written."""
    (tmp_path / "in").mkdir()
    for name in ("a.png", "b.png"):
        (tmp_path / "in" / name).write_bytes(EXAMPLE.read_bytes())
    out = tmp_path / "out"
    argv = [tmp_path / "in", "--config", TINY_CONFIG, "-o", out, "--quiet", "--parallel", "cfg",
            "--parallel-timeout", "120"]
    started = time.monotonic()
    run = spawn(2, cli_worker, str(tiny_cache), argv, str(tmp_path), 1, "decode", folder=tmp_path, timeout_s=150)
    assert all(code not in (0, None) for code in run.exitcodes), run.exitcodes
    assert time.monotonic() - started < 100
    assert [(tmp_path / f"rank{r}.code").read_text() for r in (0, 1)] == ["1", "1"]
    rank0 = (tmp_path / "rank0.stderr").read_text().strip().splitlines()
    rank1 = (tmp_path / "rank1.stderr").read_text().strip().splitlines()
    assert len(rank0) == 1 and "not enough memory" in rank0[0] and "skipped" not in rank0[0], rank0
    assert len(rank1) == 1 and rank1[0].startswith("pixal3d-image-to-mesh: error: rank 1 stopped: rank 0 failed: "
                                                   "MemoryError: injected in stage decode"), rank1
    assert not out.exists() or not list(out.iterdir())


@pytest.mark.parametrize("case", ["blocks", "config"])
def test_settings_that_do_not_fit_the_models_or_differ_between_ranks_stop_every_rank(tiny_cache, tmp_path, case):
    """After the rendezvous: --pp 3 on 3 ranks for 2-block flows is one error on rank 0 (every rank finds
    it before loading anything; the others stay silent), exit 2 everywhere. A rank whose config differs
    (rank 1 samples the structure in 3 steps) stops the job at the first image: it names the difference,
    rank 0 names rank 1, every rank exits non-zero."""
    base = ["assets/example.png", "--config", TINY_CONFIG, "-o", tmp_path / "out", "--quiet",
            "--parallel-timeout", "60"]
    if case == "blocks":
        world, argv = 3, [*base, "--parallel", "pipefusion", "--pp", "3"]
    else:
        other = tmp_path / "other.yaml"
        other.write_text(f"base: {TINY_CONFIG}\nstructure:\n  sampler: {{steps: 3}}\n")
        world = 2
        argv = {0: [*base, "--parallel", "cfg"],
                1: [*base[:2], other, *base[3:], "--parallel", "cfg"]}
    run = spawn(world, cli_worker, str(tiny_cache), argv, str(tmp_path), 1, folder=tmp_path, timeout_s=120)
    assert all(code not in (0, None) for code in run.exitcodes), run.exitcodes
    errors = [(tmp_path / f"rank{r}.stderr").read_text().strip().splitlines() for r in range(world)]
    assert len(errors[0]) == 1, errors
    if case == "blocks":
        assert "--pp 3 is more than the 2 blocks of sparse_structure_flow_model" in errors[0][0]
        assert errors[1:] == [[], []]
        assert [(tmp_path / f"rank{r}.code").read_text() for r in range(3)] == ["2", "2", "2"]
    else:
        assert "rank 0 stopped: rank 1 failed: ParallelConfigError: rank 1's config differs from rank 0's in " \
               "stage structure: steps = 3 here, 2 on rank 0" in errors[0][0], errors
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
