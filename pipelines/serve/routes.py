"""The job server's routes, each a function of its request: ``GET /health``, ``POST /jobs``, ``GET /jobs/{id}``,
``DELETE /jobs/{id}``, ``GET /jobs/{id}/{file}``, ``POST /generate``. What they serve is the app's ``state.served``
(``Served``: the queue, the config settings are checked against, the limits, this process's workers), set by
``app.create_app``; every answer comes from the queue's database, so any API process on one queue answers for any
job. A refusal is ``Refused(status, one line)``, which ``app.py`` turns into the JSON error body.
"""
from __future__ import annotations

import asyncio
import io
import json
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse
from PIL import Image, UnidentifiedImageError
from starlette.datastructures import UploadFile

from pixal3d.config import CascadeConfig
from pixal3d.models.preprocess import MIN_SIDE, ImageError

from ..inputs import (
    InputKind,
    Uploaded,
    UploadField,
    kind_for,
    request_kind,
    upload_fields,
    upload_kind,
)
from ..inputs.kind import IMAGE_FILE, JSON_FILE
from ..job import Job, SettingsError
from .db import ENDED, QueueFull
from .service import Jobs
from .store import check_id

FILES = {"result.glb": "model/gltf-binary", "run.json": "application/json", "trace.jsonl": "application/x-ndjson"}

router = APIRouter()


class Refused(Exception):
    """A request refused with ``status`` and a one-line ``message``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The body of every error: ``{"error": "<one line>"}``."""
    return JSONResponse({"error": " ".join(message.split())}, status_code=status, headers=headers)


@dataclass(frozen=True)
class Served:
    """What the routes serve: the queue (``service.Jobs``), the config jobs' settings are checked against, the
    upload limits, and this process's workers (a ``node.Node``, listed by ``/health``; None for ``--role api``)."""

    jobs: Jobs
    config: CascadeConfig
    max_upload: int
    max_pixels: int
    local: Any = None


def served(request: Request) -> Served:
    """What the app of ``request`` serves (``app.create_app``)."""
    return request.app.state.served


# -- the routes ------------------------------------------------------------------------------------------
@router.get("/health")
def health(request: Request) -> dict[str, Any]:
    here = served(request)
    return {**here.jobs.health(None if here.local is None else here.local.health()), "config": here.config.name}


@router.post("/jobs", status_code=202)
async def post_job(request: Request) -> JSONResponse:
    here = served(request)
    job = await asyncio.to_thread(submit, here, *await read_job(request, here))
    return JSONResponse(here.jobs.view(job.id), status_code=202, headers={"Location": f"/jobs/{job.id}"})


@router.get("/jobs/{job_id}")
def get_job(job_id: str, request: Request) -> dict[str, Any]:
    return view(served(request), job_id)


@router.delete("/jobs/{job_id}")
def delete_job(job_id: str, request: Request) -> dict[str, Any]:
    here = served(request)
    view(here, job_id)
    status = here.jobs.cancel(job_id)
    if status in ENDED:
        raise Refused(409, f"job {job_id} has ended ({status}); there is nothing to cancel")
    return view(here, job_id)


@router.get("/jobs/{job_id}/{name}")
def get_file(job_id: str, name: str, request: Request) -> FileResponse:
    here = served(request)
    job = view(here, job_id)
    if name not in FILES:
        raise Refused(404, f"no file {name[:40]!r}; a job has {', '.join(FILES)}")
    if job["status"] in ("queued", "running"):
        raise Refused(409, f"job {job_id} is {job['status']}; {name} comes when it is done")
    if job["status"] != "done":
        raise Refused(410, f"job {job_id} was {job['status']} ({job.get('error') or 'no reason given'}); it "
                           f"has no {name} and never will")
    path = here.jobs.data.file(job_id, name)
    if path is None:
        raise Refused(404, f"job {job_id} has no {name}")
    return FileResponse(path, media_type=FILES[name], filename=f"{job_id}.{name}" if name != "result.glb" else
                        f"{job_id}.glb")


@router.post("/generate")
async def generate(request: Request) -> Any:
    here = served(request)
    job = await asyncio.to_thread(submit, here, *await read_job(request, here))
    while (found := await asyncio.to_thread(here.jobs.view, job.id))["status"] not in ENDED:
        await asyncio.sleep(0.1)
    if found["status"] != "done":
        return error(409 if found["status"] == "cancelled" else 422, found.get("error") or found["status"])
    return FileResponse(here.jobs.data.folder(job.id) / "result.glb", media_type=FILES["result.glb"],
                        headers={"X-Job-Id": job.id})


