"""The web app's exposure rule: a non-loopback ``--host`` is refused (one line, exit 2) unless ``--auth-file`` makes
visitors sign in or ``--insecure`` says to serve it open, and one line at start says which. With ``--auth-file`` the
app's endpoints answer 401 until a visitor signs in (a live app on loopback)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from pipelines.app.main import exposure, parse_args
from pipelines.errors import UsageError
from tests.support.cascade_fixtures import REPO, TINY_CONFIG, tiny_cache  # noqa: F401


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def test_a_non_loopback_host_needs_an_auth_file_or_insecure(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pipelines.app", "--config", str(TINY_CONFIG), "--host", "0.0.0.0"],
                          capture_output=True, text=True, env=_env(), cwd=REPO, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc
    assert "--auth-file" in lines[0] and "--insecure" in lines[0] and "0.0.0.0" in lines[0]
    assert exposure(parse_args(["--host", "127.0.0.1"])) == (None, None)
    pairs = tmp_path / "users"
    pairs.write_text("# who may sign in\nann:pass-one\n\nbob:pass:two\n")
    auth, line = exposure(parse_args(["--host", "0.0.0.0", "--auth-file", str(pairs)]))
    assert auth == [("ann", "pass-one"), ("bob", "pass:two")] and "sign-in required" in line
    auth, line = exposure(parse_args(["--host", "192.168.1.5", "--insecure"]))
    assert auth is None and "anyone who reaches it can run jobs" in line
    pairs.write_text("ann\n")
    with pytest.raises(UsageError, match="line 1 is not user:password"):
        exposure(parse_args(["--host", "0.0.0.0", "--auth-file", str(pairs)]))


def test_with_an_auth_file_the_app_answers_401_until_a_visitor_signs_in(tiny_cache, tmp_path):
    pytest.importorskip("gradio")
    (tmp_path / "users").write_text("ann:secret-pass-1\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path / "app.log"
    with open(log, "wb") as out:
        app = subprocess.Popen([sys.executable, "-m", "pipelines.app", "--config", str(TINY_CONFIG), "--port", str(port),
                                "--auth-file", str(tmp_path / "users"), "--outputs", str(tmp_path / "out")],
                               stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while "pixal3d-app: serving" not in log.read_text(errors="replace"):
            assert app.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        lines = log.read_text().strip().splitlines()  # one line of ours, none of Gradio's (no share=True hint)
        assert lines == [f"pixal3d-app: serving {url} (bound to 127.0.0.1: this machine only; sign-in required "
                         f"(1 users in {tmp_path / 'users'})); Ctrl-C stops it"], lines
        with httpx.Client(base_url=url) as client:
            assert client.get("/config").status_code == 401
            assert client.post("/login", data={"username": "ann", "password": "wrong"}).status_code >= 400
            assert client.get("/config").status_code == 401
            assert client.post("/login", data={"username": "ann", "password": "secret-pass-1"}).status_code == 200
            assert client.get("/config").status_code == 200  # the session cookie signs it in
    finally:
        app.terminate()
        app.wait(30)
