"""The Gradio page: the memory plan across the top; inputs and downloads on the left; progress, the live memory
plot and the 3D viewer on the right; the per-stage table below. The only module of the app that imports Gradio.

Runs share one queue with a concurrency of 1 (``concurrency_id="models"``): a second visitor's job waits
and the page shows its place in the queue. Showing the plan reads only file headers, so it has its own
unlimited queue and answers while a job runs.
"""
from __future__ import annotations

import inspect
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gradio as gr

from pixal3d.config import CascadeConfig
from pixal3d.telemetry.plot import trace_figure

from ..camera import CameraStage
from ..errors import error_line
from ..inputs import (
    InputKind,
    Uploaded,
    UploadField,
    kind_for,
    request_kind,
    request_kinds,
    upload_fields,
)
from ..inputs.kind import IMAGE_FILE, JSON_FILE, NUMBER, TEXT
from ..job import BY_NAME, SETTINGS, Job, Setting
from ..result import STAGE_COLUMNS
from ..session import Session
from .job import REFUSAL, JobUpdate, Upload, plan_or_refusal, run_job

ASSETS = Path(__file__).resolve().parents[2] / "assets"
DEFAULT_FOV = 49.1  # the reference's fallback field of view, the slider's starting point
NO_ESTIMATOR = ("automatic field of view: not with this config (it names no MoGe-2 weights, or it fixes "
                "camera.fov_deg): set it on the slider")
PLOT_EVERY = 1.0  # seconds between redraws of the memory plot: drawing takes CPU from the run
CSS = "#plan pre, #plan code { font-size: 12px; }"  # the plan's reason lines are long: small, full width
IMAGE_HEIGHT, IMAGES_HEIGHT, FILE_HEIGHT = 300, 200, 100  # the upload widgets' heights (pixels)


def build_ui(session: Session, config: CascadeConfig, *, outputs: Path, poll: float = 0.5) -> gr.Blocks:
    """The page running jobs on ``config`` in ``session``; job files go under ``outputs``. The form has the fields
    of every upload the config takes (``upload_fields``: its kind's, then the optional fields of a kind that goes
    with it, such as a mesh to texture with the image), then one per job setting that applies to one of those kinds
    (``pipelines.job.SETTINGS``), its values read back by ``Job.from_form`` for the kind the form's upload is
    (``request_kind``)."""
    kind = kind_for(config)
    kinds = request_kinds(config)
    uploads = upload_fields(config)
    with gr.Blocks(title="Pixal3D, staged", analytics_enabled=False, delete_cache=(3600, 3600)) as page:
        gr.Markdown(kind.upload_title)
        plan = gr.Markdown(label="memory plan", elem_id="plan")  # full width: the plan's lines are long
        with gr.Row():
            with gr.Column(scale=2, min_width=320):
                sources = [_upload_field(field) for field in uploads]
                fields, fov_auto = _setting_fields(config, kinds)
                run = gr.Button("Generate", variant="primary", elem_id="run")
                files = gr.File(label="downloads: GLB, run.json, memory trace", file_count="multiple",
                                interactive=False, elem_id="downloads")
            with gr.Column(scale=3, min_width=480):
                status = gr.Markdown(kind.upload_prompt, elem_id="status")
                plot = gr.Plot(label="memory", elem_id="memory", format="png")
                viewer = gr.Model3D(label="model", elem_id="viewer", height=360,
                                    clear_color=(0.95, 0.95, 0.95, 1.0))
        table = gr.Dataframe(headers=list(STAGE_COLUMNS), label="per stage", interactive=False, elem_id="stages")
        model = gr.State(None)  # the finished job's GLB, handed to the viewer by a second event (see below)
        extras = {} if fov_auto is None else {"fov_auto": fov_auto}  # the inputs beside the settings' fields
        planned = [s.name for s in SETTINGS if s.plans]

        def show_plan(*values: Any) -> str:
            try:
                job = Job.from_form(dict(zip(planned, values, strict=True)), config)
            except Exception as err:  # noqa: BLE001 - a bad setting is the visitor's, shown on one line
                return f"**{REFUSAL}{error_line(err)}**"
            text = plan_or_refusal(session, job)
            return f"**{text}**" if text.startswith(REFUSAL) else _plan_markdown(text)

        def run_form(uploaded: tuple, extra: tuple, progress: Any, values: tuple) -> Iterator[tuple]:
            form = dict(zip(fields, values, strict=True))
            if extra and extra[0]:  # "automatic field of view": the setting unset
                form["fov"] = None
            given = {f.name: _uploaded(f, v) for f, v in zip(uploads, uploaded, strict=True)}
            ran = request_kind(config, [name for name, value in given.items() if _given(value)])
            upload = Upload({f.name: given[f.name] for f in ran.upload})
            yield from _stream(form, config, progress,
                               lambda job: run_job(session, upload, job, outputs=outputs, poll=poll), ran)

        settings_inputs = [fields[name] for name in planned]
        page.load(show_plan, settings_inputs, plan, concurrency_limit=None, concurrency_id="plan")
        for component in settings_inputs:
            component.change(show_plan, settings_inputs, plan, concurrency_limit=None, concurrency_id="plan")
        if fov_auto is not None:
            fov_auto.change(lambda auto: gr.Slider(interactive=not auto), fov_auto, fields["fov"], queue=False)
        # The viewer gets its model from a plain event after the streaming one: Gradio 6.31's Model3D drops a
        # model set by a generator (the closing message sets the value again and cancels the viewer's loading).
        run.click(lambda: None, None, viewer, queue=False).then(
            _handler(uploads, list(extras), run_form), [*sources, *extras.values(), *fields.values()],
            [status, plot, model, files, table, plan], concurrency_limit=1, concurrency_id="models",
            show_progress_on=[status]).then(lambda path: path, model, viewer, queue=False)
    return page


