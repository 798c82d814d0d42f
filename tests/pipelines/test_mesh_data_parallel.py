"""``--parallel data`` with ``--mesh``: two ranks (env:// on loopback, one thread each) share three images textured
onto one mesh, each image run whole on one rank, with the bits of a single process at one thread. Control: the
images' single runs differ from each other."""
from __future__ import annotations

import json

import pytest

from pipelines import Pixal3D
from tests.support.batch_fixtures import write_images
from tests.support.cascade_fixtures import (  # noqa: F401
    EXAMPLE,
    TINY_CONFIG,
    tiny_cache,
    torch_threads,
)
from tests.support.parallel_cascade_harness import data_worker
from tests.support.parallel_harness import spawn

MESH = EXAMPLE.parent / "example_mesh.ply"
STAGES = ["preprocess", "camera", "features", "mesh_encode", "texture", "mesh_decode", "mesh_export"]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("in"))


def _prints(out, name):
    record = json.loads((out / f"{name}.run.json").read_text())
    return {s["stage"]: s["fingerprints"] for s in record["stages"] if s["fingerprints"]}


def test_two_ranks_share_three_images_on_one_mesh_with_the_single_process_bits(tiny_cache, images,  # noqa: F811
                                                                              tmp_path):
    with torch_threads(1), Pixal3D.from_config(TINY_CONFIG, device="cpu", input_kind="mesh") as pipe:
        single = {p.stem: pipe.run(p, mesh=MESH, seed=9).fingerprints() for p in images}
    assert single["a"]["texture"] != single["b"]["texture"] != single["c"]["texture"]
    out = tmp_path / "out"
    argv = [*images, "--mesh", MESH, "--config", TINY_CONFIG, "-o", out, "--quiet", "--seed", "9", "--parallel",
            "data", "--parallel-timeout", "60", "--work-dir", tmp_path / "work"]
    run = spawn(2, data_worker, str(tiny_cache), [str(a) for a in argv], str(tmp_path), 1, folder=tmp_path,
                timeout_s=300)
    assert run.exitcodes == [0, 0], run.errors
    batch = json.loads((out / "batch.json").read_text())
    assert batch["summary"] == "3 written, 0 failed"
    assert {str(row["rank"]) for row in batch["images"]} == {"0", "1"}  # both ranks ran an image
    for path in images:
        assert _prints(out, path.stem) == single[path.stem], path.stem
        assert json.loads((out / f"{path.stem}.run.json").read_text())["mesh"]["file"] == MESH.name
    lines = [line.split() for line in (tmp_path / "stages.log").read_text().splitlines()]
    for path in images:  # each image's stages all on one rank, in the mesh cascade's order
        assert len({rank for rank, image, _ in lines if image == path.stem}) == 1
        assert [stage for _, image, stage in lines if image == path.stem] == STAGES