# -- what they share -----------------------------------------------------------------------------------
async def read_job(request: Request, here: Served) -> tuple[dict[str, Any], dict[str, Any]]:
    """The upload and settings of a ``POST /jobs`` or ``/generate``, checked. The upload is the fields of the kind of
    input the request carries among those the config takes (``request_kind``: the config's own, or one that goes
    with it, such as an image with a mesh), as its ``InputKind.upload`` says (field name → its ``Uploaded`` files,
    or its text), each read and checked as its field says (an image from its header); a field of another kind's
    upload is refused in that kind's words; the settings are that kind's."""
    kind = kind_for(here.config)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise Refused(400, kind.request_help)
    fields = upload_fields(here.config)
    most = sum(field.most for field in fields if field.file)
    try:
        form = await request.form(max_files=most, max_fields=len(fields) + 1)
    except Refused:
        raise
    except Exception as err:  # noqa: BLE001 - the multipart parser's own words, on one line
        if all(field.most == 1 for field in fields if field.file) and "Too many files" in str(err):
            raise Refused(400, f"several files were sent; {kind.refuse_upload(here.config, None)}") from None
        raise Refused(400, f"the multipart body cannot be read ({err})") from None
    kind = request_kind(here.config, set(form.keys()))
    fields = kind.upload
    sent = sum(isinstance(value, UploadFile) for name, value in form.multi_items() if name != "settings")
    if sent > sum(field.most for field in fields if field.file):
        raise Refused(400, f"several files were sent; {kind.refuse_upload(here.config, None)}")
    other = upload_kind(set(form.keys()), kind)
    if other is not None:
        raise Refused(400, kind.refuse_upload(here.config, other))
    allowed = (*(field.name for field in fields), "settings")
    unknown = sorted(set(form.keys()) - set(allowed))
    if unknown:
        raise Refused(400, f"unknown form fields {unknown}; send {', '.join(repr(f) for f in allowed)}")
    parts = {field.name: await _read_files(form, field, here) if field.file else form.get(field.name)
             for field in fields}
    refusal = kind.refuse_request(parts)
    if refusal is not None:
        raise Refused(400, refusal)
    _check_texts(parts, [field for field in fields if not field.file])
    return parts, await _read_settings(form, here, kind)


async def _read_files(form: Any, field: UploadField, here: Served) -> tuple[Uploaded, ...]:
    """The files of one file field: each within --max-upload (a field's files together), an image checked from its
    header (one of several named in the refusal: ``view 1 (b.png): ...``); a ``json`` field's text taken as its
    file."""
    sent = form.getlist(field.name) if field.most > 1 else [p for p in [form.get(field.name)] if p is not None]
    if not sent and field.required:
        raise Refused(400, f"no {field.name}: {field.ask}")
    if field.accepts != JSON_FILE and not all(isinstance(part, UploadFile) for part in sent):
        raise Refused(400, f"no {field.name}: {field.ask}" if field.most == 1 else
                      f"each '{field.name}' field must be a file{' (an image)' if field.accepts == IMAGE_FILE else ''}")
    files, total = [], 0
    for index, part in enumerate(sent):
        data = await part.read() if isinstance(part, UploadFile) else part.encode("utf-8")  # a json field's text
        total += len(data)
        if total > here.max_upload:
            raise Refused(413, f"the {field.name} is {len(data)} bytes, more than {here.max_upload} (--max-upload)"
                          if field.most == 1 else
                          f"the {field.name} are more than {here.max_upload} bytes together (--max-upload)")
        filename = (part.filename if isinstance(part, UploadFile) else None) or ""
        suffix = ""
        if field.accepts == IMAGE_FILE:
            try:
                suffix = check_image(data, here.max_pixels)
            except Refused as err:
                if field.most == 1:
                    raise
                raise Refused(err.status, f"{field.item} {index} ({(filename or '?')[:40]}): {err}") from None
        files.append(Uploaded(filename or f"{field.item or field.name}{index:02d}{suffix}", data, suffix=suffix))
    return tuple(files)


def _check_texts(parts: dict[str, Any], texts: list[UploadField]) -> None:
    """The text fields are text, not files (one refusal naming them all, with their unit when they share one)."""
    if any(isinstance(parts[field.name], UploadFile) for field in texts):
        units = {field.unit for field in texts}
        unit = f" ({units.pop()})" if len(units) == 1 and "" not in units else ""
        several = len(texts) > 1
        raise Refused(400, f"{' and '.join(repr(field.name) for field in texts)} "
                           f"{'are text fields' if several else 'is a text field'}{unit}, not {'files' if several else 'a file'}")


async def _read_settings(form: Any, here: Served, kind: InputKind) -> dict[str, Any]:
    """The 'settings' field (JSON text, or a file of it) as the settings of a job of ``kind`` (``Job.from_request``:
    a setting of another kind's refused in ``kind``'s words)."""
    settings = form.get("settings")
    if isinstance(settings, UploadFile):
        settings = (await settings.read()).decode("utf-8", "replace")
    if isinstance(settings, str) and settings.strip():
        try:  # not JSON at all is a malformed request (400); JSON that is no usable settings is 422
            settings = json.loads(settings)
        except ValueError as err:
            raise Refused(400, f"settings is not JSON ({err}); send an object such as {{\"seed\": 42}}") from None
    try:
        return Job.from_request(settings, here.config, input_kind=kind.name).settings()
    except SettingsError as err:
        raise Refused(422, str(err)) from None


def submit(here: Served, parts: dict[str, Any], values: dict[str, Any]) -> Any:
    """Queue the job: the kind whose upload ``parts`` are (``request_kind``, as ``read_job`` read them) writes it in
    the job's new folder and checks it (``InputKind.receive``: an ``ImageError`` is 422, nothing kept); a kind not
    the config's own is recorded with the job, so that its worker runs it as that kind."""
    kind = request_kind(here.config, parts)
    options = {name: values.get(name) for name in kind.options}
    other = None if kind is kind_for(here.config) else kind
    try:
        return here.jobs.submit_upload(lambda folder: kind.receive(parts, folder, options), values, kind=other)
    except QueueFull as err:
        raise Refused(429, str(err)) from None
    except ImageError as err:
        raise Refused(422, str(err)) from None


def view(here: Served, job_id: str) -> dict[str, Any]:
    """The job's view; 404 when the id is not an id or no job has it (removed by retention, too)."""
    found = here.jobs.view(job_id) if check_id(job_id) is not None else None
    if found is None:
        shown = job_id if len(job_id) <= 40 else job_id[:40] + "..."
        raise Refused(404, f"no job {shown!r}; job ids are the 32 hex digits POST /jobs returned")
    return found


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