def _handler(uploads: tuple[UploadField, ...], extras: list[str], run_form: Any) -> Any:
    """The Generate button's handler, ``on_run(<the upload's fields>, <the extras>, progress, *settings)``.
    Gradio hands its progress tracker to the parameter whose default is a ``gr.Progress`` (it reads the signature),
    so the signature names the upload's fields before it: one handler for every kind of input."""
    count = len(uploads)

    def on_run(*args: Any) -> Iterator[tuple]:
        head = count + len(extras)
        yield from run_form(args[:count], args[count:head], args[head], args[head + 1:])

    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    on_run.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(f"{field.name}_", positional) for field in uploads]
        + [inspect.Parameter(f"{name}_", positional) for name in extras]
        + [inspect.Parameter("progress", positional, default=gr.Progress()),
           inspect.Parameter("values", inspect.Parameter.VAR_POSITIONAL)])
    return on_run


def _stream(form: dict[str, Any], config: CascadeConfig, progress: Any, start: Any, kind: InputKind) -> Iterator[tuple]:
    """The job's updates as the page's outputs: cleared first, then the plot while it runs (Gradio's bar says the
    stage), then the outcome. ``kind``: the kind of input the form's upload is (its settings checked for it)."""
    yield "", gr.skip(), None, None, None, gr.skip()  # clear the last job's outputs
    try:
        job = Job.from_form(form, config, input_kind=kind.name)
    except Exception as err:  # noqa: BLE001 - a bad setting is the visitor's, shown on one line
        yield _status(f"error: {error_line(err)}"), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
        return
    drawn, drawn_at = 0, 0.0
    for update in start(job):
        figure = gr.skip()
        if update.records and len(update.records) != drawn and (
                update.done or time.monotonic() - drawn_at >= PLOT_EVERY):
            figure, drawn, drawn_at = _figure(update), len(update.records), time.monotonic()
        if update.done:
            yield _final(update, figure)
            continue
        # One progress text while it runs: Gradio's bar over the status line says the stage; the status
        # line itself is written again only with the outcome (two texts, updated apart, disagreed).
        progress(update.fraction, desc=update.status)
        yield (gr.skip(), figure, gr.skip(), gr.skip(), gr.skip(),
               _plan_markdown(update.plan) if update.plan else gr.skip())


def _upload_field(field: UploadField) -> Any:
    """The form's element for one field of the kind's upload, by what it accepts (one image: Gradio's image widget,
    handing over the file itself; several images or another file: a file box; text and numbers), with its
    example (one file: Gradio's examples; several: a button that takes them)."""
    common = {"label": field.label, "elem_id": field.form}
    if field.accepts == TEXT:
        return gr.Textbox(value=field.default, **common)
    if field.accepts == NUMBER:
        return gr.Number(value=field.default, **common)
    several = field.most > 1
    if field.accepts == IMAGE_FILE and not several:
        box = _lenient(gr.Image(type="filepath", image_mode=None, format="png", sources=["upload", "clipboard"],
                                height=IMAGE_HEIGHT, **common))
    else:
        types = {IMAGE_FILE: [IMAGE_FILE], JSON_FILE: [".json"]}.get(field.accepts)  # Gradio's words for them
        box = gr.File(file_count="multiple" if several else "single", file_types=types, type="filepath",
                      height=IMAGES_HEIGHT if several and field.accepts == IMAGE_FILE else FILE_HEIGHT, **common)
    if field.example is not None and several:
        take = gr.Button(f"take the example {field.name}", elem_id=f"example-{field.form}", size="sm")
        take.click(lambda: [str(p) for p in sorted(ASSETS.glob(field.example))], None, box, queue=False)
    elif field.example is not None:
        gr.Examples([[str(ASSETS / field.example)]], inputs=[box], label="example")
    return box


