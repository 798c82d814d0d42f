"""The job server end to end over real HTTP on loopback: tiny jobs submitted, polled and downloaded give the GLB and
the fingerprints of the command for the same settings; jobs queued with one plan run as one group that loads each
model once; ``POST /generate`` returns the same bytes; ``DELETE`` stops a running job and the worker goes on; the
example client (``examples/serve_client.py``) downloads the same GLB."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from pipelines import cli
from pipelines.job import Job
from pixal3d.config import load_config
from tests.support.cascade_fixtures import EXAMPLE, REPO, TINY_CONFIG, tiny, tiny_cache  # noqa: F401
from tests.support.serve_harness import Server

pytest.importorskip("fastapi")

SETTINGS = {"seed": 42, "texture_size": 128, "face_budget": 2000, "memory_policy": "staged"}


@pytest.fixture(scope="module")
def server(tiny_cache, tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    server = Server.start(folder / "data", "--config", str(TINY_CONFIG), hold=folder / "hold")
    yield server
    server.stop()


def _fingerprints(record: dict) -> dict:
    return {s["stage"]: s["fingerprints"] for s in record["stages"] if s["fingerprints"]}


@pytest.fixture(scope="module")
def cli_run(tiny_cache, tmp_path_factory):
    """The command's GLB and run.json for ``SETTINGS`` (its export settings in a config, as the command takes them)."""
    folder = tmp_path_factory.mktemp("cli")
    config = folder / "small.yaml"
    config.write_text(f"base: {TINY_CONFIG}\nexport: {{texture_size: 128, decimation_target: 2000}}\n")
    assert cli.main([str(EXAMPLE), "--config", str(config), "-o", str(folder / "out.glb"), "--memory-policy",
                     "staged", "--seed", "42", "--quiet"]) == 0
    return (folder / "out.glb").read_bytes(), json.loads((folder / "out.run.json").read_text())


def test_three_jobs_give_the_commands_glb_and_run_as_one_group_loading_each_model_once(server, cli_run):
    image = EXAMPLE.read_bytes()
    # 1. a job of another plan keeps the worker busy while three of one plan queue behind it
    first = server.submit(image, {**SETTINGS, "texture_size": 256})
    assert first.status_code == 202, first.text
    server.wait(first.json()["id"], lambda v: v["status"] == "running")
    ids = []
    for _ in range(3):
        response = server.submit(image, SETTINGS)
        assert response.status_code == 202, response.text
        view = response.json()
        assert view["status"] == "queued" and len(view["id"]) == 32 and response.headers["location"] == \
            f"/jobs/{view['id']}"
        ids.append(view["id"])
    assert len(set(ids)) == 3
    assert [server.get(f"/jobs/{i}").json()["position"] for i in ids] == [1, 2, 3]
    # 2. every job ends done; the three ran as one group
    views = [server.wait(i) for i in [first.json()["id"], *ids]]
    assert [v["status"] for v in views] == ["done"] * 4, views
    assert views[0]["group"] == 1 and [v["group"] for v in views[1:]] == [3, 3, 3]
    # 3. each GLB and its fingerprints are the command's for the same settings
    glb, record = cli_run
    for job_id in ids:
        data = server.get(f"/jobs/{job_id}/result.glb")
        assert data.status_code == 200 and data.headers["content-type"] == "model/gltf-binary"
        assert hashlib.sha256(data.content).hexdigest() == hashlib.sha256(glb).hexdigest()
        run = server.get(f"/jobs/{job_id}/run.json").json()
        assert _fingerprints(run) == _fingerprints(record)
        expected = Job.from_request(SETTINGS, load_config(TINY_CONFIG)).settings()  # every setting, by the table
        assert run["serve"]["job"] == job_id and run["serve"]["settings"] == expected
        assert {**SETTINGS, "fov": None, "memory_budget": None}.items() <= expected.items()
        trace = server.get(f"/jobs/{job_id}/trace.jsonl")
        assert trace.status_code == 200 and trace.headers["content-type"].startswith("application/x-ndjson")
    # control: the job of the other texture size has other export bits, the same shape
    other = server.get(f"/jobs/{first.json()['id']}/run.json").json()
    assert _fingerprints(other)["export"] != _fingerprints(record)["export"]
    assert _fingerprints(other)["decode"] == _fingerprints(record)["decode"]
    # 4. grouped under staged, stage by stage: the three load the models as often as one job alone does (once per
    #    run of stages that needs them; staged releases a model between stages that do not), not three times as
    #    often; one memory trace for the group. The group's last job ends after the others' exports, so the count it
    #    saw covers the whole group.
    models = {m for s in record["stages"] for m in s["models"]}
    alone = views[0]["group_loads"]
    assert set(alone) == models and views[-1]["group_loads"] == alone, (alone, views[-1]["group_loads"])
    starts = [json.loads(server.get(f"/jobs/{i}/trace.jsonl").text.splitlines()[0]) for i in ids]
    assert all(start == starts[0] for start in starts) and starts[0]["order"] == "stage"
    assert len(starts[0]["images"]) == 3
    # 5. the per-stage rows in the status
    assert [s["stage"] for s in views[1]["stages"]] == [s["stage"] for s in record["stages"]]
    assert all(s["seconds"] >= 0 and not s["resumed"] for s in views[1]["stages"])


