"""The job server takes ``"shape_only": true`` as the command takes ``--shape-only`` (one row of the settings): the
untextured GLB of the command, byte for byte, and a run.json that says so."""
from __future__ import annotations

import hashlib
import json

import pytest

from pipelines import cli
from tests.support.cascade_fixtures import EXAMPLE, TINY_CONFIG, tiny_cache  # noqa: F401
from tests.support.serve_harness import Server

pytest.importorskip("fastapi")


def test_a_shape_only_job_gives_the_commands_untextured_glb(tiny_cache, tmp_path):
    assert cli.main([str(EXAMPLE), "--config", str(TINY_CONFIG), "-o", str(tmp_path / "out.glb"), "--seed", "42",
                     "--memory-policy", "staged", "--shape-only", "--quiet"]) == 0
    glb = (tmp_path / "out.glb").read_bytes()
    server = Server.start(tmp_path / "data", "--config", str(TINY_CONFIG))
    try:
        response = server.submit(EXAMPLE.read_bytes(), {"seed": 42, "memory_policy": "staged", "shape_only": True})
        assert response.status_code == 202, response.text
        view = server.wait(response.json()["id"])
        assert view["status"] == "done", view
        data = server.get(f"/jobs/{view['id']}/result.glb").content
        run = server.get(f"/jobs/{view['id']}/run.json").json()
        refused = server.submit(EXAMPLE.read_bytes(), {"shape_only": True, "texture_size": 256})
    finally:
        server.stop()
    assert hashlib.sha256(data).hexdigest() == hashlib.sha256(glb).hexdigest()
    assert run["shape_only"] is True and run["serve"]["settings"]["shape_only"] is True
    assert [s["stage"] for s in run["stages"]][-2:] == ["shape_decode", "shape_export"]
    assert json.loads((tmp_path / "out.run.json").read_text())["shape_only"] is True
    assert refused.status_code == 422 and "texture size sets the texture, and a shape-only job makes none" in \
        refused.text