def _uploaded(field: UploadField, value: Any) -> Any:
    """A form value as the kind's ``receive`` takes it: a file field's files as ``Uploaded`` (where Gradio keeps
    them), a text or a number as it is."""
    if not field.file:
        return value
    paths = value if isinstance(value, (list, tuple)) else [] if value is None else [value]
    return tuple(Uploaded(Path(p).name, path=Path(p)) for p in paths)


def _given(value: Any) -> bool:
    """A form value given: a file field's files, or a text or number (an empty text: not given)."""
    return bool(value) if isinstance(value, (tuple, str)) else value is not None


def _setting_fields(config: CascadeConfig, kinds: tuple[InputKind, ...]) -> tuple[dict[str, Any], Any]:
    """One field per job setting (``gr.State(None)`` for one that applies to none of ``kinds``: always unset), and
    the field of view's "automatic" checkbox beside its slider (None where the field of view does not apply)."""
    fields: dict[str, Any] = {}
    fov_auto = None
    for setting in SETTINGS:
        if not any(setting.applies_to(kind) for kind in kinds):
            fields[setting.name] = gr.State(None)
        elif setting.name == "fov":  # "automatic" (MoGe-2, or the config's) beside the slider
            fov_auto, fields["fov"] = _fov_fields(config)
        else:
            fields[setting.name] = _field(setting, config)
    return fields, fov_auto


def _field(setting: Setting, config: CascadeConfig) -> Any:
    """The form's field for ``setting`` by its kind, showing the value an unset one has (the config's, or the
    default); its element id is the setting's form name."""
    value = setting.config(config) if setting.config is not None else setting.default
    common = {"label": setting.label, "elem_id": setting.form}
    if setting.kind == "flag":
        return gr.Checkbox(value=bool(value), **common)
    if setting.kind == "choice":
        return gr.Dropdown(list(setting.choices()), value=value, **common)
    if setting.suggested:  # a number with usual values: offered, with the config's among them
        # as text: Gradio's API (gradio_client) offers a dropdown's choices as strings and refused "256" against
        # the number 256; the job reads the text as the setting's kind (``Job.from_form``)
        offered = [str(number) for number in sorted({*setting.suggested, value})]
        return gr.Dropdown(offered, value=str(value), **common)
    if setting.kind in ("int", "float"):
        return gr.Number(value=value, precision=0 if setting.kind == "int" else None, **common)
    return gr.Textbox(value="" if value is None else str(value), placeholder="auto", **common)


def _fov_fields(config: CascadeConfig) -> tuple[Any, Any]:
    """The "automatic field of view" checkbox (off and greyed out, saying why, where the config cannot estimate
    one) and the slider."""
    estimates = CameraStage.from_config(config).use_moge  # else "automatic" would be 49.1° as is
    with gr.Row():
        auto = gr.Checkbox(value=estimates, interactive=estimates, elem_id="fov-auto",
                           label="automatic field of view" if estimates else NO_ESTIMATOR)
        slider = gr.Slider(10, 120, value=config.camera.fov_deg or DEFAULT_FOV, step=0.1, label=BY_NAME["fov"].label,
                           interactive=not estimates, elem_id=BY_NAME["fov"].form)
    return auto, slider


def _lenient(image: gr.Image) -> gr.Image:
    """``image`` handing the job the uploaded file itself (its cached path), never an image Gradio decoded: the job
    checks it as the command does (not an image, too small, too large to decode, a decompression bomb) and the page
    shows the library's one-line ``ImageError`` in the status line, instead of Gradio's preprocessing error, which
    came first for a 20000² PNG (Pillow's ``DecompressionBombError`` is neither an ``OSError`` nor a ``ValueError``).
    (On the instance: a subclass of a Gradio component writes a ``.pyi`` stub beside its source file when it is
    defined.)"""

    def the_file(payload: Any) -> str | None:
        return None if payload is None else str(payload.path)  # what Gradio returns too (type="filepath")

    image.preprocess = the_file
    return image


def _final(update: JobUpdate, figure: Any) -> tuple:
    plan = _plan_markdown(update.plan) if update.plan else gr.skip()
    if update.outputs is None:
        return _status(update.status), figure, None, None, None, plan
    out = update.outputs
    return (_status(update.status), figure, str(out.glb), [str(out.glb), str(out.record), str(out.trace)],
            out.table, plan)


def _figure(update: JobUpdate) -> Any:
    return trace_figure([("memory while it runs", update.records)], width=8.0, panel_height=3.2)


def _plan_markdown(table: str) -> str:
    return f"```text\n{table}\n```"


def _status(text: str) -> str:
    return f"**{text}**" if text.startswith("error:") else text

