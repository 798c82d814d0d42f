"""The uneven PipeFusion split (issue 28): block counts per pipeline rank, given (``pp_split=(1, 3)``) or in
proportion to each rank's usable memory (``auto``), gathered through the job's store.

The gloo tests run 2 ranks with one thread each on loopback (``tests/support/parallel_harness.py``), and the oracle
with one thread: bitwise comparisons (``torch.equal``), each with a control that differs.
"""
import pytest
import torch

from pipelines.parallel import RankPlan, plan_splits
from pixal3d.models import load_model
from pixal3d.parallel import ParallelConfigError, ParallelSettings, emulate_pipefusion
from pixal3d.parallel.shard import block_ranges, shard_tensor_names
from pixal3d.parallel.split import model_split, proportional
from pixal3d.parallel.topology import Topology
from tests.support.cascade_fixtures import tiny_cache  # noqa: F401
from tests.support.parallel_harness import SAMPLER, features, flow_inputs, spawn, split_worker, write_flow

GIB = 2**30
KINDS = ("dense", "sparse")


# -- the arithmetic ----------------------------------------------------------------------------------
def test_proportional_split_follows_the_weights_and_gives_every_rank_a_block():
    assert proportional(4, [12, 24]) == (1, 3)
    assert proportional(4, [12, 16]) == (2, 2)      # 1.71 : 2.29 rounds to 2 : 2
    assert proportional(30, [12, 24]) == (10, 20)
    assert proportional(30, [12, 16]) == (13, 17)   # 12.86 : 17.14
    assert proportional(3, [1, 1000]) == (1, 2)     # never fewer than one block
    assert proportional(5, [1, 1, 1]) == (2, 2, 1)  # ties: the lower rank first, as near_equal_ranges
    assert proportional(4, [0, 0]) == (2, 2)
    for total, weights in [(30, [10, 20, 7]), (7, [3, 1]), (24, [12, 16, 24, 8])]:
        counts = proportional(total, weights)
        assert sum(counts) == total and min(counts) >= 1


def test_model_split_given_auto_and_even():
    assert model_split(None, 5, 2) == (3, 2)
    assert model_split((1, 3), 4, 2) == (1, 3)
    assert model_split((1, 3), 8, 2) == (2, 6)      # another model: the same proportions
    assert model_split("auto", 4, 2, [12 * GIB, 24 * GIB]) == (1, 3)
    with pytest.raises(ParallelConfigError, match="needs every pipeline rank's memory"):
        model_split("auto", 4, 2, None)
    assert [list(r) for r in block_ranges(4, 2, (1, 3))] == [[0], [1, 2, 3]]
    with pytest.raises(ParallelConfigError, match="does not cover"):
        block_ranges(4, 2, (2, 3))
    names = [f"blocks.{i}.w" for i in range(4)] + ["input_layer.w", "out_layer.w", "t_embedder.w"]
    assert shard_tensor_names(names, 0, 2, (1, 3)) == {"blocks.0.w", "input_layer.w", "t_embedder.w"}
    assert shard_tensor_names(names, 1, 2, (1, 3)) == {"blocks.1.w", "blocks.2.w", "blocks.3.w", "out_layer.w",
                                                       "t_embedder.w"}


@pytest.mark.parametrize("kwargs, words", [
    (dict(mode="pipefusion", pp=2, pp_split=(1, 2, 1)), "names 3 pipeline ranks but pp is 2"),
    (dict(mode="pipefusion", pp=2, pp_split=(0, 4)), "block counts >= 1"),
    (dict(mode="pipefusion", pp=2, pp_split="even"), "'auto' or block counts"),
    (dict(mode="cfg", pp_split="auto"), "needs mode=pipefusion or both"),
])
def test_bad_splits_are_refused(kwargs, words):
    with pytest.raises(ParallelConfigError, match=words):
        ParallelSettings(**kwargs)


