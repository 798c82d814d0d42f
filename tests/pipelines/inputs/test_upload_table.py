"""Issue 47 item 2: the web app's form and the job server's upload parser are built from the table of kinds of input
(``InputKind.upload``), so a new kind with an upload is its own file and its row in ``KINDS``. The front ends'
upload code names no kind (its modules, its names, its field names), and a toy kind put in the table (shaped as
issue 45's mesh input: an image and a mesh file, with a note) gets its form in the app and its upload through the
server's parser, neither file edited. Controls: a kind's name or branch written back into a front end is found."""
from __future__ import annotations

import ast
import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from pipelines import inputs
from pipelines.inputs import KINDS, InputKind, UploadField
from pipelines.inputs.kind import ANY_FILE, TEXT
from tests.support.cascade_fixtures import EXAMPLE, REPO, tiny, tiny_cache  # noqa: F401
from tests.support.uploads import request_of, served_app

FRONT_ENDS = ("pipelines/app/ui.py", "pipelines/app/job.py", "pipelines/serve/routes.py",
              "pipelines/serve/service.py", "pipelines/serve/store.py")
"""Where the app and the server handle uploads (the form, the run of an upload, the parser, the queue, the files)."""
KIND_MODULES = ("pipelines/inputs/image.py", "pipelines/inputs/views.py", "pipelines/inputs/mesh.py",
                "pixal3d/models/views.py")
"""The kinds' own files, and the library of one of them (the views folder's reader and writer)."""
BRANCH_WORDS = {"takes_views", "ViewsUpload", "run_views_job", "_read_views", "_read_image", "VIEW_FIELDS"}
"""What the front ends' image-or-views branches were called before their uploads came from the table."""


def defined_in(path: Path) -> set[str]:
    """The public names a module defines at its top level (classes, functions, constants)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return {n for n in names if not n.startswith("_") and n != "logger"}


def kind_words(kinds: tuple[InputKind, ...]) -> tuple[set[str], set[str]]:
    """The names a front end must not use (what the kinds' files define) and the strings it must not hold (each
    kind's name and its upload's field names)."""
    names = set().union(*(defined_in(REPO / path) for path in KIND_MODULES)) | BRANCH_WORDS
    strings = {kind.name for kind in kinds} | {field.name for kind in kinds for field in kind.upload}
    return names, strings


def kinds_named(source: str, kinds: tuple[InputKind, ...] = KINDS) -> set[str]:
    """What of a specific kind ``source`` names: a kind's module imported, a name one defines, a string equal to a
    kind's name or field, a ``config.views`` test."""
    names, strings = kind_words(kinds)
    modules = tuple(path.removesuffix(".py").replace("/", ".") for path in KIND_MODULES)
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if any(_is(module, node.level, m) for m in modules):
                found.add(f"module:{'.' * node.level}{module}")
            found |= {alias.name for alias in node.names} & names
        elif isinstance(node, ast.Name) and node.id in names:
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            if node.attr in names:
                found.add(node.attr)
            owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", None)
            if node.attr == "views" and owner == "config":
                found.add("config.views")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in strings:
            found.add(repr(node.value))
    return found


def _is(module: str, level: int, kind_module: str) -> bool:
    """Whether ``from <level dots><module> import`` (in ``pipelines/app/`` or ``pipelines/serve/``) is ``kind_module``."""
    return module == kind_module if level == 0 else kind_module.endswith("." + module) and "." in module


def test_the_front_ends_upload_code_names_no_kind_of_input():
    for path in FRONT_ENDS:
        assert kinds_named((REPO / path).read_text()) == set(), path


