"""``--data-groups K`` with ``--parallel cfg`` (issue 28): K groups of ranks, each a CFG-parallel job of its own,
share a batch's images. 4 ranks (2 groups x 2) on loopback with gloo, the tiny config, one thread per rank.

CFG-parallel is exact, so a group's fingerprints equal a single process's at the same thread count (one); the
images differ from each other (mirrored), so a mix-up shows.
"""
from __future__ import annotations

import collections
import json

import pytest
from PIL import Image, ImageOps

from pixal3d.parallel import ParallelConfigError, ParallelSettings
from pixal3d.parallel.topology import Topology
from tests.support.cascade_fixtures import (  # noqa: F401
    EXAMPLE,
    TINY_CONFIG,
    one_thread_fingerprints,
    tiny,
    tiny_cache,
    torch_threads,
)
from tests.support.parallel_cascade_harness import FLOWS, data_worker
from tests.support.parallel_harness import spawn

STAGES = ["preprocess", "camera", "features", "structure", "shape_512", "upsample", "shape_1024", "texture", "decode", "export"]


def _settings(argv, world):
    from pipelines import cli, launch
    from pipelines.job import Job

    return launch.parallel_settings(Job.from_args(cli.parse_args(["x.png", *argv])),
                                    env={"RANK": "0", "WORLD_SIZE": str(world)})


def test_a_rank_of_a_job_of_groups_is_a_rank_of_its_group():
    """torchrun's rank R of K groups of G x N ranks: group R // (G N), rank R % (G N) inside it, which is all
    the CFG / PipeFusion code sees; messages name both."""
    settings = ParallelSettings(mode="both", pp=2, data_groups=2)
    assert (settings.group_size, settings.world_size) == (4, 8)
    topo = Topology.from_env(settings, {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "6"})
    assert (topo.data_group, topo.rank, topo.world_size, topo.cfg_index, topo.stage) == (1, 2, 4, 1, 0)
    assert (topo.global_rank, topo.global_of(0), topo.owner) == (6, 4, 1)
    assert topo.name == "rank 2 of data group 1 (torchrun rank 6)"
    one = Topology.from_env(ParallelSettings(mode="both", pp=2), {"RANK": "2", "WORLD_SIZE": "4"})
    assert (one.data_group, one.rank, one.name) == (0, 2, "rank 2")
    data = Topology.from_env(ParallelSettings(mode="data", data_groups=3), {"RANK": "2", "WORLD_SIZE": "3"})
    assert (data.data_group, data.rank, data.world_size) == (2, 0, 1)
    with pytest.raises(ParallelConfigError, match="needs 8 processes .2 data groups × cfg 2 × pp 2. but WORLD_SIZE"):
        Topology.from_env(settings, {"RANK": "0", "WORLD_SIZE": "4"})
    with pytest.raises(ParallelConfigError, match="data_groups K = 2 needs a parallel mode"):
        ParallelSettings(mode="none", data_groups=2)


def test_the_flags_give_groups_of_cfg_and_pipefusion_jobs():
    from pipelines.errors import UsageError

    piped = _settings(["--parallel", "pipefusion", "--data-groups", "2"], world=4)
    assert (piped.mode, piped.data_groups, piped.pp, piped.patches, piped.world_size) == ("pipefusion", 2, 2, 2, 4)
    both = _settings(["--parallel", "both", "--data-groups", "2", "--work-dir", "w"], world=8)
    assert (both.cfg_degree, both.pp_degree, both.data_groups) == (2, 2, 2)
    with pytest.raises(UsageError, match="--work-dir needs data groups under --parallel cfg"):
        _settings(["--parallel", "cfg", "--work-dir", "w"], world=2)
    # issue 36, 6.6: --data-groups 1 was given; the advice to "add --data-groups K" named no rule the user missed
    with pytest.raises(UsageError, match="--work-dir needs 2 or more data groups under --parallel cfg "
                                         r"\(--data-groups 1 is one group") as one:
        _settings(["--parallel", "cfg", "--data-groups", "1", "--work-dir", "w"], world=2)
    assert "add --data-groups" not in str(one.value) and "give --data-groups 2 or more" in str(one.value)
    with pytest.raises(UsageError, match="--data-groups needs --parallel cfg, pipefusion or both"):
        _settings(["--data-groups", "2"], world=1)
    with pytest.raises(UsageError, match="--batch-order stage needs one process per image"):
        _settings(["--parallel", "cfg", "--data-groups", "2", "--batch-order", "stage"], world=4)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("groups-in")
    source = Image.open(EXAMPLE)
    source.save(folder / "a.png")
    ImageOps.mirror(source).save(folder / "b.png")
    return folder


