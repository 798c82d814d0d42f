"""The Gradio page: the memory plan across the top; inputs and downloads on the left; progress, the live memory
plot and the 3D viewer on the right; the per-stage table below. The only module of the app that imports Gradio.

Runs share one queue with a concurrency of 1 (``concurrency_id="models"``): a second visitor's job waits
and the page shows its place in the queue. Showing the plan reads only file headers, so it has its own
unlimited queue and answers while a job runs.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gradio as gr

from pixal3d.config import CascadeConfig
from pixal3d.models.views import RIG_AZIMUTHS, RIG_FOV_DEG
from pixal3d.telemetry.plot import trace_figure

from ..camera import CameraStage
from ..errors import error_line
from ..inputs import VIEWS, kind_for
from ..job import BY_NAME, SETTINGS, Job, Setting
from ..result import STAGE_COLUMNS
from ..session import Session
from .job import (
    REFUSAL,
    JobUpdate,
    ViewsUpload,
    plan_or_refusal,
    run_job,
    run_views_job,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "assets" / "example.png"
EXAMPLE_VIEWS = Path(__file__).resolve().parents[2] / "assets" / "views_example"
INTRO = ("# Pixal3D, staged\nOne image in, a textured 3D mesh (GLB) out — with the memory in view: the plan "
         "before the run, memory per stage while it runs, and what each stage cost after.")
VIEWS_INTRO = ("# Pixal3D, staged: several views\nPosed views in (the main view first), one textured 3D mesh (GLB) "
               "out. Give each view's azimuth on upstream's rig (the cameras on a circle about the object, "
               f"{RIG_FOV_DEG:g}° field of view; 0, 90, 180, 270 for four) or upload their transforms.json.")
DEFAULT_FOV = 49.1  # the reference's fallback field of view, the slider's starting point
NO_ESTIMATOR = ("automatic field of view: not with this config (it names no MoGe-2 weights, or it fixes "
                "camera.fov_deg): set it on the slider")
PLOT_EVERY = 1.0  # seconds between redraws of the memory plot: drawing takes CPU from the run
CSS = "#plan pre, #plan code { font-size: 12px; }"  # the plan's reason lines are long: small, full width


def build_ui(session: Session, config: CascadeConfig, *, outputs: Path, poll: float = 0.5) -> gr.Blocks:
    """The page running jobs on ``config`` in ``session``; job files go under ``outputs``. The form has one field
    per job setting (``pipelines.job.SETTINGS``), its values read back by ``Job.from_form``."""
    kind = kind_for(config)
    takes_views = kind is VIEWS
    with gr.Blocks(title="Pixal3D, staged", analytics_enabled=False, delete_cache=(3600, 3600)) as page:
        gr.Markdown(VIEWS_INTRO if takes_views else INTRO)
        plan = gr.Markdown(label="memory plan", elem_id="plan")  # full width: the plan's lines are long
        with gr.Row():
            with gr.Column(scale=2, min_width=320):
                if takes_views:  # several posed views: the images, and their azimuths or a transforms.json
                    sources = _views_fields()
                else:
                    image = _lenient(gr.Image(label="image (RGBA: the alpha marks the object)", type="filepath",
                                              image_mode=None, format="png", sources=["upload", "clipboard"],
                                              elem_id="image", height=300))
                    gr.Examples([[str(EXAMPLE)]], inputs=[image], label="example")
                    sources = [image]
                fields: dict[str, Any] = {}
                for setting in SETTINGS:
                    if not setting.applies_to(kind):  # not for this kind of input: no field, always unset
                        fields[setting.name] = gr.State(None)
                    elif setting.name == "fov":  # "automatic" (MoGe-2, or the config's) beside the slider
                        fov_auto, fields["fov"] = _fov_fields(config)
                    else:
                        fields[setting.name] = _field(setting, config)
                run = gr.Button("Generate", variant="primary", elem_id="run")
                files = gr.File(label="downloads: GLB, run.json, memory trace", file_count="multiple",
                                interactive=False, elem_id="downloads")
            with gr.Column(scale=3, min_width=480):
                status = gr.Markdown("upload the views (or take the example views), then press Generate"
                                     if takes_views else "upload an image (or pick the example), then press Generate",
                                     elem_id="status")
                plot = gr.Plot(label="memory", elem_id="memory", format="png")
                viewer = gr.Model3D(label="model", elem_id="viewer", height=360,
                                    clear_color=(0.95, 0.95, 0.95, 1.0))
        table = gr.Dataframe(headers=list(STAGE_COLUMNS), label="per stage", interactive=False, elem_id="stages")
        model = gr.State(None)  # the finished job's GLB, handed to the viewer by a second event (see below)
        names = list(fields)
        planned = [s.name for s in SETTINGS if s.plans]

        def show_plan(*values: Any) -> str:
            try:
                job = Job.from_form(dict(zip(planned, values, strict=True)), config)
            except Exception as err:  # noqa: BLE001 - a bad setting is the visitor's, shown on one line
                return f"**{REFUSAL}{error_line(err)}**"
            text = plan_or_refusal(session, job)
            return f"**{text}**" if text.startswith(REFUSAL) else _plan_markdown(text)

        def on_run(image_: str | None, fov_auto_: bool, progress: gr.Progress = gr.Progress(),  # noqa: B008
                   *values: Any) -> Iterator[tuple]:  # Gradio's way: its progress, then the form's fields
            form = dict(zip(names, values, strict=True))
            if fov_auto_:
                form["fov"] = None
            yield from stream(form, progress, lambda job: run_job(session, image_, job, outputs=outputs, poll=poll))

        def on_views(views_: list[str] | None, azimuths_: str, views_fov_: float | None, transforms_: str | None,
                     progress: gr.Progress = gr.Progress(), *values: Any) -> Iterator[tuple]:  # noqa: B008
            form = dict(zip(names, values, strict=True))
            upload = ViewsUpload(tuple(views_ or ()), azimuths_, views_fov_, transforms_)
            yield from stream(form, progress, lambda job: run_views_job(session, upload, job, outputs=outputs,
                                                                         poll=poll))

        def stream(form: dict[str, Any], progress: Any, start: Any) -> Iterator[tuple]:
            yield "", gr.skip(), None, None, None, gr.skip()  # clear the last job's outputs
            try:
                job = Job.from_form(form, config)
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

        settings_inputs = [fields[name] for name in planned]
        page.load(show_plan, settings_inputs, plan, concurrency_limit=None, concurrency_id="plan")
        for component in settings_inputs:
            component.change(show_plan, settings_inputs, plan, concurrency_limit=None, concurrency_id="plan")
        if not takes_views:
            fov_auto.change(lambda auto: gr.Slider(interactive=not auto), fov_auto, fields["fov"], queue=False)
        # The viewer gets its model from a plain event after the streaming one: Gradio 6.31's Model3D drops a
        # model set by a generator (the closing message sets the value again and cancels the viewer's loading).
        run.click(lambda: None, None, viewer, queue=False).then(
            on_views if takes_views else on_run, [*sources, *([] if takes_views else [fov_auto]), *fields.values()],
            [status, plot, model, files, table, plan], concurrency_limit=1, concurrency_id="models",
            show_progress_on=[status]).then(lambda path: path, model, viewer, queue=False)
    return page


def _views_fields() -> list[Any]:
    """The views (several images, the main view first), their azimuths and field of view on the rig, or their
    transforms.json; a button that takes the example views."""
    views = gr.File(label="views (images; the main view first)", file_count="multiple", file_types=["image"],
                    type="filepath", elem_id="views", height=200)
    azimuths = gr.Textbox(value=", ".join(f"{a:g}" for a in RIG_AZIMUTHS), elem_id="azimuths",
                          label="azimuths (degrees, one per view, in the views' order)")
    views_fov = gr.Number(value=RIG_FOV_DEG, label="views' field of view (degrees)", elem_id="views-fov")
    transforms = gr.File(label="or their transforms.json (its cameras instead of the azimuths)", file_count="single",
                         file_types=[".json"], type="filepath", elem_id="transforms", height=100)
    example = gr.Button("take the example views", elem_id="example-views", size="sm")
    example.click(lambda: [str(p) for p in sorted(EXAMPLE_VIEWS.glob("*.png"))], None, views, queue=False)
    return [views, azimuths, views_fov, transforms]


def _field(setting: Setting, config: CascadeConfig) -> Any:
    """The form's field for ``setting`` by its kind, showing the value an unset one has (the config's, or the
    default); its element id is the setting's form name."""
    value = setting.config(config) if setting.config is not None else setting.default
    common = {"label": setting.label, "elem_id": setting.form}
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

