"""The job server on a multi-view config: a job's views are several files in the multipart field ``views`` with
their azimuths (default: upstream's rig, 0/90/180/270 degrees at 20 degrees' field of view) or a ``transforms``
file; the job's views folder is written under ``--data`` and checked before the job is queued, and the worker runs
it as the command runs a views folder. Control: the swapped-colour views give other fingerprints."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.cascade_fixtures import EXAMPLE, REPO, tiny_cache  # noqa: F401
from tests.support.serve_harness import Server
from tests.support.views_fixtures import EXAMPLE_VIEWS, fast_mv_config, swapped_views  # noqa: F401

pytest.importorskip("fastapi")

SETTINGS = {"seed": 9, "memory_policy": "staged"}


def _prints(record: dict) -> dict:
    return {s["stage"]: s["fingerprints"] for s in record["stages"] if s["fingerprints"]}


def _views(folder) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [("views", (p.name, p.read_bytes(), "image/png")) for p in sorted(folder.glob("*.png"))]


def _command(config, views, out) -> dict:
    """The command's run on ``views`` in a process of its own, as the server's worker runs."""
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "--views", str(views), "--config", str(config),
                           "-o", str(out), "--seed", "9", "--memory-policy", "staged", "--quiet"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    return {"prints": _prints(json.loads(out.with_suffix(".run.json").read_text())), "glb": out.read_bytes()}


@pytest.fixture(scope="module")
def library(fast_mv_config, tmp_path_factory):
    """The command's runs of the example folder and of the swapped one (the control), seed 9."""
    folder = tmp_path_factory.mktemp("command")
    swapped = swapped_views(folder / "swapped")
    return {"example": _command(fast_mv_config, EXAMPLE_VIEWS, folder / "example.glb"),
            "swapped": _command(fast_mv_config, swapped, folder / "swapped.glb"), "swapped_folder": swapped}


@pytest.fixture(scope="module")
def server(library, fast_mv_config, tmp_path_factory):
    server = Server.start(tmp_path_factory.mktemp("serve-mv") / "data", "--config", str(fast_mv_config))
    yield server
    server.stop()


def _post(server, files, data=None):
    with server.client() as client:
        return client.post("/jobs", files=files, data={"settings": json.dumps(SETTINGS), **(data or {})})


def _done(server, response) -> tuple[dict, bytes]:
    assert response.status_code == 202, response.text
    job = response.json()["id"]
    view = server.wait(job, timeout=600)
    assert view["status"] == "done", (view, server.tail())
    return server.get(f"/jobs/{job}/run.json").json(), server.get(f"/jobs/{job}/result.glb").content


def test_views_with_the_rigs_azimuths_or_a_transforms_json_give_the_librarys_run(server, library):
    expected = library["example"]
    # the rig: four files, no azimuths (0/90/180/270 at 20 degrees), and the same four with explicit azimuths
    for data in (None, {"azimuths": "0, 90, 180, 270", "views_fov": "20"}):
        record, glb = _done(server, _post(server, _views(EXAMPLE_VIEWS), data))
        assert _prints(record) == expected["prints"] and glb == expected["glb"]
        assert record["views"]["views"] == 4 and record["serve"]["settings"]["num_views"] is None
    # the folder's own transforms.json
    transforms = [("transforms", ("transforms.json", (EXAMPLE_VIEWS / "transforms.json").read_bytes(),
                                  "application/json"))]
    record, glb = _done(server, _post(server, _views(EXAMPLE_VIEWS) + transforms))
    assert _prints(record) == expected["prints"] and glb == expected["glb"]
    # control: the swapped views (the same rig) give the library's swapped run, not the example's
    record, _ = _done(server, _post(server, _views(library["swapped_folder"])))
    assert _prints(record) == library["swapped"]["prints"] != expected["prints"]


@pytest.mark.parametrize("case", ["an image", "three views, no azimuths", "transforms and azimuths",
                                  "a view that is no image", "too many views asked for", "a field of view setting",
                                  "a frame's file missing", "no views", "transforms without frames",
                                  "transforms not JSON", "a frame outside the folder", "a frame without a file"])