def test_controls_a_kinds_name_or_branch_written_back_into_a_front_end_is_found():
    source = (REPO / "pipelines/app/ui.py").read_text()
    assert kinds_named(source + "\nfrom ..inputs import VIEWS\n") == {"VIEWS"}
    assert kinds_named(source + "\nfrom ..inputs.views import VIEWS_ASK\n") == {"module:..inputs.views", "VIEWS_ASK"}
    assert kinds_named(source + "\nfrom pixal3d.models.views import RIG_FOV_DEG\n") == \
        {"module:pixal3d.models.views", "RIG_FOV_DEG"}
    assert kinds_named(source + "\ntakes_views = config.views is not None\n") == {"takes_views", "config.views"}
    assert kinds_named(source + "\nupload = form.get('image')\n") == {"'image'"}
    assert kinds_named(source + "\nfile = form.getlist('transforms')\n") == {"'transforms'"}
    assert kinds_named(source + "\nmesh = form.get('mesh')\n") == {"'mesh'"}  # the mesh kind's name (issue 45)
    # a kind added to the table is covered too: its field names become words a front end must not hold
    assert kinds_named(source + "\nnote = form.get('note')\n") == set()
    assert kinds_named(source + "\nnote = form.get('note')\n", (TOY, *KINDS)) == {"'note'"}


# -- a toy kind with an upload of its own (an image and a mesh file, as issue 45's) --------------------------------
class ToyMeshInput(InputKind):
    """A kind that only exists here: an image with a mesh file and a note; ``receive`` writes them as they came."""

    name = "toy_mesh"
    argument = "toy_mesh"
    noun = "toy mesh"
    upload = (UploadField("image", "the object's image", ask="send it in 'image'", missing="no image: upload one"),
              UploadField("mesh", "its mesh (GLB, OBJ or PLY)", accepts=ANY_FILE, ask="send the mesh in 'mesh'",
                          missing="no mesh: upload the object's mesh"),
              UploadField("note", "a note", accepts=TEXT, required=False, default="as it came"))
    upload_title = "# a toy kind"
    upload_prompt = "upload an image and its mesh"
    request_help = "send multipart/form-data with 'image' and 'mesh'"
    upload_noun = "an image with its mesh"

    def takes(self, config: Any, given: Any = ()) -> bool:
        return config.name == "toy"

    def upload_stem(self, parts: dict[str, Any]) -> str:
        return Path(parts["mesh"][0].filename).stem

    def receive(self, parts: dict[str, Any], folder: Path, options: dict[str, Any]) -> Path:
        written = folder / "toy"
        written.mkdir(parents=True)
        for name in ("image", "mesh"):
            [file] = parts[name]
            (written / f"{name}-{file.filename}").write_bytes(file.read())
        (written / "note.txt").write_text(parts["note"] or "")
        return written


TOY = ToyMeshInput()
MESH = b"ply\nformat ascii 1.0\nelement vertex 0\nend_header\n"


@pytest.fixture
def toy(tiny, monkeypatch):  # noqa: F811
    """The toy kind first in the table, and a config (the tiny one, renamed) that takes it."""
    monkeypatch.setattr(inputs, "KINDS", (TOY, *KINDS))
    return dataclasses.replace(tiny, name="toy")


