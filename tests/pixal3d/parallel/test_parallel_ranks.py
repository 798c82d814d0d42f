"""pixal3d.parallel across processes: ranks joined by env:// on loopback (as torchrun starts them), gloo,
small flows of the real classes (6 blocks, a dense 4³ grid and a 70-voxel sparse latent with
concat_cond), the structure stage's sampler settings (CFG 7.5, rescale 0.7) in 4 steps whose last step
runs without the negative branch (tests/support/parallel_harness.py SAMPLER); SAMPLER_LATE has the negative
branch join in the third step.

Every rank computes with one thread and so does the oracle here: the same kernels on the same shapes,
so "equal" means bitwise (``torch.equal``). Each comparison has a control that differs.
"""
import functools
import os
import time

import pytest
import torch

from pixal3d.models import load_model
from pixal3d.parallel import ParallelSettings, emulate_pipefusion
from pixal3d.samplers import sample_flow_euler
from tests.support.parallel_harness import SAMPLER, SAMPLERS, features, flow_inputs, sample_worker, spawn, write_flow

S = SAMPLER.steps
KINDS = ("dense", "sparse")


@pytest.fixture(scope="module")
def flows(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flows")
    return {kind: str(write_flow(folder, kind, blocks=6)) for kind in KINDS}


@pytest.fixture(scope="module")
def oracle(flows):
    """``oracle(kind, seed, M, W, sampler)``: the emulator's latent (W = None: the single-process sampler's)."""
    models, cache = {kind: load_model(stem) for kind, stem in flows.items()}, {}

    def run(kind, seed, patches, warmup, sampler="default"):
        key = (kind, seed, patches, warmup, sampler)
        if key not in cache:
            inputs, model, sampler_config = flow_inputs(kind, seed), models[kind], SAMPLERS[sampler]
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                if warmup is None:
                    flow = model if kind == "dense" else functools.partial(model, concat_cond=inputs["concat_cond"])
                    out = sample_flow_euler(flow, inputs["noise"], cond=inputs["cond"], neg_cond=inputs["neg_cond"],
                                            steps=S, guidance_strength=sampler_config.guidance_strength,
                                            guidance_rescale=sampler_config.guidance_rescale,
                                            guidance_interval=sampler_config.guidance_interval,
                                            rescale_t=sampler_config.rescale_t, progress=False)
                else:
                    out = emulate_pipefusion(model, inputs["noise"], cond=inputs["cond"], neg_cond=inputs["neg_cond"],
                                             concat_cond=inputs["concat_cond"], sampler=sampler_config,
                                             patches=patches, warmup=warmup)
            finally:
                torch.set_num_threads(threads)
            cache[key] = features(out)
        return cache[key]
    return run


def run_job(tmp_path_factory, world, settings, jobs):
    """Spawn ``world`` ranks running ``jobs`` [(kind, stem, seed, M, W[, sampler])]; {job: latent}."""
    jobs = [(*job, "default") if len(job) == 5 else job for job in jobs]
    folder = tmp_path_factory.mktemp(f"ranks{world}")
    run = spawn(world, sample_worker, settings, [(stem, kind, *rest) for kind, stem, *rest in jobs],
                folder=folder, timeout_s=90)
    assert run.exitcodes == [0] * world, run.errors
    for rank in range(1, world):  # every rank returns the same latent
        assert all(torch.equal(a, b) for a, b in zip(run.results[rank], run.results[0], strict=True))
    keys = [(kind, seed, m, w) if sampler == "default" else (kind, seed, m, w, sampler)
            for kind, _, seed, m, w, sampler in jobs]
    return dict(zip(keys, run.results[0], strict=True))


PP_JOBS = [(kind, seed, m, w) for kind in KINDS
           for seed, m, w in [(1, 1, S), (1, 2, 1), (1, 3, 1), (1, 4, 1), (2, 3, 0), (3, 3, 0)]]
LATE = [(kind, 1, 3, 1, "late") for kind in KINDS]


@pytest.fixture(scope="module")
def pp2(flows, tmp_path_factory):
    settings = ParallelSettings(mode="pipefusion", pp=2, timeout_s=60)
    return run_job(tmp_path_factory, 2, settings, [(k, flows[k], s, m, w) for k, s, m, w in PP_JOBS]
                   + [(k, flows[k], *rest) for k, *rest in LATE])


@pytest.fixture(scope="module")
def pp3(flows, tmp_path_factory):
    settings = ParallelSettings(mode="pipefusion", pp=3, timeout_s=60)
    return run_job(tmp_path_factory, 3, settings,
                   [(k, flows[k], 1, m, 1) for k in KINDS for m in (2, 3, 4)])


@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_all_warmup_one_patch_equal_the_single_process(pp2, oracle, kind):
    """Test 2: N = 2, W = S, M = 1 is bitwise the single-process sampler (the same kernels on the same
    shapes; only the hand-offs between ranks are new). Control: a streamed schedule is not."""
    assert torch.equal(pp2[(kind, 1, 1, S)], oracle(kind, 1, 1, None))
    assert not torch.equal(pp2[(kind, 1, 3, 1)], oracle(kind, 1, 1, None))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ranks", [2, 3])
def test_pipefusion_ranks_equal_the_emulator(pp2, pp3, oracle, kind, ranks):
    """Test 3: N = 2 and 3 ranks, M ∈ {2, 3, 4}, W = 1: bitwise the single-process emulator of the same
    schedule. Control: the emulator with another M differs."""
    got = pp2 if ranks == 2 else pp3
    for m in (2, 3, 4):
        assert torch.equal(got[(kind, 1, m, 1)], oracle(kind, 1, m, 1)), f"M = {m}"
        assert not torch.equal(got[(kind, 1, m, 1)], oracle(kind, 1, 2 if m != 2 else 3, 1))


def test_requests_in_a_row_equal_fresh_runs(pp2, oracle):
    """Test 5: with W = 0 (the first streamed step reads the K/V buffers before anything overwrites
    them) the 5th and 6th requests through the same two ranks, after other seeds, schedules and the
    other model, equal fresh single-process runs. (The control that stale buffers would show is
    test_kv_buffers_left_from_another_request_would_change_the_result.)"""
    for kind in KINDS:
        for seed in (2, 3):
            assert torch.equal(pp2[(kind, seed, 3, 0)], oracle(kind, seed, 3, 0)), (kind, seed)
    assert not torch.equal(pp2[("sparse", 2, 3, 0)], pp2[("sparse", 3, 3, 0)])


def test_cfg_parallel_equals_the_single_process(flows, oracle, tmp_path_factory):
    """Test 4a: the positive and negative passes on two ranks: bitwise the single-process sampler, also
    with the late guidance interval (the negative rank idles for two steps). Control: the two intervals'
    single-process results differ."""
    settings = ParallelSettings(mode="cfg", timeout_s=60)
    got = run_job(tmp_path_factory, 2, settings, [(k, flows[k], s, 1, 1) for k in KINDS for s in (1, 2)]
                  + [(k, flows[k], 1, 1, 1, "late") for k in KINDS])
    for kind in KINDS:
        for seed in (1, 2):
            assert torch.equal(got[(kind, seed, 1, 1)], oracle(kind, seed, 1, None))
        assert torch.equal(got[(kind, 1, 1, 1, "late")], oracle(kind, 1, 1, None, "late"))
        assert not torch.equal(got[(kind, 1, 1, 1)], oracle(kind, 1, 1, None, "late"))


def test_cfg_times_pipefusion_on_four_ranks_equals_the_emulator(flows, oracle, tmp_path_factory):
    """Test 4b: --parallel both --pp 2 (4 ranks): bitwise the emulator; with W = S, the single process."""
    settings = ParallelSettings(mode="both", pp=2, timeout_s=60)
    got = run_job(tmp_path_factory, 4, settings, [(k, flows[k], 1, m, w) for k in KINDS for m, w in ((3, 1), (1, S))]
                  + [(k, flows[k], *rest) for k, *rest in LATE])
    for kind in KINDS:
        assert torch.equal(got[(kind, 1, 3, 1)], oracle(kind, 1, 3, 1))
        assert torch.equal(got[(kind, 1, 1, S)], oracle(kind, 1, 1, None))
        assert torch.equal(got[(kind, 1, 3, 1, "late")], oracle(kind, 1, 3, 1, "late"))
        assert not torch.equal(got[(kind, 1, 3, 1)], oracle(kind, 1, 4, 1))
        assert not torch.equal(got[(kind, 1, 3, 1, "late")], oracle(kind, 1, 3, 1))


def test_a_negative_branch_that_joins_late_matches_the_emulator(pp2, oracle):
    """The guidance interval [0.6, 0.9]: positive only for two steps, then both (the negative branch's
    first streamed step reads only the K/V it has written so far). Control: the default interval."""
    for kind in KINDS:
        assert torch.equal(pp2[(kind, 1, 3, 1, "late")], oracle(kind, 1, 3, 1, "late"))
        assert not torch.equal(pp2[(kind, 1, 3, 1, "late")], oracle(kind, 1, 3, 1))


# -- failures ---------------------------------------------------------------------------------------
def failing_worker(rank, stem, settings, culprit, how, folder):
    """Run one request; on rank ``culprit`` the shard's second block fails in the 3rd forward it runs:
    ``raise`` raises an error, ``exit`` ends the process at once (as a crash or kill would)."""
    from pixal3d.parallel import init_parallel, load_flow_shard, parallel_sample

    runtime = init_parallel(settings)
    model = load_flow_shard(stem, runtime.topology.stage, runtime.topology.pp_degree)
    if rank == culprit:
        block = model.blocks[list(model.shard_info.blocks)[1]]
        calls = [0]
        forward = block.forward

        def failing(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 3:
                if how == "exit":
                    os._exit(3)
                raise RuntimeError("injected failure")
            return forward(*args, **kwargs)
        block.forward = failing
    inputs = flow_inputs("sparse", 1) if rank == 0 else dict.fromkeys(("noise", "cond", "neg_cond", "concat_cond"))
    started = time.monotonic()
    try:
        parallel_sample(model, inputs["noise"], cond=inputs["cond"], neg_cond=inputs["neg_cond"],
                        concat_cond=inputs["concat_cond"], sampler=SAMPLER, runtime=runtime)
    finally:
        with open(f"{folder}/rank{rank}.seconds", "w") as f:
            f.write(str(time.monotonic() - started))


@pytest.mark.parametrize("culprit, how", [(0, "raise"), (1, "exit")])
def test_a_failing_rank_stops_every_rank_quickly_naming_it(flows, tmp_path_factory, culprit, how):
    """Test 7: a rank raises (rank 0, which also hosts the job's store) or dies (rank 1): all three ranks
    exit non-zero well before the 120 s timeout, and every survivor's error names the failed rank."""
    folder = tmp_path_factory.mktemp(f"fail{culprit}")
    settings = ParallelSettings(mode="pipefusion", pp=3, patches=2, warmup=1, timeout_s=120)
    run = spawn(3, failing_worker, flows["sparse"], settings, culprit, how, str(folder), folder=folder, timeout_s=60)
    assert all(code not in (0, None) for code in run.exitcodes), run.exitcodes
    assert run.seconds < 60
    survivors = [r for r in range(3) if r != culprit]
    for rank in survivors:
        assert float((folder / f"rank{rank}.seconds").read_text()) < 20  # not the 120 s timeout
    if how == "raise":
        assert run.errors[culprit].startswith("RuntimeError: injected failure")
        assert "raised on rank 0 of the parallel job" in run.errors[culprit]
        for rank in survivors:
            assert run.errors[rank].startswith(f"PeerFailedError: rank {rank} stopped: rank 0 failed: "
                                               f"RuntimeError: injected failure"), run.errors[rank]
    else:
        assert run.exitcodes[culprit] == 3
        for rank in survivors:
            assert "rank 1" in run.errors[rank].splitlines()[0], run.errors[rank]
