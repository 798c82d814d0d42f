"""The HTTP API (FastAPI): the routes (``routes.py``: ``/health``, ``/jobs``, ``/generate``) over the queue
(``service.Jobs``), the error handlers and two ASGI layers.

Every error is a JSON body ``{"error": "<one line>"}`` with a status saying whose it is: 400 a malformed request
(settings that are not JSON too), 401 no or a wrong token, 404 no such job or endpoint, 409 not possible in the job's
state (yet), 410 a result that will never come (the job was cancelled or failed), 413 too large (bytes or pixels),
415 not an image, 422 settings that cannot be used, 429 the queue is full; 503 the queue's database cannot be
reached, 507 the data disk is full (nothing of the job is kept). Two ASGI layers run before any route reads the
request: the token check (nothing is read or created without it) and the body limit.
"""
from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pixal3d.config import CascadeConfig

from .db import QueueError, QueueUnavailable, StorageFull
from .routes import Refused, Served, error, router
from .service import Jobs
from .store import DiskFull

ENVELOPE = 64 * 1024
"""Bytes a request may carry beyond the image: the multipart framing and the settings field."""


def create_app(jobs: Jobs, config: CascadeConfig, *, token: str | None, max_upload: int, max_pixels: int,
               local: Any = None) -> FastAPI:
    """The API over ``jobs`` (its routes: ``routes.router``), checking settings against ``config``; ``local``: this
    process's workers (a ``node.Node``, or None for ``--role api``), listed by ``/health`` as they are now."""
    app = FastAPI(title="pixal3d-serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = Served(jobs, config, max_upload, max_pixels, local)
    for kind, handler in ((Refused, refused), (QueueError, queue_error), (OSError, storage_error),
                          (StarletteHTTPException, http_error), (RequestValidationError, invalid)):
        app.add_exception_handler(kind, handler)
    app.include_router(router)
    app.add_middleware(BodyLimit, limit=max_upload + ENVELOPE)
    if token is not None:
        app.add_middleware(TokenCheck, token=token)
    return app


# -- every error a JSON body with one line ----------------------------------------------------------
async def refused(request: Request, err: Refused) -> JSONResponse:
    return error(err.status, str(err))


async def queue_error(request: Request, err: QueueError) -> JSONResponse:
    status = 507 if isinstance(err, StorageFull) else 503
    return error(status, str(err), {"Retry-After": "10"} if isinstance(err, QueueUnavailable) else None)


async def storage_error(request: Request, err: OSError) -> JSONResponse:
    if isinstance(err, DiskFull):
        return error(507, str(err.strerror))
    return error(503, f"the data folder cannot be used ({err.strerror or err}); retry later")


async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    text = "no such endpoint; see GET /health, POST /jobs, GET /jobs/{id}" if err.status_code == 404 else \
        str(err.detail)
    return error(err.status_code, text)


async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
    return error(400, f"malformed request: {err.errors()[0].get('msg', err)}")


# -- the two ASGI layers -------------------------------------------------------------------------------
class TokenCheck:
    """ASGI layer: every request needs ``Authorization: Bearer <token>`` (compared in constant time), else 401."""

    def __init__(self, app: Any, token: str):
        self.app, self.token = app, f"Bearer {token}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.token):
                why = "a wrong token" if given else "no token"
                response = error(401, f"this server needs Authorization: Bearer <token> ({why} was sent)",
                                 {"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI layer: a request body over ``limit`` bytes is refused with 413, by its Content-Length or as it streams."""

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise Refused(413, self._message())
            return message

        await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"the request is larger than {self.limit - ENVELOPE} bytes of image (--max-upload)"

    async def _refuse(self, scope: dict, receive: Any, send: Any) -> None:
        await error(413, self._message())(scope, receive, send)
