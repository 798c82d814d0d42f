"""The HTTP API (FastAPI): ``/health``, ``/jobs`` and ``/generate`` over the queue (``service.Jobs``): every answer
comes from the queue's database, so any API process on one queue answers for any job.

Every error is a JSON body ``{"error": "<one line>"}`` with a status saying whose it is: 400 a malformed request
(settings that are not JSON too), 401 no or a wrong token, 404 no such job or endpoint, 409 not possible in the job's
state (yet), 410 a result that will never come (the job was cancelled or failed), 413 too large (bytes or pixels),
415 not an image, 422 settings that cannot be used, 429 the queue is full; 503 the queue's database cannot be
reached, 507 the data disk is full (nothing of the job is kept). Two ASGI layers run before any route reads the
request: the token check (nothing is read or created without it) and the body limit.
"""
from __future__ import annotations

import asyncio
import hmac
import io
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from PIL import Image, UnidentifiedImageError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from pixal3d.config import CascadeConfig
from pixal3d.models.preprocess import MIN_SIDE

from ..job import Job, SettingsError
from .db import ENDED, QueueError, QueueFull, QueueUnavailable, StorageFull
from .service import Jobs
from .store import DiskFull, check_id

ENVELOPE = 64 * 1024
"""Bytes a request may carry beyond the image: the multipart framing and the settings field."""
FILES = {"result.glb": "model/gltf-binary", "run.json": "application/json", "trace.jsonl": "application/x-ndjson"}


class Refused(Exception):
    """A request refused with ``status`` and a one-line ``message``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": " ".join(message.split())}, status_code=status, headers=headers)


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


def check_image(data: bytes, max_pixels: int) -> str:
    """The file suffix of the uploaded image's format, from its header only; ``Refused`` when it cannot be used."""
    if not data:
        raise Refused(400, "the image field is empty; send a PNG, JPEG or WebP file")
    try:
        with Image.open(io.BytesIO(data)) as image:
            size, kind = image.size, image.format
    except Image.DecompressionBombError:
        raise Refused(413, f"the image has more than {max_pixels} pixels (--max-pixels); send a smaller one") from None
    except UnidentifiedImageError:
        raise Refused(415, "the image field is not an image Pillow can read; send a PNG, JPEG or WebP file") from None
    except (OSError, SyntaxError, ValueError) as err:
        raise Refused(415, f"the image cannot be opened ({err}); re-export it as PNG") from None
    if size[0] * size[1] > max_pixels:
        raise Refused(413, f"the image is {size[0]}x{size[1]} pixels, more than {max_pixels} (--max-pixels); "
                           f"send a smaller one")
    if min(size) < MIN_SIDE:
        raise Refused(422, f"the image is {size[0]}x{size[1]} pixels; at least {MIN_SIDE}x{MIN_SIDE} is needed")
    return f".{(kind or 'img').lower()}"


