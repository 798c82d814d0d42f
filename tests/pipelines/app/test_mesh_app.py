"""Issue 45 item 2 (the web app): on a single-view config the page has an optional mesh upload beside the image and
the mesh pose dropdown (from the kinds' upload table and the job settings); given a mesh, the job textures it as the
library does (the same fingerprints and GLB); without one it is an image job as before. A bad mesh is one line in
the status. A multi-view page has neither field."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import trimesh

from pipelines import Pixal3D
from pipelines.job import SETTINGS
from pixal3d.config import load_config
from tests.support.cascade_fixtures import EXAMPLE, TINY_CONFIG, tiny_cache  # noqa: F401

gr = pytest.importorskip("gradio")

FORM = {"seed": 7, "memory_policy": "staged", "mesh_pose": "aligned"}


def _page(config, outputs):
    from pipelines.app.ui import build_ui
    from pipelines.session import Session

    session = Session("app", device="cpu")
    return session, build_ui(session, config, outputs=outputs)


def _ids(page) -> set[str]:
    return {b.elem_id for b in page.blocks.values() if getattr(b, "elem_id", None)}


def _on_run(page):
    [fn] = [f.fn for f in page.fns.values() if getattr(f.fn, "__name__", "") == "on_run"]
    return fn


def _run(on_run, image, mesh, **form) -> list:
    values = {**FORM, **form}
    return list(on_run(image, mesh, True, lambda *a, **k: None, *(values.get(s.name) for s in SETTINGS)))


def test_the_image_page_offers_a_mesh_and_its_pose_and_the_views_page_neither(tiny_cache, tmp_path):  # noqa: F811
    session, page = _page(load_config(TINY_CONFIG), tmp_path)
    session.close()
    assert {"image", "mesh", "mesh-pose", "fov", "fov-auto"} <= _ids(page)
    [mesh] = [b for b in page.blocks.values() if getattr(b, "elem_id", None) == "mesh"]
    assert mesh.label == "mesh to texture (GLB, OBJ or PLY)" and isinstance(mesh, gr.File)
    session, page = _page(load_config("tiny_mv"), tmp_path)
    session.close()
    assert not {"image", "mesh", "mesh-pose"} & _ids(page)


def _prints(record: dict) -> dict:
    return {s["stage"]: s["fingerprints"] for s in record["stages"] if s["fingerprints"]}


def test_on_run_with_a_mesh_gives_the_librarys_textured_glb_of_that_mesh(tiny_cache, tmp_path):  # noqa: F811
    pytest.importorskip("pixal3d.mesh.voxelize", reason="the voxeliser (issue 45's mesh_encode) is not here")
    ball = trimesh.creation.icosphere(subdivisions=3, radius=0.3)
    ball.export(tmp_path / "ball.glb")
    with Pixal3D.from_config(TINY_CONFIG, policy="staged", device="cpu", input_kind="mesh") as pipe:
        expected = pipe.run(EXAMPLE, mesh=tmp_path / "ball.glb", mesh_pose="aligned", seed=7)
        expected.save(tmp_path / "library.glb")
    session, page = _page(load_config(TINY_CONFIG), tmp_path / "app")
    try:
        last = _run(_on_run(page), str(EXAMPLE), str(tmp_path / "ball.glb"))[-1]
        assert last[0].startswith("done in"), last[0]
        glb = Path(last[2])
        record = json.loads(glb.with_suffix(".run.json").read_text())
        assert _prints(record) == expected.fingerprints() and glb.read_bytes() == (tmp_path / "library.glb").read_bytes()
        assert record["app"]["settings"]["mesh_pose"] == "aligned"
        [out] = trimesh.load(glb, process=False).geometry.values()
        assert len(out.faces) == len(ball.faces)  # the ball's own faces
        assert np.asarray(out.visual.material.baseColorTexture)[..., :3].std() > 1  # textured, not one flat colour
        # a bad mesh: one line in the status, in the upload's words
        (tmp_path / "bad.glb").write_bytes(b"not a mesh")
        last = _run(_on_run(page), str(EXAMPLE), str(tmp_path / "bad.glb"))[-1]
        assert last[0].startswith("**error: the uploaded mesh bad.glb: cannot be read as a mesh"), last[0]
        assert "\n" not in last[0] and last[2] is None
    finally:
        session.close()


def test_a_mesh_pose_without_a_mesh_is_refused_in_one_line(tiny_cache, tmp_path):  # noqa: F811
    session, page = _page(load_config(TINY_CONFIG), tmp_path)
    try:
        last = _run(_on_run(page), str(EXAMPLE), None, mesh_pose="estimate")[-1]
    finally:
        session.close()
    assert last[0].startswith("**error: ") and "mesh pose goes with a mesh" in last[0], last[0]
