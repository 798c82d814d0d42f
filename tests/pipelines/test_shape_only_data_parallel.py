"""``--parallel data`` with ``--shape-only``: two ranks (env:// on loopback, one thread each) share three images,
each run whole on one rank up to the untextured export, with the bits of a single shape-only process at one thread.
Control: the images' single runs differ from each other."""
from __future__ import annotations

import json

import pytest

from pipelines import Pixal3D
from pipelines.build import SHAPE_ONLY
from tests.support.batch_fixtures import write_images
from tests.support.cascade_fixtures import TINY_CONFIG, tiny_cache, torch_threads  # noqa: F401
from tests.support.parallel_cascade_harness import data_worker
from tests.support.parallel_harness import spawn

STAGES = ["preprocess", "camera", "features", "structure", "shape_512", "upsample", "shape_1024", "shape_decode",
          "shape_export"]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("in"))


def test_two_ranks_share_three_shape_only_images_with_the_single_process_bits(tiny_cache, images,  # noqa: F811
                                                                              tmp_path):
    with torch_threads(1), Pixal3D.from_config(TINY_CONFIG, device="cpu", until=SHAPE_ONLY) as pipe:
        single = {p.stem: pipe.run(p, seed=9).fingerprints() for p in images}
    assert single["a"]["shape_1024"] != single["b"]["shape_1024"] != single["c"]["shape_1024"]
    out = tmp_path / "out"
    argv = [*images, "--shape-only", "--config", TINY_CONFIG, "-o", out, "--quiet", "--seed", "9", "--parallel",
            "data", "--parallel-timeout", "60", "--work-dir", tmp_path / "work"]
    run = spawn(2, data_worker, str(tiny_cache), [str(a) for a in argv], str(tmp_path), 1, folder=tmp_path,
                timeout_s=300)
    assert run.exitcodes == [0, 0], run.errors
    batch = json.loads((out / "batch.json").read_text())
    assert batch["summary"] == "3 written, 0 failed"
    assert {str(row["rank"]) for row in batch["images"]} == {"0", "1"}
    for path in images:
        record = json.loads((out / f"{path.stem}.run.json").read_text())
        assert record["shape_only"] is True
        assert {s["stage"]: s["fingerprints"] for s in record["stages"] if s["fingerprints"]} == single[path.stem]
    lines = [line.split() for line in (tmp_path / "stages.log").read_text().splitlines()]
    for path in images:
        assert len({rank for rank, image, _ in lines if image == path.stem}) == 1
        assert [stage for _, image, stage in lines if image == path.stem] == STAGES