def test_the_plan_lists_every_ranks_blocks_bytes_and_kv_buffers():
    """``plan_splits`` on a 4-block flow with injected usable memory 12 and 24 GiB: 1 + 3 blocks, each rank's
    shard bytes as the header reader counts them, K/V in proportion to the blocks, and the split recorded."""
    settings = ParallelSettings(mode="pipefusion", pp=2, pp_split="auto")
    topo = Topology(rank=0, world_size=2, local_rank=0, cfg_degree=1, pp_degree=2)
    rank = RankPlan(settings, topo, torch.device("cpu"), capacities=(12 * GIB, 24 * GIB))

    class Flow:
        name, flow_model = "structure", "ss_flow"

        def estimated_tokens(self):
            return 4096

    names = [f"blocks.{i}.w" for i in range(4)] + ["input_layer.w", "out_layer.w"]

    def sized(select):  # 100 MiB per tensor
        return {m: 100 * 2**20 * len(set(pick(names))) for m, pick in select.items()}

    planned, lines = plan_splits(rank, [Flow()], sized)
    assert planned.splits == {"ss_flow": (1, 3)}
    assert "auto, in proportion to each rank's memory for flow blocks" in lines[0]
    assert "12.00 GiB + 24.00 GiB" in lines[0]
    assert "ss_flow (1 + 3 of 4 blocks)" in lines[1]
    assert "rank 0: 1 blocks, 200.0 MiB" in lines[1] and "rank 1: 3 blocks, 400.0 MiB" in lines[1]
    kv = [part.split("K/V ~")[1] for part in lines[1].split("; ")]
    assert kv == ["48.0 MiB", "144.0 MiB"]  # 2 x 2 x 4096 x 1536 x 2 bytes = 48 MiB per block
    even, _ = plan_splits(RankPlan(ParallelSettings(mode="pipefusion", pp=2), topo, torch.device("cpu")),
                          [Flow()], sized)
    assert even.splits == {"ss_flow": (2, 2)}  # control: no split given, near-equal


# -- on 2 gloo ranks ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def flows4(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flows4")
    return {kind: str(write_flow(folder, kind, blocks=4)) for kind in KINDS}


def _emulated(stem, kind, seed, patches, warmup):
    inputs, model = flow_inputs(kind, seed), load_model(stem)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return features(emulate_pipefusion(model, inputs["noise"], cond=inputs["cond"], neg_cond=inputs["neg_cond"],
                                           concat_cond=inputs["concat_cond"], sampler=SAMPLER, patches=patches,
                                           warmup=warmup))
    finally:
        torch.set_num_threads(threads)


def test_an_explicit_one_plus_three_split_equals_the_emulator(flows4, tmp_path):
    """2 ranks holding 1 and 3 blocks of 4-block dense and sparse flows (M = 2, W = 1): bitwise the
    single-process emulator of that schedule, which is the same for every split. Control: M = 3 differs."""
    settings = ParallelSettings(mode="pipefusion", pp=2, patches=2, warmup=1, pp_split=(1, 3), timeout_s=60)
    jobs = [(flows4[kind], kind, 1, 2, 1) for kind in KINDS]
    run = spawn(2, split_worker, settings, jobs, folder=tmp_path, timeout_s=60)
    assert run.exitcodes == [0, 0], run.errors
    assert [list(r) for r in run.results[0]["ranges"]] == [[0]] * 2
    assert [list(r) for r in run.results[1]["ranges"]] == [[1, 2, 3]] * 2
    for i, kind in enumerate(KINDS):
        expected = _emulated(flows4[kind], kind, 1, 2, 1)
        assert torch.equal(run.results[0]["latents"][i], expected), kind
        assert torch.equal(run.results[1]["latents"][i], expected), kind
        assert not torch.equal(expected, _emulated(flows4[kind], kind, 1, 3, 1))


