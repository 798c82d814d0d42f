"""Issue 45 item 2 (the server): on a single-view config a job's multipart body may carry a mesh to texture beside
its image (field ``mesh``: GLB, OBJ or PLY); the job is then a mesh job, its mesh written in the job's folder and
read and checked before the job is queued, and the worker runs it as the command runs ``--mesh``: the same GLB, byte
for byte. A bad mesh is refused at submit in one line in the client's words, nothing kept. Control: another mesh
gives another GLB."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import trimesh

from tests.support.cascade_fixtures import EXAMPLE, REPO, TINY_CONFIG, tiny_cache  # noqa: F401
from tests.support.serve_harness import Server

pytest.importorskip("fastapi")
pytest.importorskip("pixal3d.mesh.voxelize", reason="the voxeliser (issue 45's mesh_encode) is not in this checkout")

SETTINGS = {"seed": 7, "memory_policy": "staged"}


def _command(image, mesh, out) -> bytes:
    """The command's ``--mesh`` run in a process of its own, as the server's worker runs."""
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", str(image), "--mesh", str(mesh), "--config",
                           str(TINY_CONFIG), "-o", str(out), "--seed", "7", "--memory-policy", "staged", "--quiet"],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    return out.read_bytes()


@pytest.fixture(scope="module")
def meshes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("meshes")
    trimesh.creation.icosphere(subdivisions=3, radius=0.3).export(folder / "ball.glb")
    trimesh.creation.box(extents=(0.5, 0.4, 0.3)).export(folder / "box.ply")
    return folder


@pytest.fixture(scope="module")
def expected(meshes, tiny_cache, tmp_path_factory):  # noqa: F811
    """The command's GLB of the example textured onto the ball, seed 7."""
    return _command(EXAMPLE, meshes / "ball.glb", tmp_path_factory.mktemp("command") / "ball.glb")


@pytest.fixture(scope="module")
def server(tiny_cache, tmp_path_factory):  # noqa: F811
    server = Server.start(tmp_path_factory.mktemp("serve-mesh") / "data", "--config", str(TINY_CONFIG))
    yield server
    server.stop()


def _post(server, mesh_name: str, mesh: bytes, settings=None, image=True):
    files = [("image", ("example.png", EXAMPLE.read_bytes(), "image/png"))] if image else []
    files.append(("mesh", (mesh_name, mesh, "application/octet-stream")))
    with server.client() as client:
        return client.post("/jobs", files=files, data={"settings": json.dumps(settings or SETTINGS)})


def _done(server, response) -> tuple[dict, dict, bytes]:
    assert response.status_code == 202, response.text
    job = response.json()["id"]
    view = server.wait(job, timeout=600)
    assert view["status"] == "done", (view, server.tail())
    return view, server.get(f"/jobs/{job}/run.json").json(), server.get(f"/jobs/{job}/result.glb").content


def test_an_image_with_a_mesh_gives_the_commands_glb_byte_for_byte(server, meshes, expected):
    view, record, glb = _done(server, _post(server, "ball.glb", (meshes / "ball.glb").read_bytes()))
    assert glb == expected
    assert [s["stage"] for s in view["stages"]][3:] == ["mesh_encode", "texture", "mesh_decode", "mesh_export"]
    assert "mesh_pose" in view["settings"] and record["serve"]["settings"]["seed"] == 7
    # control: another mesh, the same image and seed: another GLB (not the first job's mesh again)
    _, _, other = _done(server, _post(server, "box.ply", (meshes / "box.ply").read_bytes()))
    assert other != expected
    box = trimesh.load(trimesh.util.wrap_as_stream(other), file_type="glb", process=False)
    [textured] = box.geometry.values()
    assert len(textured.faces) == 12  # the box's own faces, textured


@pytest.mark.parametrize("case", ["not a mesh", "not a mesh file name", "outside the cube", "no faces",
                                  "no image", "estimate with a field of view"])