def test_generate_returns_the_same_bytes_as_a_job(server, cli_run):
    response = server.submit(EXAMPLE.read_bytes(), SETTINGS, path="/generate")
    assert response.status_code == 200, response.text
    assert response.content == cli_run[0]
    job_id = response.headers["x-job-id"]
    assert server.get(f"/jobs/{job_id}").json()["status"] == "done"


def test_delete_stops_a_running_job_at_its_next_stage_and_the_worker_goes_on(server):
    image = EXAMPLE.read_bytes()
    with server.held("structure"):  # a tiny stage lasts milliseconds: the job waits there until the DELETE is in
        job = server.submit(image, {**SETTINGS, "seed": 5}).json()["id"]
        server.wait(job, lambda v: v.get("stage") == "structure")
        with server.client() as client:
            response = client.delete(f"/jobs/{job}")
        assert response.status_code == 200 and response.json()["status"] in ("running", "cancelled")
    view = server.wait(job, timeout=60)
    assert view["status"] == "cancelled" and "DELETE" in view["error"]
    gone = server.get(f"/jobs/{job}/result.glb")  # it will never come: 410, one line (it was 404 "comes when done")
    assert gone.status_code == 410 and "cancelled" in gone.json()["error"] and "\n" not in gone.json()["error"]
    with server.client() as client:
        again = client.delete(f"/jobs/{job}")
    assert again.status_code == 409 and "cancelled" in again.json()["error"]
    # a queued job is cancelled before it starts; the worker then serves the next job
    with server.held("structure"):
        busy = server.submit(image, {**SETTINGS, "seed": 6}).json()["id"]
        server.wait(busy, lambda v: v.get("stage") == "structure")
        queued = server.submit(image, {**SETTINGS, "seed": 7}).json()["id"]
        with server.client() as client:
            assert client.delete(f"/jobs/{queued}").json()["status"] == "cancelled"
    assert server.wait(busy)["status"] == "done"
    assert server.get(f"/jobs/{queued}").json()["status"] == "cancelled"


def test_the_example_client_downloads_the_commands_glb(server, cli_run, tmp_path):
    out = tmp_path / "served.glb"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "serve_client.py"), str(EXAMPLE), "-o", str(out),
                           "--url", server.url, "--settings", json.dumps(SETTINGS)], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == cli_run[0]
    assert json.loads(out.with_suffix(".run.json").read_text())["serve"]["settings"]["seed"] == 42
    assert "export" in proc.stdout and "queued" in proc.stdout
