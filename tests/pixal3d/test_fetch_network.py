"""pixal3d-fetch against a Hub it cannot use, through the real huggingface_hub and its HTTP client (no fake in
between): an endpoint on loopback where nothing listens is one line and exit 2; a Hub that answers 404 or 500
is one line naming the file and the answer (exit 1); neither prints a traceback or the client's request log."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _fetch(endpoint: str, tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    """``python -m pixal3d.fetch`` (the command's code) with an empty cache, talking to ``endpoint``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf"), PIXAL3D_CACHE=str(tmp_path / "cache"), **extra)
    return subprocess.run([sys.executable, "-m", "pixal3d.fetch", "--no-rembg"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out and "HTTP Request" not in out, out
    return [line for line in out.splitlines() if line.startswith("pixal3d-fetch: error:")]


def test_a_hub_nobody_answers_at_is_one_line_and_exit_2(tmp_path):
    with socket.socket() as sock:  # a loopback port that was free a moment ago: nothing listens there now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = _fetch(f"http://127.0.0.1:{port}", tmp_path)
    errors = _error_lines(proc)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(errors) == 1 and "could not be reached for pipeline.json of TencentARC/Pixal3D@" in errors[0], errors
    assert len((proc.stdout + proc.stderr).splitlines()) <= 2  # the file it was fetching, and the error


def test_offline_mode_is_one_line_saying_so_and_exit_2(tmp_path):
    proc = _fetch("http://127.0.0.1:9", tmp_path, HF_HUB_OFFLINE="1")
    errors = _error_lines(proc)
    assert proc.returncode == 2 and len(errors) == 1 and "HF_HUB_OFFLINE is set" in errors[0], errors


class _Answering(BaseHTTPRequestHandler):
    status = 404

    def _answer(self) -> None:
        self.send_response(self.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = _answer

    def log_message(self, *_: object) -> None:  # the test server is silent
        pass


@pytest.fixture
def answering_hub() -> Iterator[type[_Answering]]:
    handler = type("Handler", (_Answering,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    handler.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield handler
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("status, answer", [(404, "404 Not Found"), (500, "500 Internal Server Error")])
def test_a_hub_that_refuses_the_file_is_one_line_naming_the_file_and_the_answer(answering_hub, tmp_path, status,
                                                                                answer):
    answering_hub.status = status
    proc = _fetch(answering_hub.url, tmp_path)
    errors = _error_lines(proc)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert len(errors) == 1 and f"the Hub answered {answer} for pipeline.json of TencentARC/Pixal3D@" in errors[0], \
        errors
