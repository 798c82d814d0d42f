"""What the job server refuses, over real HTTP on loopback: requests without the token or with a wrong one (401,
nothing created), bad uploads and settings, ids that are not ids (``../etc/passwd`` too), a full queue; each a 4xx
with a one-line JSON error, and the server goes on serving. Also the jobs' time limit, and the start-up rule that a
non-loopback ``--host`` needs a token."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib

import httpx
import pytest

from pipelines.errors import UsageError
from pipelines.serve.main import check_args, is_loopback, parse_args
from tests.support.cascade_fixtures import EXAMPLE, REPO, TINY_CONFIG, tiny_cache  # noqa: F401
from tests.support.serve_harness import Server

pytest.importorskip("fastapi")

TOKEN = "test-token-0123456789abcdef"


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header says ``width`` x ``height`` (no pixel data: Pillow reads the size from the header)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0))
            + chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def server(tiny_cache, tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-requests")
    (folder / "token").write_text(TOKEN + "\n")
    server = Server.start(folder / "data", "--config", str(TINY_CONFIG), "--token-file", str(folder / "token"),
                          "--max-upload", "100K", "--max-pixels", "1000000", "--queue-size", "1",
                          "--job-timeout", "0.001", token=TOKEN)
    yield server
    server.stop()


def _jobs(server: Server) -> list[str]:
    return sorted(p.name for p in (server.data / "jobs").iterdir())


def _one_line_error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, (response.status_code, response.text)
    message = response.json()["error"]
    assert message and "\n" not in message
    return message


def test_requests_without_the_token_or_with_a_wrong_one_get_401_and_create_nothing(server):
    before = _jobs(server)
    files = {"image": ("a.png", EXAMPLE.read_bytes(), "image/png")}
    for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789abcdef"}, {"Authorization": TOKEN},
                    {"Authorization": f"Bearer {TOKEN}x"}):
        with httpx.Client(base_url=server.url, headers=headers) as client:
            for response in (client.post("/jobs", files=files), client.post("/generate", files=files),
                             client.get("/health"), client.get("/jobs/" + "0" * 32)):
                assert "Bearer" in _one_line_error(response, 401)
                assert response.headers["www-authenticate"] == "Bearer"
    assert _jobs(server) == before
    assert server.get("/health").status_code == 200  # with the token


def test_bad_uploads_and_settings_get_a_4xx_with_one_line_and_the_server_goes_on(server):
    before = _jobs(server)
    good = EXAMPLE.read_bytes()
    cases = [
        (b"this is not a picture", None, 415, "not an image"),
        (b"", None, 400, "empty"),
        (good + b"\0" * 120_000, None, 413, "--max-upload"),
        (png_header(2000, 2000), None, 413, "--max-pixels"),     # over this server's limit
        (png_header(30000, 30000), None, 413, "--max-pixels"),   # over Pillow's own bomb limit too
        (png_header(8, 8), None, 422, "at least 16x16"),
    ]
    for settings, status, words in [("{not json", 400, "not JSON"), ('["seed"]', 422, "JSON object"),
                                    ('{"seed": 1, "steps": 3}', 422, "unknown settings ['steps']"),
                                    ('{"seed": "one"}', 422, "settings.seed must be int"),
                                    ('{"seed": true}', 422, "settings.seed must be int"),
                                    ('{"seed": -1}', 422, "seed -1"),
                                    ('{"fov": 500}', 422, "field of view"),
                                    ('{"memory_policy": "fast"}', 422, "memory policy 'fast'"),
                                    ('{"texture_size": 3}', 422, "texture_size"),
                                    ('{"memory_budget": "lots"}', 422, "memory budget 'lots'"),
                                    ('{"num_views": 2}', 422, "settings.num_views: a number of views applies")]:
        cases.append((good, settings, status, words))
    with server.client() as client:
        for image, settings, status, words in cases:
            data = {"settings": settings} if settings is not None else {}
            response = client.post("/jobs", files={"image": ("x.png", image, "image/png")}, data=data)
            assert words in _one_line_error(response, status), (settings, response.text)
        # no image field, an unknown field, not multipart at all
        assert "no image" in _one_line_error(client.post("/jobs", files={"settings": (None, "{}")}), 400)
        assert "unknown form fields" in _one_line_error(
            client.post("/jobs", files={"image": ("x.png", good)}, data={"colour": "red"}), 400)
        assert "multipart" in _one_line_error(client.post("/jobs", json={"seed": 1}), 400)
        assert "several files were sent; this server's config (tiny) takes one image" in _one_line_error(  # views
            client.post("/jobs", files=[("views", ("a.png", good)), ("views", ("b.png", good))]), 400)
        # a body streamed without a length is cut off at the limit too
        def chunks():
            yield b"--b\r\nContent-Disposition: form-data; name=\"image\"; filename=\"x.png\"\r\n\r\n"
            for _ in range(40):
                yield b"\0" * 10_000
        response = client.post("/jobs", content=chunks(), headers={"content-type": "multipart/form-data; boundary=b"})
        assert "--max-upload" in _one_line_error(response, 413)
    assert _jobs(server) == before
    assert server.get("/health").json()["ready"]


def test_ids_that_are_not_ids_are_404_and_never_reach_a_path(server):
    with server.client() as client:
        for path in ("/jobs/..%2F..%2Fetc%2Fpasswd", "/jobs/%2E%2E%2Fetc%2Fpasswd/result.glb", "/jobs/../etc/passwd",
                     "/jobs/abc", "/jobs/" + "A" * 32, "/jobs/" + "0" * 32, "/jobs/" + "0" * 32 + "/run.json",
                     "/jobs/" + "0" * 31 + "g", "/nothing"):
            _one_line_error(client.get(path), 404)
            if path.startswith("/jobs/") and path.count("/") == 2:
                _one_line_error(client.delete(path), 404)
        assert "GET" in client.put("/health").headers.get("allow", "GET")
        assert client.put("/health").status_code == 405


def test_a_full_queue_is_429(tiny_cache, tmp_path):
    """--queue-size 1 on a server whose jobs run their full time: the worker takes one, one waits, the next is
    refused (or sooner)."""
    server = Server.start(tmp_path / "data", "--config", str(TINY_CONFIG), "--queue-size", "1")
    try:
        statuses, ids = [], []
        for seed in range(3):
            response = server.submit(EXAMPLE.read_bytes(), {"seed": seed})
            statuses.append(response.status_code)
            if response.status_code == 202:
                ids.append(response.json()["id"])
            else:
                assert "--queue-size" in _one_line_error(response, 429)
        assert 429 in statuses and len(ids) == statuses.count(202) >= 1, statuses
        assert len(_jobs(server)) == len(ids)  # a refused job leaves nothing behind
    finally:
        server.stop()


def test_a_job_past_its_time_ends_failed(server):
    """--job-timeout 0.001 (the module's server): the deadline passes before the job's first stage starts (the run
    opens its work dir and hashes its input first), so it is stopped there. A longer timeout is checked only at
    stages and sampler steps: on a quiet machine the tiny flows can finish inside 2 s and the job end done after its
    decode and export, so no longer timeout makes this check deterministic."""
    ids = [server.submit(EXAMPLE.read_bytes(), {"seed": seed}).json()["id"] for seed in range(2)]
    for job_id in ids:
        view = server.wait(job_id, timeout=120)
        assert view["status"] == "failed" and "--job-timeout" in view["error"], (json.dumps(view), server.tail())
    assert server.get("/health").json()["queue"] == 0


def test_a_non_loopback_host_is_refused_without_a_token(tmp_path, monkeypatch):
    monkeypatch.delenv("PIXAL3D_SERVE_TOKEN", raising=False)
    env = {k: v for k, v in os.environ.items() if k != "PIXAL3D_SERVE_TOKEN"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-m", "pipelines.serve", "--config", str(TINY_CONFIG), "--host", "0.0.0.0",
                           "--port", "0", "--data", str(tmp_path / "data")], capture_output=True, text=True, env=env,
                          timeout=120, cwd=REPO)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "--token-file" in lines[0] and "0.0.0.0" in lines[0], proc
    assert "serving" not in proc.stdout and not (tmp_path / "data").exists()
    # the rule itself: loopback addresses only without a token; a token from the environment or a file opens the rest
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.1.2.3")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2") and not is_loopback("example.com")
    with pytest.raises(UsageError, match="reachable from other machines"):
        check_args(parse_args(["--host", "::"]))
    monkeypatch.setenv("PIXAL3D_SERVE_TOKEN", TOKEN)
    assert check_args(parse_args(["--host", "0.0.0.0", "--devices", "cpu"]))[1] == TOKEN
    monkeypatch.setenv("PIXAL3D_SERVE_TOKEN", "short")
    with pytest.raises(UsageError, match="shorter than 16"):
        check_args(parse_args(["--host", "0.0.0.0"]))
    monkeypatch.delenv("PIXAL3D_SERVE_TOKEN")
    (tmp_path / "token").write_text(TOKEN)
    assert check_args(parse_args(["--host", "0.0.0.0", "--token-file", str(tmp_path / "token")]))[1] == TOKEN
    assert check_args(parse_args(["--devices", "cpu,cpu"]))[0] == ["cpu", "cpu"]
