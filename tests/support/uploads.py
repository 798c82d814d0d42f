"""A server's parser and service without a server process: a multipart request as starlette builds it, and the
served state (queue, data folder) routes read (tests of the upload table and of the mesh kind's uploads)."""
from __future__ import annotations

from pathlib import Path


def request_of(files: list, data: dict | None = None):
    """A starlette request carrying the multipart body httpx makes of ``files`` and ``data``."""
    import httpx
    from starlette.requests import Request

    built = httpx.Request("POST", "http://test/jobs", files=files, data=data)
    body = built.read()

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/jobs", "query_string": b"",
             "headers": [(b"content-type", built.headers["content-type"].encode())]}
    return Request(scope, receive)


def served_app(config, root: Path):
    from pipelines.serve.db import open_queue
    from pipelines.serve.routes import Served
    from pipelines.serve.service import Jobs
    from pipelines.serve.store import DataFolder

    data = DataFolder(root)
    return Served(jobs=Jobs(open_queue(None, data.root), data, queue_size=8, keep_seconds=None), config=config,
                  max_upload=1_000_000, max_pixels=10_000_000)
