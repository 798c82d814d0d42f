"""``--parallel data`` on views folders: two ranks (env:// on loopback, one thread each) share three views folders
of one batch, each folder run whole on one rank, with the bits of a single process at one thread; a rank killed
mid-batch leaves its records, and the same command finishes what is left. Control: the folders' single runs
differ from each other."""
from __future__ import annotations

import collections
import json
import shutil

import pytest

from pipelines import Pixal3D
from pixal3d.config import load_config
from tests.support.cascade_fixtures import tiny_cache, torch_threads  # noqa: F401
from tests.support.parallel_cascade_harness import data_worker
from tests.support.parallel_harness import spawn
from tests.support.views_fixtures import EXAMPLE_VIEWS, fast_mv_config, swapped_views  # noqa: F401


def _folders(root):
    example = root / "example"
    shutil.copytree(EXAMPLE_VIEWS, example)
    three = root / "three"  # the example's first three views only
    shutil.copytree(EXAMPLE_VIEWS, three)
    meta = json.loads((three / "transforms.json").read_text())
    meta["frames"] = meta["frames"][:3]
    (three / "transforms.json").write_text(json.dumps(meta))
    return {"example": example, "swapped": swapped_views(root / "swapped"), "three": three}


def _prints(out, name):
    record = json.loads((out / f"{name}.run.json").read_text())
    return {s["stage"]: s["fingerprints"] for s in record["stages"] if s["fingerprints"]}


STAGES = ["views", "features", "structure", "shape_512", "upsample", "shape_1024", "texture", "decode", "export"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return _folders(tmp_path_factory.mktemp("in"))


@pytest.fixture(scope="module")
def single(fast_mv_config, folders):
    """Each folder's fingerprints from one process at one thread (the command's policy, auto)."""
    with torch_threads(1), Pixal3D.from_config(load_config(fast_mv_config), device="cpu") as pipe:
        return {name: pipe.run(views=path, seed=9).fingerprints() for name, path in folders.items()}


def _argv(fast_mv_config, folders, out, work, timeout=60):
    return ["--views", *folders.values(), "--config", fast_mv_config, "-o", out, "--quiet", "--seed", "9",
            "--parallel", "data", "--parallel-timeout", str(timeout), "--work-dir", work]


def _log(folder):
    path = folder / "stages.log"
    return [tuple(line.split()) for line in path.read_text().splitlines()] if path.exists() else []


def test_two_ranks_share_three_views_folders_with_the_single_process_bits(fast_mv_config, tiny_cache, folders, single,
                                                                         tmp_path):
    assert single["example"]["structure"] != single["swapped"]["structure"] != single["three"]["structure"]
    out = tmp_path / "out"
    run = spawn(2, data_worker, str(tiny_cache), _argv(fast_mv_config, folders, out, tmp_path / "work"),
                str(tmp_path), 1, folder=tmp_path, timeout_s=300)
    assert run.exitcodes == [0, 0], run.errors
    batch = json.loads((out / "batch.json").read_text())
    assert batch["summary"] == "3 written, 0 failed"
    assert {str(row["rank"]) for row in batch["images"]} == {"0", "1"}  # both ranks ran a folder
    for name in folders:
        assert _prints(out, name) == single[name], name
    for name in folders:  # each folder's stages all on one rank, each once, in the cascade's order
        assert len({rank for rank, image, _ in _log(tmp_path) if image == name}) == 1, name
        assert [stage for _, image, stage in _log(tmp_path) if image == name] == STAGES, name


def test_a_rank_killed_mid_batch_and_the_same_command_again_finish_every_folder_once(fast_mv_config, tiny_cache,
                                                                                    folders, single, tmp_path):
    """Rank 1 dies (SIGKILL) after recording its third stage: rank 0 names it and exits 1; the same command
    again writes every folder with the single-process bits, every stage computed once over both runs."""
    out = tmp_path / "out"
    argv = _argv(fast_mv_config, folders, out, tmp_path / "work", timeout=8)
    first = spawn(2, data_worker, str(tiny_cache), argv, str(tmp_path / "run1"), 1, (1, 3),
                  folder=tmp_path / "run1", timeout_s=300)
    assert first.exitcodes[1] == -9 and first.exitcodes[0] == 1, first.errors
    assert len([row for row in _log(tmp_path / "run1") if row[0] == "1"]) == 3
    second = spawn(2, data_worker, str(tiny_cache), argv, str(tmp_path / "run2"), 1, folder=tmp_path / "run2",
                   timeout_s=300)
    assert second.exitcodes == [0, 0], second.errors
    for name in folders:
        assert _prints(out, name) == single[name], name
    counts = collections.Counter((image, stage) for _, image, stage in _log(tmp_path / "run1") + _log(
        tmp_path / "run2"))
    assert counts == collections.Counter({(name, stage): 1 for name in folders for stage in STAGES})
