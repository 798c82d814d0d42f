"""Issue 30, item 7 (uploads): the web app hands the job the uploaded file, never an image Gradio decoded, so an
upload goes through the command's image checks and messages. A decompression bomb used to stop in Gradio's own
preprocessing (``DecompressionBombError``, neither an ``OSError`` nor a ``ValueError``) before our checks ran;
here Pillow's bomb limit is lowered so that the example image counts as one."""
from __future__ import annotations

import shutil

import pytest
from PIL import Image

from tests.support.cascade_fixtures import EXAMPLE, tiny, tiny_cache  # noqa: F401

gr = pytest.importorskip("gradio")


def _image_input():
    from pipelines.app.ui import _lenient

    return _lenient(gr.Image(type="filepath", image_mode=None, format="png", sources=["upload", "clipboard"]))


def test_an_upload_reaches_the_job_as_its_own_file_even_when_pillow_would_call_it_a_bomb(tmp_path, monkeypatch):
    from gradio.data_classes import FileData

    upload = tmp_path / "upload.png"
    shutil.copy(EXAMPLE, upload)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 64)  # over 2 x 64 pixels: DecompressionBombError on decode
    with pytest.raises(Image.DecompressionBombError):  # control: decoding it is what used to stop the upload
        Image.open(upload).load()
    assert _image_input().preprocess(FileData(path=str(upload))) == str(upload)


def test_no_upload_is_none():
    assert _image_input().preprocess(None) is None


def _fov_inputs(config, tmp_path) -> dict:
    from pipelines.app.ui import build_ui
    from pipelines.session import Session

    worker = Session("app", device="cpu")
    try:
        page = build_ui(worker, config, outputs=tmp_path)
    finally:
        worker.close()
    return {b.elem_id: b for b in page.blocks.values() if getattr(b, "elem_id", None) in ("fov-auto", "fov")}


def test_the_fov_checkbox_is_off_and_disabled_saying_why_where_the_config_cannot_estimate_one(tiny, tmp_path):
    import dataclasses

    blind = dataclasses.replace(tiny, camera=dataclasses.replace(tiny.camera, fov_deg=None),
                                weights=dataclasses.replace(tiny.weights, moge=None))  # no MoGe-2: nothing estimates
    inputs = _fov_inputs(blind, tmp_path)
    assert inputs["fov-auto"].value is False and inputs["fov-auto"].interactive is False
    assert "not with this config" in inputs["fov-auto"].label and inputs["fov"].interactive is True
    inputs = _fov_inputs(tiny, tmp_path)  # control: tiny's MoGe-2 estimates it, so "automatic" stays on
    assert inputs["fov-auto"].value is True and inputs["fov-auto"].interactive is True
    assert inputs["fov-auto"].label == "automatic field of view" and inputs["fov"].interactive is False


def test_a_running_job_has_one_progress_text_and_the_status_line_says_only_the_outcome(tiny, tmp_path, monkeypatch):
    """Issue 30, item 7 (progress): while a job runs, only Gradio's bar (over the status line) says the stage; the
    status line is not written again until the outcome. Two texts used to show different stages."""
    from pipelines.app import ui
    from pipelines.app.job import JobUpdate
    from pipelines.job import SETTINGS
    from pipelines.session import Session

    updates = [JobUpdate(status="planning"), JobUpdate(status="stage 3/9 · structure", fraction=0.3),
               JobUpdate(status="stage 7/9 · texture · sampler step 2/4", fraction=0.7),
               JobUpdate(status="error: injected", error="injected")]
    monkeypatch.setattr(ui, "run_job", lambda *args, **kwargs: iter(updates))
    worker = Session("app", device="cpu")
    try:
        page = ui.build_ui(worker, tiny, outputs=tmp_path)
        [on_run] = [f.fn for f in page.fns.values() if getattr(f.fn, "__name__", "") == "on_run"]
        told = []
        form = {"seed": 1, "fov": 40.0, "memory_policy": "auto", "texture_size": 1024, "face_budget": 1000,
                "memory_budget": ""}  # the page's fields, in the order of pipelines.job.SETTINGS
        yields = list(on_run(str(EXAMPLE), None, True, lambda fraction, desc: told.append((fraction, desc)),
                             *(form.get(s.name) for s in SETTINGS)))
    finally:
        worker.close()
    assert told == [(u.fraction, u.status) for u in updates[:3]]  # the bar: every running update
    status = [y[0] for y in yields[1:]]  # after the first yield, which clears the last job's outputs
    assert all(isinstance(s, type(gr.skip())) for s in status[:3]), status  # not written while it runs
    assert status[3] == "**error: injected**"


def test_a_number_offered_in_a_dropdown_is_taken_as_the_text_an_api_client_sends(tiny, tmp_path):
    """Issue 44 item 12: through ``gradio_client`` the texture size's choices are listed as strings, and "256" was
    refused ("not in the list of choices": they were numbers). The choices are text now, and the job reads them as
    the setting's number; a value not offered is still refused."""
    from pipelines.app.ui import build_ui
    from pipelines.job import Job
    from pipelines.session import Session

    worker = Session("app", device="cpu")
    try:
        page = build_ui(worker, tiny, outputs=tmp_path)
    finally:
        worker.close()
    [field] = [b for b in page.blocks.values() if getattr(b, "elem_id", None) == "texture"]
    assert field.preprocess("256") == "256"
    assert Job.from_form({"texture_size": field.preprocess("256")}, tiny).texture_size == 256
    with pytest.raises(gr.Error):
        field.preprocess("300")