def test_a_kind_put_in_the_table_gets_its_form_in_the_app_and_its_upload_reaches_it(toy, tmp_path, monkeypatch):
    pytest.importorskip("gradio")
    from pipelines.app import job as app_job
    from pipelines.app import ui
    from pipelines.job import SETTINGS
    from pipelines.session import Session

    mesh = tmp_path / "cup.ply"
    mesh.write_bytes(MESH)
    given = []
    monkeypatch.setattr(ui, "run_job", lambda session, upload, job, **_: given.append(upload) or iter(
        [app_job.JobUpdate(status="error: stopped here", error="stopped here")]))
    session = Session("app", device="cpu")
    try:
        page = ui.build_ui(session, toy, outputs=tmp_path / "out")
        ids = {b.elem_id for b in page.blocks.values() if getattr(b, "elem_id", None)}
        assert {"image", "mesh", "note"} <= ids and not {"views", "azimuths", "fov", "fov-auto", "num-views"} & ids
        [on_run] = [f.fn for f in page.fns.values() if getattr(f.fn, "__name__", "") == "on_run"]
        *_, last = on_run(str(EXAMPLE), str(mesh), "two views", lambda *a, **k: None,
                          *({"seed": 3}.get(s.name) for s in SETTINGS))
    finally:
        session.close()
    assert last[0] == "**error: stopped here**"
    [upload] = given
    assert [(f.filename, f.path) for f in upload.parts["image"]] == [(EXAMPLE.name, EXAMPLE)]
    assert [f.read() for f in upload.parts["mesh"]] == [MESH] and upload.parts["note"] == "two views"

    # the app's run of that upload: the kind's receive writes it in the job's folder, named by the kind's stem
    ran = []
    monkeypatch.setattr(app_job, "_run_in", lambda session, source, stem, folder, job, poll: iter(
        [ran.append((source, stem, folder)) or app_job.JobUpdate(status="ran", error="ran")]))
    job = app_job.Job.from_form({"seed": 3}, toy)
    list(app_job.run_job(None, upload, job, outputs=tmp_path / "out"))
    [(source, stem, folder)] = ran
    assert stem == "cup" and source == folder / "toy" and folder.is_dir()
    assert sorted(p.name for p in source.iterdir()) == ["image-example.png", "mesh-cup.ply", "note.txt"]
    assert (source / "mesh-cup.ply").read_bytes() == MESH
    missing = app_job.Upload({**upload.parts, "mesh": ()})
    [refused] = app_job.run_job(None, missing, job, outputs=tmp_path / "out")
    assert refused.error == "no mesh: upload the object's mesh"


def test_a_kind_put_in_the_table_is_taken_by_the_servers_parser_and_written_by_its_receive(toy, tiny, tmp_path):  # noqa: F811
    pytest.importorskip("fastapi")
    from pipelines.serve import routes

    here = served_app(toy, tmp_path / "data")
    image = ("image", ("cup.png", EXAMPLE.read_bytes(), "image/png"))
    mesh = ("mesh", ("cup.ply", MESH, "application/octet-stream"))
    parts, values = asyncio.run(routes.read_job(request_of([image, mesh], {"note": "hello",
                                                                         "settings": '{"seed": 3}'}), here))
    assert parts["image"][0].suffix == ".png" and parts["mesh"][0].read() == MESH and parts["note"] == "hello"
    assert values["seed"] == 3
    row = routes.submit(here, parts, values)
    folder = here.jobs.data.folder(row.id)
    assert row.input == "toy" and (folder / "toy" / "mesh-cup.ply").read_bytes() == MESH
    assert (folder / "toy" / "image-cup.png").read_bytes() == EXAMPLE.read_bytes()
    assert (folder / "toy" / "note.txt").read_text() == "hello"

    def refusal(config, files, data=None) -> tuple[int, str]:
        with pytest.raises(routes.Refused) as refused:
            asyncio.run(routes.read_job(request_of(files, data), served_app(config, tmp_path / config.name)))
        return refused.value.status, str(refused.value)

    # its own refusals, from its fields: a required one missing; the image checked from its header as any image
    assert refusal(toy, [image]) == (400, "no mesh: send the mesh in 'mesh'")
    assert refusal(toy, [("image", ("cup.png", b"not a png", "image/png")), mesh])[0] == 415
    # another kind's upload, refused in this kind's words
    assert refusal(toy, [("views", ("a.png", EXAMPLE.read_bytes()))]) == (400, (
        "this server's config (toy) takes an image with its mesh, not posed views: send multipart/form-data with "
        "'image' and 'mesh'"))
    # on an image server an image with a mesh is the mesh kind's upload (issue 45: a kind that goes with the
    # config's), read by that kind's fields, where the toy kind's own field is unknown
    parts, _ = asyncio.run(routes.read_job(request_of([image, mesh]), served_app(tiny, tmp_path / "tiny-mesh")))
    assert sorted(parts) == ["image", "mesh"] and parts["mesh"][0].read() == MESH
    status, message = refusal(tiny, [image, mesh], {"note": "hello"})
    assert status == 400 and "unknown form fields ['note']" in message