def test_every_wrong_upload_is_refused_with_one_line_and_nothing_kept(server, case):
    views = _views(EXAMPLE_VIEWS)
    transforms = ("transforms", ("transforms.json", (EXAMPLE_VIEWS / "transforms.json").read_bytes(), "text/json"))
    files, data, status, words = {
        "an image": ([("image", ("x.png", EXAMPLE.read_bytes(), "image/png"))], None, 400,
                     "takes posed views, not one image"),
        "three views, no azimuths": (views[:3], None, 422, "3 views and no azimuths: give one azimuth"),
        "transforms and azimuths": (views + [transforms], {"azimuths": "0 90 180 270"}, 400,
                                    "send 'transforms' or 'azimuths'/'views_fov', not both"),
        "a view that is no image": ([views[0], ("views", ("b.png", b"not a png", "image/png"))], None, 415,
                                    "view 1 (b.png): the image field is not an image"),
        "too many views asked for": (views, {"settings": json.dumps({"num_views": 5})}, 422,
                                     "num_views=5 is above the 4 frames"),
        "a field of view setting": (views, {"settings": json.dumps({"fov": 30})}, 422,
                                    "settings.fov: a field of view does not apply to posed views"),
        "a frame's file missing": (views[:3] + [transforms], None, 422, "view03_azim270.png does not exist"),
        "no views": ([("transforms", transforms[1])], None, 400, "no views: send each view image"),
        "transforms without frames": (views + [_transforms({"camera_angle_x": 0.35})], None, 422,
                                      "transforms.json has no 'frames' list"),
        "transforms not JSON": (views + [("transforms", ("transforms.json", b"{", "text/json"))], None, 422,
                                "not valid JSON"),
        "a frame outside the folder": (views + [_transforms(_frames(file_path="../view00_azim0.png"))], None, 422,
                                       "points outside the uploaded views"),
        "a frame without a file": (views + [_transforms(_frames(file_path="gone.png"))], None, 422,
                                   "does not exist in the uploaded views"),
    }[case]
    before = sorted(p.name for p in (server.data / "jobs").iterdir())
    response = _post(server, files, data)
    assert response.status_code == status and words in response.json()["error"], response.text
    assert "\n" not in response.json()["error"]
    # the client's own file names, never the server's layout (issue 44 item 5: 8 of 34 answers named it)
    assert str(server.data) not in response.text and "/jobs/" not in response.text, response.text
    assert sorted(p.name for p in (server.data / "jobs").iterdir()) == before


def _transforms(meta: dict) -> tuple[str, tuple[str, bytes, str]]:
    return "transforms", ("transforms.json", json.dumps(meta).encode(), "text/json")


def _frames(**first: str) -> dict:
    """The example's transforms.json with its first frame's fields replaced by ``first``."""
    meta = json.loads((EXAMPLE_VIEWS / "transforms.json").read_text())
    meta["frames"][0].update(first)
    return meta


def test_a_view_file_name_with_dot_dots_is_kept_to_its_base_name_inside_the_jobs_folder(server):
    """A multipart file name ``../../x.png`` (a client that tries to write outside the job's folder) is reduced to
    its base name by the multipart parser: the job's views folder holds ``x.png`` and nothing lands outside it
    (issue 44 item 6: checked, not a defect; this keeps it so)."""
    views = _views(EXAMPLE_VIEWS)
    name = views[0][1][0]
    views[0] = ("views", (f"../../{name}", views[0][1][1], "image/png"))
    outside = sorted(p.name for p in server.data.iterdir())
    response = _post(server, views)
    assert response.status_code == 202, response.text
    job = response.json()["id"]
    folder = server.data / "jobs" / job / "views"
    assert name in {p.name for p in folder.iterdir()}
    assert sorted(p.name for p in server.data.iterdir()) == outside
    assert not (server.data / "jobs" / name).exists() and not (server.data / name).exists()
    with server.client() as client:
        client.delete(f"/jobs/{job}")
