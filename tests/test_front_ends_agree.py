"""Issue 38: one job, three front ends, one result. The same job given as the command's flags, the job server's JSON
and the web app's form gives run.json files that agree on the seed, the field of view, the memory policy and budget
and every stage's fingerprints; without a seed, each takes the config's (a config with seed 7 here: the server ran
such a job with a hard-coded 42, so its run.json said seed 42 and its fingerprints were another seed's).

Each front end runs in a process of its own (the command, a real ``pixal3d-serve`` over HTTP on loopback, the app's
page handler in a child process), so the three results are compared between fresh processes alike. Control: the
same job with seed 42 given (what the server did on its own) differs in its fingerprints, so the comparison can
tell one seed from another."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pipelines.job import Job
from pixal3d.config import load_config
from tests.support.cascade_fixtures import EXAMPLE, REPO, TINY_CONFIG, tiny_cache  # noqa: F401
from tests.support.serve_harness import Server

SETTINGS = {"fov": 40.0, "memory_policy": "staged", "memory_budget": "2G"}
"""The job, under the server's names; no seed: the config's (the export's texture size and face budget: the
config's too, small for speed)."""
FLAGS = ["--fov", "40", "--memory-policy", "staged", "--memory-budget", "2G"]
"""The same job as the command's flags."""

APP_FORM = """
    import json, sys
    from pathlib import Path
    from pipelines.app.ui import build_ui
    from pipelines.session import Session
    from pixal3d.config import load_config
    form = json.loads(sys.argv[3])  # the page's fields, as the visitor left them
    page = build_ui(Session("app", device="cpu"), load_config(sys.argv[1]), outputs=Path(sys.argv[4]))
    [on_run] = [f.fn for f in page.fns.values() if getattr(f.fn, "__name__", "") == "on_run"]
    from pipelines.job import SETTINGS
    *_, last = on_run(sys.argv[2], None, form.pop("fov_auto"), lambda *a, **k: None,  # the image, no mesh
                      *(form.get(s.name) for s in SETTINGS))
    print(json.dumps(str(last[0])))
"""


def _env(cache) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PIXAL3D_CACHE": str(cache)}


@pytest.fixture(scope="module")
def seven(tmp_path_factory):
    """The tiny config with its own seed, 7 (and a small export, for speed)."""
    path = tmp_path_factory.mktemp("seven") / "seven.yaml"
    path.write_text(f"base: {TINY_CONFIG}\nseed: 7\nexport: {{texture_size: 128, decimation_target: 2000}}\n")
    return path


def _cli(config, out, cache, *extra) -> dict:
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", str(EXAMPLE), "--config", str(config), "-o",
                           str(out), "--quiet", *FLAGS, *extra], cwd=REPO, env=_env(cache), capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.with_name(f"{out.stem}.run.json").read_text())


@pytest.fixture(scope="module")
def command(seven, tiny_cache, tmp_path_factory):
    """The command's run.json for the job."""
    return _cli(seven, tmp_path_factory.mktemp("cli") / "out.glb", tiny_cache)


def _same(record: dict) -> dict:
    """What the front ends must agree on."""
    return {"seed": record["seed"], "fov_deg": record["fov_deg"], "policy": record["policy"],
            "memory_budget": record["memory_budget"],
            "fingerprints": {s["stage"]: s["fingerprints"] for s in record["stages"] if s["fingerprints"]}}


def test_the_command_takes_the_configs_seed_and_the_job_as_given(seven, command):
    assert _same(command)["seed"] == 7 and command["fov_deg"] == 40.0 and command["policy"] == "staged"
    assert command["memory_budget"] == 2 * 2**30 and command["config"]["export"]["texture_size"] == 128
    assert command["cli"]["settings"] == Job.from_request(SETTINGS, load_config(seven)).settings()  # seed: the config's
    given = {**SETTINGS, "seed": 7, "texture_size": None, "face_budget": None}
    assert given.items() <= command["cli"]["settings"].items()


def test_the_servers_json_gives_the_commands_run_json(seven, tiny_cache, tmp_path, command):
    server = Server.start(tmp_path / "data", "--config", str(seven))
    try:
        response = server.submit(EXAMPLE.read_bytes(), SETTINGS)
        assert response.status_code == 202, response.text
        job = response.json()["id"]
        view = server.wait(job, timeout=600)
        assert view["status"] == "done", (view, server.tail())
        record = server.get(f"/jobs/{job}/run.json").json()
    finally:
        server.stop()
    assert _same(record) == _same(command)
    assert record["serve"]["settings"] == command["cli"]["settings"] == view["settings"]


def test_the_apps_form_gives_the_commands_run_json(seven, tiny_cache, tmp_path, command):
    pytest.importorskip("gradio")
    # the page's fields: the seed left empty, the export's as the page shows them (the config's values)
    form = {"fov_auto": False, "seed": None, **SETTINGS, "texture_size": 128, "face_budget": 2000}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(APP_FORM), str(seven), str(EXAMPLE), json.dumps(form),
                           str(tmp_path / "app")], cwd=REPO, env=_env(tiny_cache), capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0 and "done in" in proc.stdout, (proc.stdout, proc.stderr)
    [path] = (tmp_path / "app").rglob("*.run.json")
    record = json.loads(path.read_text())
    assert _same(record) == _same(command)
    assert record["app"]["settings"]["seed"] == 7


def test_control_another_seed_gives_other_fingerprints(seven, tiny_cache, tmp_path, command):
    other = _cli(seven, tmp_path / "42.glb", tiny_cache, "--seed", "42")
    assert other["seed"] == 42 and _same(other)["fingerprints"] != _same(command)["fingerprints"]
    assert {**_same(other), "seed": 7, "fingerprints": None} == {**_same(command), "fingerprints": None}