def test_auto_split_from_injected_memories_is_proportional_on_every_rank(flows4, tmp_path):
    """``auto`` with rank 0 reporting 12 GiB and rank 1 24 GiB: both ranks read the same list from rank 0, pick
    1 + 3 blocks of the 4-block flow, and sample the emulator's bits. Control: 24 and 12 GiB give 3 + 1."""
    settings = ParallelSettings(mode="pipefusion", pp=2, patches=2, warmup=1, pp_split="auto", timeout_s=60)
    jobs = [(flows4["dense"], "dense", 2, 2, 1)]
    run = spawn(2, split_worker, settings, jobs, [12 * GIB, 24 * GIB], folder=tmp_path / "a", timeout_s=60)
    assert run.exitcodes == [0, 0], run.errors
    for result in run.results:
        assert result["capacities"] == (12 * GIB, 24 * GIB)
        assert result["splits"] == [(1, 3)]
    assert torch.equal(run.results[0]["latents"][0], _emulated(flows4["dense"], "dense", 2, 2, 1))
    swapped = spawn(2, split_worker, settings, jobs, [24 * GIB, 12 * GIB], folder=tmp_path / "b", timeout_s=60)
    assert swapped.exitcodes == [0, 0], swapped.errors
    assert swapped.results[0]["splits"] == [(3, 1)] and [list(r) for r in swapped.results[1]["ranges"]] == [[3]]


# -- the command's flags -------------------------------------------------------------------------------
def _settings(argv, world=2):
    from pipelines import cli, launch
    from pipelines.job import Job

    return launch.parallel_settings(Job.from_args(cli.parse_args(["x.png", *argv])),
                                    env={"RANK": "0", "WORLD_SIZE": str(world)})


def test_the_flags_give_the_split_and_the_data_groups():
    from pipelines.errors import UsageError

    assert _settings(["--parallel", "pipefusion", "--pp-split", "1,3"]).pp_split == (1, 3)
    assert _settings(["--parallel", "pipefusion", "--pp-split", "auto"]).pp_split == "auto"
    assert _settings(["--parallel", "pipefusion"]).pp_split is None
    data = _settings(["--parallel", "data"], world=4)
    assert (data.mode, data.data_groups, data.world_size, data.pp_degree) == ("data", 4, 4, 1)
    with pytest.raises(UsageError, match="--pp-split 'x' is neither auto nor block counts"):
        _settings(["--parallel", "pipefusion", "--pp-split", "x"])
    with pytest.raises(UsageError, match="--pp needs --parallel pipefusion or both"):
        _settings(["--parallel", "data", "--pp", "2"])
    with pytest.raises(ParallelConfigError, match="names 3 pipeline ranks but pp is 2"):
        _settings(["--parallel", "pipefusion", "--pp-split", "1,1,2"])


def test_the_cascade_plan_gathers_each_ranks_injected_memory_and_says_so(tiny_cache, tmp_path):
    """``Pixal3D.plan(tiny, pp_split='auto')`` on 2 gloo ranks whose devices report 12 and 24 GiB: the plan joins
    the job, both ranks read the same capacities (usable memory, 85 %; rank 0 less its DINOv3 and NAF, which its
    flow stages also hold), and the plan's notes state them with each flow's split (1 + 1: the tiny flows have
    2 blocks)."""
    from pixal3d.staging.policy import usable
    from tests.support.parallel_cascade_harness import FLOWS, plan_worker

    settings = ParallelSettings(mode="pipefusion", pp=2, pp_split="auto", timeout_s=60)
    run = spawn(2, plan_worker, str(tiny_cache), [12 * GIB, 24 * GIB], settings, folder=tmp_path, timeout_s=120)
    assert run.exitcodes == [0, 0], run.errors
    first, second = run.results
    assert first["capacities"] == second["capacities"]
    zero, one = first["capacities"]
    assert one == usable(24 * GIB) and usable(12 * GIB) - 64 * 2**20 < zero < usable(12 * GIB)
    line = next(n for n in first["notes"] if n.startswith("pipeline split (auto"))
    assert "+ 20.40 GiB" in line
    assert first["splits"] == {name: (1, 1) for name in FLOWS}
    assert any(n.startswith("sparse_structure_flow_model (1 + 1 of 2 blocks): rank 0: 1 blocks") for n in first["notes"])