@pytest.fixture(scope="module")
def single(tiny, images):
    """Each image's per-stage fingerprints from one process, one thread."""
    return one_thread_fingerprints(tiny, {name: images / f"{name}.png" for name in "ab"})


def _argv(inputs, out, work=None, parallel=("--parallel", "cfg", "--data-groups", "2")):
    return [inputs, "--config", TINY_CONFIG, "-o", out, "--quiet", *parallel, "--parallel-timeout", "60",
            *(["--work-dir", work] if work else [])]


def _record(out, name):
    return json.loads((out / f"{name}.run.json").read_text())


def _fingerprints(out, name):
    return {s["stage"]: s["fingerprints"] for s in _record(out, name)["stages"] if s["fingerprints"]}


def _stage_log(folder):
    path = folder / "stages.log"
    return [tuple(line.split()) for line in path.read_text().splitlines()] if path.exists() else []


def test_two_cfg_groups_share_a_folder_with_the_single_process_bits(tiny_cache, images, single, tmp_path):
    """2 groups x cfg 2, no work dir: image i to group i mod 2. Both GLBs carry the single-process
    fingerprints; each run.json names its group (a: 0 and torchrun ranks 0, 1; b: 1 and ranks 2, 3) and
    batch.json both; every rank loaded each of its models once, the followers (ranks 1, 3) only the flow
    models; one summary, exit 0 everywhere. Control: the single runs of a and b differ."""
    out = tmp_path / "out"
    run = spawn(4, data_worker, str(tiny_cache), _argv(images, out), str(tmp_path), 1, folder=tmp_path,
                timeout_s=150)
    assert run.exitcodes == [0, 0, 0, 0], run.errors
    assert single["a"]["structure"] != single["b"]["structure"]
    for name in "ab":
        assert _fingerprints(out, name) == single[name], name
    for name, group in (("a", 0), ("b", 1)):
        parallel = _record(out, name)["parallel"]
        assert (parallel["mode"], parallel["data_group"], parallel["data_groups"]) == ("cfg", group, 2)
        assert [r["torchrun_rank"] for r in parallel["ranks"]] == [2 * group, 2 * group + 1]
    batch = json.loads((out / "batch.json").read_text())
    assert batch["summary"] == "2 written, 0 failed"
    assert [(row["name"], row["rank"]) for row in batch["images"]] == [("a", 0), ("b", 1)]
    for rank in range(4):
        loads = (tmp_path / f"loads.rank{rank}").read_text().split()
        assert len(loads) == len(set(loads)) > 0, (rank, loads)
        if rank % 2:
            assert set(loads) == set(FLOWS), (rank, loads)
        assert (tmp_path / f"rank{rank}.stderr").read_text() == "", rank


def test_a_group_resumes_from_the_work_dir_and_its_followers_skip_the_flow_stages_already_recorded(
        tiny_cache, images, single, tmp_path):
    """A work dir from one process holds every stage of b and a's stages up to shape_1024. 2 groups x cfg 2 on
    it: a's group runs only texture, decode and export (its followers join texture alone, not the three flow
    stages before it), b is taken whole from its records; both GLBs carry the single-process fingerprints and
    say which stages were reused; each image was claimed by one group."""
    from pipelines import cli

    out, work = tmp_path / "out", tmp_path / "work"
    with torch_threads(1):  # the records' bits are the 1-thread ones, like the ranks'
        assert cli.main([str(images), "--config", str(TINY_CONFIG), "-o", str(tmp_path / "first"), "--quiet",
                         "--work-dir", str(work)]) == 0
    for stage in ("texture", "decode", "export"):
        for suffix in (".json", ".safetensors"):
            (work / "a" / f"{stage}{suffix}").unlink()
    run = spawn(4, data_worker, str(tiny_cache), _argv(images, out, work), str(tmp_path), 1, folder=tmp_path,
                timeout_s=150)
    assert run.exitcodes == [0, 0, 0, 0], run.errors
    for name in "ab":
        assert _fingerprints(out, name) == single[name], name
    computed = collections.Counter((image, stage) for _, image, stage in _stage_log(tmp_path))
    assert computed == collections.Counter({("a", "texture"): 1, ("a", "decode"): 1, ("a", "export"): 1})
    reused = {name: [s["stage"] for s in _record(out, name)["stages"] if s.get("reused")] for name in "ab"}
    assert reused == {"a": STAGES[:STAGES.index("texture")], "b": STAGES}
    batch = json.loads((out / "batch.json").read_text())
    assert batch["summary"] == "2 written, 0 failed"
    assert sorted(row["rank"] for row in batch["images"]) in ([0, 0], [0, 1], [1, 1])
    for rank in (1, 3):
        assert (tmp_path / f"rank{rank}.stderr").read_text() == "", rank