def test_a_bad_mesh_upload_is_refused_at_submit_in_one_line_in_the_clients_words(server, meshes, case):
    cloud = b"ply\nformat ascii 1.0\nelement vertex 3\nproperty float x\nproperty float y\nproperty float z\n" \
            b"end_header\n0 0 0\n0.1 0 0\n0 0.1 0\n"
    huge = trimesh.creation.icosphere(subdivisions=1, radius=2.0).export(file_type="glb")
    name, data, extra, status, words = {
        "not a mesh": ("ball.glb", b"hello, not a mesh", {}, 422, "the uploaded mesh ball.glb: cannot be read as a mesh"),
        "not a mesh file name": ("ball.stl", b"solid x", {}, 422, "the uploaded mesh 'ball.stl' is not named as a GLB"),
        "outside the cube": ("huge.glb", huge, {}, 422, "the uploaded mesh huge.glb: spans x/y/z"),
        "no faces": ("cloud.ply", cloud, {}, 422, "the uploaded mesh cloud.ply: is a point cloud"),
        "no image": ("ball.glb", (meshes / "ball.glb").read_bytes(), {"image": False}, 400, "no image: send the image"),
        "estimate with a field of view": ("ball.glb", (meshes / "ball.glb").read_bytes(),
                                          {"settings": {**SETTINGS, "mesh_pose": "estimate", "fov": 40}}, 422,
                                          "mesh pose estimate registers MoGe-2's points"),
    }[case]
    before = sorted(p.name for p in (server.data / "jobs").iterdir())
    response = _post(server, name, data, extra.get("settings"), image=extra.get("image", True))
    assert response.status_code == status, response.text
    message = response.json()["error"]
    assert words in message, message
    assert "\n" not in message and "Traceback" not in message and str(server.data) not in message
    assert "/jobs/" not in message and "--mesh" not in message  # the client's words: no server path, no flag
    if case == "outside the cube":
        assert "mesh_pose estimate" in message  # the setting it can send, not the command's --mesh-pose
    assert sorted(p.name for p in (server.data / "jobs").iterdir()) == before  # nothing kept


def test_queued_mesh_jobs_run_in_groups_of_the_same_mesh_each_as_the_command_runs_it(meshes, expected, tmp_path):
    """Two jobs on the ball and one on the box wait behind a held job: the ball's two run as one group (a batch
    textures one mesh), each with its own seed, the box's alone."""
    server = Server.start(tmp_path / "data", "--config", str(TINY_CONFIG), hold=tmp_path / "hold")
    ball, box = (meshes / "ball.glb").read_bytes(), (meshes / "box.ply").read_bytes()
    try:
        with server.held("preprocess"):
            first = _post(server, "ball.glb", ball, {**SETTINGS, "seed": 3}).json()["id"]
            server.wait(first, until=lambda view: view.get("stage") == "preprocess", timeout=120)
            jobs = [_post(server, "ball.glb", ball, {**SETTINGS, "seed": seed}) for seed in (7, 8)]
            jobs.append(_post(server, "box.ply", box))
        views = [server.wait(r.json()["id"], timeout=600) for r in jobs]
        assert [v["status"] for v in views] == ["done"] * 3, server.tail()
        assert [v["group"] for v in views] == [2, 2, 1]
        glbs = [server.get(f"/jobs/{r.json()['id']}/result.glb").content for r in jobs]
        assert glbs[0] == expected and glbs[1] != expected and glbs[2] not in glbs[:2]  # seed 7 as the command's
    finally:
        server.stop()


def test_the_example_client_sends_a_mesh_and_downloads_the_commands_glb(server, meshes, expected, tmp_path):
    out = tmp_path / "served.glb"
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "serve_client.py"), str(EXAMPLE), "--mesh",
                           str(meshes / "ball.glb"), "-o", str(out), "--url", server.url, "--settings",
                           json.dumps(SETTINGS)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == expected
    assert json.loads(out.with_suffix(".run.json").read_text())["mesh"]["file"] == "ball.glb"
