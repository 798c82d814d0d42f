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
from pixal3d.models.preprocess import MIN_SIDE
from pixal3d.models.views import MAX_VIEWS, RIG_FOV_DEG, ViewsError, write_views

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
@dataclass(frozen=True)
class Upload:
    """What a submission carries: one image (``data``, its ``suffix``), or on a multi-view config the views (file
    names and bytes, the main view first) with their ``transforms.json`` or their azimuths and field of view
    (``pixal3d.models.views.write_views``)."""

    data: bytes = b""
    suffix: str = ""
    views: tuple[tuple[str, bytes], ...] = ()
    transforms: bytes | None = None
    azimuths: str | None = None
    views_fov: float = RIG_FOV_DEG


FIELDS = ("image", "settings")
VIEW_FIELDS = ("views", "transforms", "azimuths", "views_fov", "settings")
ONE_IMAGE = ("this server's config ({config}) takes one image in the field 'image'; posed views need a server on a "
             "multi-view config (pixal3d-serve --config 1024_cascade_mv)")
VIEWS_ASK = ("send each view image in a multipart field 'views' (the main view first), with 'azimuths' (degrees, "
             "default 0,90,180,270 for four views) or a 'transforms' file (transforms.json)")


async def read_job(request: Request, here: Served) -> tuple[Upload, dict[str, Any]]:
    """The image (or views) and settings of a ``POST /jobs`` or ``/generate``, checked."""
    takes_views = here.config.views is not None
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise Refused(400, f"send multipart/form-data: {VIEWS_ASK}" if takes_views else
                      "send multipart/form-data with the image in field 'image' (and JSON in 'settings')")
    try:
        form = await request.form(max_files=MAX_VIEWS + 1 if takes_views else 1,
                                  max_fields=len(VIEW_FIELDS) if takes_views else 2)
    except Refused:
        raise
    except Exception as err:  # noqa: BLE001 - the multipart parser's own words, on one line
        if not takes_views and "Too many files" in str(err):
            raise Refused(400, f"several files were sent; {ONE_IMAGE.format(config=here.config.name)}") from None
        raise Refused(400, f"the multipart body cannot be read ({err})") from None
    if takes_views and "image" in form:
        raise Refused(400, f"this server's config ({here.config.name}) takes posed views, not one image: {VIEWS_ASK}")
    if not takes_views and "views" in form:
        raise Refused(400, ONE_IMAGE.format(config=here.config.name))
    allowed = VIEW_FIELDS if takes_views else FIELDS
    unknown = sorted(set(form.keys()) - set(allowed))
    if unknown:
        raise Refused(400, f"unknown form fields {unknown}; send {', '.join(repr(f) for f in allowed)}")
    upload = await (_read_views(form, here) if takes_views else _read_image(form, here))
    settings = form.get("settings")
    if isinstance(settings, UploadFile):
        settings = (await settings.read()).decode("utf-8", "replace")
    if isinstance(settings, str) and settings.strip():
        try:  # not JSON at all is a malformed request (400); JSON that is no usable settings is 422
            settings = json.loads(settings)
        except ValueError as err:
            raise Refused(400, f"settings is not JSON ({err}); send an object such as {{\"seed\": 42}}") from None
    try:
        values = Job.from_request(settings, here.config).settings()
    except SettingsError as err:
        raise Refused(422, str(err)) from None
    return upload, values


async def _read_image(form: Any, here: Served) -> Upload:
    upload = form.get("image")
    if not isinstance(upload, UploadFile):
        raise Refused(400, "no image: send the image file in the multipart field 'image'")
    data = await upload.read()
    if len(data) > here.max_upload:
        raise Refused(413, f"the image is {len(data)} bytes, more than {here.max_upload} (--max-upload)")
    return Upload(data, check_image(data, here.max_pixels))


async def _read_views(form: Any, here: Served) -> Upload:
    """The views of a multi-view server's submission: every 'views' file an image (as 'image' is checked), their
    bytes together within --max-upload; a 'transforms' file, or 'azimuths' (and 'views_fov') as text."""
    files = form.getlist("views")
    if not files:
        raise Refused(400, f"no views: {VIEWS_ASK}")
    if not all(isinstance(f, UploadFile) for f in files):
        raise Refused(400, "each 'views' field must be a file (an image)")
    views, total = [], 0
    for index, file in enumerate(files):
        data = await file.read()
        total += len(data)
        if total > here.max_upload:
            raise Refused(413, f"the views are more than {here.max_upload} bytes together (--max-upload)")
        try:
            check_image(data, here.max_pixels)
        except Refused as err:
            raise Refused(err.status, f"view {index} ({(file.filename or '?')[:40]}): {err}") from None
        views.append((file.filename or f"view{index:02d}.png", data))
    transforms = form.get("transforms")
    if transforms is not None and not isinstance(transforms, UploadFile):
        transforms = transforms.encode("utf-8")  # sent as text
    elif transforms is not None:
        transforms = await transforms.read()
    azimuths, fov = form.get("azimuths"), form.get("views_fov")
    if transforms is not None and (azimuths is not None or fov is not None):
        raise Refused(400, "send 'transforms' or 'azimuths'/'views_fov', not both: transforms.json gives the cameras")
    if isinstance(azimuths, UploadFile) or isinstance(fov, UploadFile):
        raise Refused(400, "'azimuths' and 'views_fov' are text fields (degrees), not files")
    try:
        views_fov = RIG_FOV_DEG if fov is None or not fov.strip() else float(fov)
    except ValueError:
        raise Refused(422, f"views_fov {fov[:40]!r} is not a number of degrees; the rig's is {RIG_FOV_DEG:g}") from None
    return Upload(views=tuple(views), transforms=transforms, azimuths=azimuths, views_fov=views_fov)


def submit(here: Served, upload: Upload, values: dict[str, Any]) -> Any:
    try:
        if not upload.views:
            return here.jobs.submit(upload.data, upload.suffix, values)
        return here.jobs.submit_views(lambda folder: write_views(
            folder, upload.views, transforms=upload.transforms, azimuths=upload.azimuths, fov_deg=upload.views_fov),
            values)
    except QueueFull as err:
        raise Refused(429, str(err)) from None
    except ViewsError as err:
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
