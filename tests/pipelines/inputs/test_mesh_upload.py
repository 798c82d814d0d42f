"""Issue 45 item 2 (uploads): a mesh to texture comes with the image through the kinds' upload table. The kind of a
request is the one whose upload it carries among those its config takes (``inputs.request_kind``: an image with a
mesh on a single-view config is a mesh job; on a multi-view config it is not taken), and a mesh job keeps its kind
through the queue (recorded beside its upload) and runs, in groups of the same settings and the same mesh, as a
mesh job with the mesh its upload wrote. In process: the server's parser and queue, no worker, no weights."""
from __future__ import annotations

import asyncio
import json

import pytest
import trimesh

from pipelines import inputs
from pipelines.inputs import IMAGE, MESH, VIEWS
from pixal3d.config import load_config
from tests.support.cascade_fixtures import EXAMPLE, tiny, tiny_cache  # noqa: F401
from tests.support.uploads import request_of, served_app

pytest.importorskip("fastapi")


def _ball(radius: float) -> bytes:
    return trimesh.creation.icosphere(subdivisions=2, radius=radius).export(file_type="glb")


BALL, SMALLER = _ball(0.3), _ball(0.25)
IMAGE_PART = ("image", ("cup.png", EXAMPLE.read_bytes(), "image/png"))


def _mesh(data: bytes, name: str = "ball.glb") -> tuple:
    return ("mesh", (name, data, "model/gltf-binary"))


def test_the_kind_of_a_request_is_the_one_whose_upload_it_carries_among_those_its_config_takes(tiny):  # noqa: F811
    views = load_config("tiny_mv")
    assert inputs.request_kinds(tiny) == (IMAGE, MESH) and inputs.request_kinds(views) == (VIEWS,)
    assert inputs.request_kind(tiny, {"image", "mesh", "settings"}) is MESH
    assert inputs.request_kind(tiny, {"mesh"}) is MESH  # then refused for its missing image, in the mesh's words
    assert inputs.request_kind(tiny, {"image", "settings"}) is IMAGE  # control: no mesh, an image job
    assert inputs.request_kind(views, {"image", "mesh"}) is VIEWS  # a multi-view config textures no mesh
    # and refuses another kind's upload by the kind it is: an image alone an image's, with a mesh a mesh's
    assert inputs.upload_kind({"image"}, VIEWS) is IMAGE and inputs.upload_kind({"image", "mesh"}, VIEWS) is MESH
    assert inputs.upload_kind({"image", "mesh"}, MESH) is None and inputs.upload_kind({"views"}, MESH) is VIEWS
    # the form: the image's fields, then the mesh as an optional one (required only for a mesh job)
    assert [(f.name, f.required) for f in inputs.upload_fields(tiny)] == [("image", True), ("mesh", False)]
    assert [f.name for f in inputs.upload_fields(views)] == [f.name for f in VIEWS.upload]
    [_, mesh] = MESH.upload
    assert mesh.label == "mesh to texture (GLB, OBJ or PLY)" and mesh.accepts == "file" and mesh.required


def _submit(here, files, settings=None):
    from pipelines.serve import routes

    data = None if settings is None else {"settings": json.dumps(settings)}
    parts, values = asyncio.run(routes.read_job(request_of(files, data), here))
    return routes.submit(here, parts, values)


def test_a_mesh_job_keeps_its_kind_through_the_queue_and_groups_only_with_the_same_mesh(tiny, tmp_path):  # noqa: F811
    from pipelines.serve.worker import _asked

    here = served_app(tiny, tmp_path / "data")
    store = here.jobs.data
    ball = _submit(here, [IMAGE_PART, _mesh(BALL)], {"seed": 1, "mesh_pose": "aligned"})
    again = _submit(here, [IMAGE_PART, _mesh(BALL)], {"seed": 2, "mesh_pose": "aligned"})
    smaller = _submit(here, [IMAGE_PART, _mesh(SMALLER)], {"seed": 1, "mesh_pose": "aligned"})
    renamed = _submit(here, [IMAGE_PART, _mesh(BALL, "b.glb")], {"seed": 1, "mesh_pose": "aligned"})
    image = _submit(here, [IMAGE_PART], {"seed": 1})
    rows = {name: here.jobs.queue.get(row.id) for name, row in
            (("ball", ball), ("again", again), ("smaller", smaller), ("renamed", renamed), ("image", image))}
    # a batch textures one mesh: only jobs with its settings and its mesh share a plan; an image job never does
    assert rows["ball"].plan == rows["again"].plan != rows["smaller"].plan
    assert rows["renamed"].plan not in (rows["ball"].plan, rows["smaller"].plan)  # its records name its own file
    assert rows["image"].plan not in (rows["ball"].plan, rows["smaller"].plan)
    assert rows["ball"].settings["mesh_pose"] == "aligned" and "mesh_pose" not in rows["image"].settings
    # the mesh job's folder: the image as sent, the mesh under its own name, and its kind; the image job's as before
    folder = store.folder(ball.id)
    assert (folder / rows["ball"].input).read_bytes() == EXAMPLE.read_bytes()
    assert (folder / "mesh" / "ball.glb").read_bytes() == BALL
    assert store.input_kind(ball.id) == "mesh" and store.input_kind(image.id) is None
    assert sorted(p.name for p in store.folder(image.id).iterdir()) == ["input.png"]
    # its worker asks the job as it was submitted: a mesh job of that mesh (the image job: an image job)
    claim = {"id": ball.id, "settings": rows["ball"].settings, "input": rows["ball"].input}
    job = _asked(store, tiny, claim)
    assert job.kind is MESH and job.mesh == folder / "mesh" / "ball.glb" and job.mesh_pose == "aligned"
    job = _asked(store, tiny, {"id": image.id, "settings": rows["image"].settings, "input": rows["image"].input})
    assert job.kind is IMAGE and job.mesh is None


def test_a_mesh_pose_without_a_mesh_and_a_mesh_without_an_image_are_refused_in_the_uploads_words(tiny, tmp_path):  # noqa: F811
    from pipelines.serve import routes

    here = served_app(tiny, tmp_path / "data")
    with pytest.raises(routes.Refused) as refused:
        _submit(here, [IMAGE_PART], {"mesh_pose": "estimate"})
    assert refused.value.status == 422 and "settings.mesh_pose: a mesh pose goes with a mesh" in str(refused.value)
    with pytest.raises(routes.Refused) as refused:
        _submit(here, [_mesh(BALL)])
    assert (refused.value.status, str(refused.value)) == (400, "no image: send the image file in the multipart field "
                                                               + "'image'")
    with pytest.raises(routes.Refused) as refused:  # two meshes: the mesh's upload takes one
        _submit(here, [IMAGE_PART, _mesh(BALL), _mesh(SMALLER, "b.glb")])
    assert refused.value.status == 400 and str(refused.value).startswith("several files were sent; ")
    with pytest.raises(routes.Refused) as refused:  # a mesh sent as text, not a file
        asyncio.run(routes.read_job(request_of([IMAGE_PART], {"mesh": "ball.glb"}), here))
    assert (refused.value.status, str(refused.value)) == (400, "no mesh: send the mesh to texture (GLB, OBJ or PLY) "
                                                               + "in the multipart field 'mesh', with the image in 'image'")
    assert not list(here.jobs.data.jobs.iterdir())  # nothing kept