def create_app(jobs: Jobs, config: CascadeConfig, *, token: str | None, max_upload: int, max_pixels: int,
               local: Any = None) -> FastAPI:
    """The API over ``jobs``, checking settings against ``config``; ``local``: this process's workers (a
    ``node.Node``, or None for ``--role api``), listed by ``/health`` as they are now."""
    app = FastAPI(title="pixal3d-serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(Refused)
    async def refused(request: Request, err: Refused) -> JSONResponse:
        return error(err.status, str(err))

    @app.exception_handler(QueueError)
    async def queue_error(request: Request, err: QueueError) -> JSONResponse:
        status = 507 if isinstance(err, StorageFull) else 503
        return error(status, str(err), {"Retry-After": "10"} if isinstance(err, QueueUnavailable) else None)

    @app.exception_handler(OSError)
    async def storage_error(request: Request, err: OSError) -> JSONResponse:
        if isinstance(err, DiskFull):
            return error(507, str(err.strerror))
        return error(503, f"the data folder cannot be used ({err.strerror or err}); retry later")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        text = "no such endpoint; see GET /health, POST /jobs, GET /jobs/{id}" if err.status_code == 404 else \
            str(err.detail)
        return error(err.status_code, text)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return error(400, f"malformed request: {err.errors()[0].get('msg', err)}")

    async def read_job(request: Request) -> tuple[bytes, str, dict[str, Any]]:
        """The image and settings of a ``POST /jobs`` or ``/generate``, checked."""
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise Refused(400, "send multipart/form-data with the image in field 'image' (and JSON in 'settings')")
        try:
            form = await request.form(max_files=1, max_fields=2)
        except Refused:
            raise
        except Exception as err:  # noqa: BLE001 - the multipart parser's own words, on one line
            raise Refused(400, f"the multipart body cannot be read ({err})") from None
        unknown = sorted(set(form.keys()) - {"image", "settings"})
        if unknown:
            raise Refused(400, f"unknown form fields {unknown}; send 'image' (a file) and 'settings' (JSON)")
        upload = form.get("image")
        if not isinstance(upload, UploadFile):
            raise Refused(400, "no image: send the image file in the multipart field 'image'")
        data = await upload.read()
        if len(data) > max_upload:
            raise Refused(413, f"the image is {len(data)} bytes, more than {max_upload} (--max-upload)")
        suffix = check_image(data, max_pixels)
        settings = form.get("settings")
        if isinstance(settings, UploadFile):
            settings = (await settings.read()).decode("utf-8", "replace")
        if isinstance(settings, str) and settings.strip():
            try:  # not JSON at all is a malformed request (400); JSON that is no usable settings is 422
                settings = json.loads(settings)
            except ValueError as err:
                raise Refused(400, f"settings is not JSON ({err}); send an object such as {{\"seed\": 42}}") from None
        try:
            values = Job.from_request(settings, config).settings()
        except SettingsError as err:
            raise Refused(422, str(err)) from None
        return data, suffix, values

    def submit(data: bytes, suffix: str, values: dict[str, Any]) -> Any:
        try:
            return jobs.submit(data, suffix, values)
        except QueueFull as err:
            raise Refused(429, str(err)) from None

    def view(job_id: str) -> dict[str, Any]:
        """The job's view; 404 when the id is not an id or no job has it (removed by retention, too)."""
        found = jobs.view(job_id) if check_id(job_id) is not None else None
        if found is None:
            shown = job_id if len(job_id) <= 40 else job_id[:40] + "..."
            raise Refused(404, f"no job {shown!r}; job ids are the 32 hex digits POST /jobs returned")
        return found

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {**jobs.health(None if local is None else local.health()), "config": config.name}

    @app.post("/jobs", status_code=202)
    async def post_job(request: Request) -> JSONResponse:
        job = await asyncio.to_thread(submit, *await read_job(request))
        return JSONResponse(jobs.view(job.id), status_code=202, headers={"Location": f"/jobs/{job.id}"})

    @app.get("/jobs/{job_id}")
    def get_job(job_id: str) -> dict[str, Any]:
        return view(job_id)

    @app.delete("/jobs/{job_id}")
    def delete_job(job_id: str) -> dict[str, Any]:
        view(job_id)
        status = jobs.cancel(job_id)
        if status in ENDED:
            raise Refused(409, f"job {job_id} has ended ({status}); there is nothing to cancel")
        return view(job_id)

    @app.get("/jobs/{job_id}/{name}")
    def get_file(job_id: str, name: str) -> FileResponse:
        job = view(job_id)
        if name not in FILES:
            raise Refused(404, f"no file {name[:40]!r}; a job has {', '.join(FILES)}")
        if job["status"] in ("queued", "running"):
            raise Refused(409, f"job {job_id} is {job['status']}; {name} comes when it is done")
        if job["status"] != "done":
            raise Refused(410, f"job {job_id} was {job['status']} ({job.get('error') or 'no reason given'}); it "
                               f"has no {name} and never will")
        path = jobs.data.file(job_id, name)
        if path is None:
            raise Refused(404, f"job {job_id} has no {name}")
        return FileResponse(path, media_type=FILES[name], filename=f"{job_id}.{name}" if name != "result.glb" else
                            f"{job_id}.glb")

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        job = await asyncio.to_thread(submit, *await read_job(request))
        while (found := await asyncio.to_thread(jobs.view, job.id))["status"] not in ENDED:
            await asyncio.sleep(0.1)
        if found["status"] != "done":
            return error(409 if found["status"] == "cancelled" else 422, found.get("error") or found["status"])
        return FileResponse(jobs.data.folder(job.id) / "result.glb", media_type=FILES["result.glb"],
                            headers={"X-Job-Id": job.id})

    app.add_middleware(BodyLimit, limit=max_upload + ENVELOPE)
    if token is not None:
        app.add_middleware(TokenCheck, token=token)
    return app
