"""Issue 38: a new job setting on all three front ends is one row of ``pipelines/job.py: SETTINGS`` and one field of
``Job``. ``texture_format`` (png or webp; the export had it in the config only) was added that way, touching no other
file of code: the command's ``--texture-format``, the server's ``"texture_format"`` and the app's form field each give
a job whose export writes webp textures, and each refuses a format the export does not write."""
from __future__ import annotations

import json
import struct

import pytest

from pipelines import cli
from pipelines.cli_args import parse_args
from pipelines.job import Job, SettingsError
from tests.support.cascade_fixtures import EXAMPLE, TINY_CONFIG, tiny, tiny_cache  # noqa: F401


def test_every_front_end_takes_it_and_refuses_a_format_the_export_does_not_write(tiny):
    jobs = [Job.from_args(parse_args(["x.png", "--config", str(TINY_CONFIG), "--texture-format", "webp"])),
            Job.from_request({"texture_format": "webp"}, tiny), Job.from_form({"texture_format": "webp"}, tiny)]
    for job in jobs:
        assert job.config.export.texture_format == "webp" and job.settings()["texture_format"] == "webp"
    assert jobs[0].plan_key() == jobs[1].plan_key() == jobs[2].plan_key()
    unset = Job.from_request({}, tiny)  # control: unset is the config's
    assert unset.config.export.texture_format == tiny.export.texture_format == "png"
    assert unset.settings()["texture_format"] is None and unset.plan_key() != jobs[1].plan_key()
    with pytest.raises(SystemExit, match="2"):  # the command's parser: argparse's choices
        parse_args(["x.png", "--texture-format", "jpeg"])
    for adapter in (Job.from_request, Job.from_form):
        with pytest.raises(SettingsError, match="texture_format must be one of"):
            adapter({"texture_format": "jpeg"}, tiny)
    with pytest.raises(SettingsError, match="settings.texture_format must be str"):
        Job.from_request({"texture_format": 3}, tiny)


def test_the_apps_form_has_a_field_for_it(tiny, tmp_path):
    pytest.importorskip("gradio")
    from pipelines.app.ui import build_ui
    from pipelines.session import Session

    page = build_ui(Session("app", device="cpu"), tiny, outputs=tmp_path)
    [field] = [b for b in page.blocks.values() if getattr(b, "elem_id", None) == "texture-format"]
    assert [choice[1] for choice in field.choices] == ["png", "webp"] and field.value == "png"


def _image_types(glb: bytes) -> list[str]:
    """The mime types of a GLB's images (its JSON chunk)."""
    length, kind = struct.unpack_from("<I4s", glb, 12)
    assert kind == b"JSON"
    return [image["mimeType"] for image in json.loads(glb[20:20 + length])["images"]]


@pytest.mark.parametrize("texture_format", ["webp", "png"])
def test_the_command_writes_its_textures_in_that_format(texture_format, tiny_cache, tmp_path, capsys):
    out = tmp_path / "o.glb"
    code = cli.main([str(EXAMPLE), "--config", str(TINY_CONFIG), "-o", str(out), "--quiet", "--memory-policy",
                     "resident", *(["--texture-format", "webp"] if texture_format == "webp" else [])])
    assert code == 0, capsys.readouterr().err
    types = _image_types(out.read_bytes())
    assert types and set(types) == {f"image/{texture_format}"}  # png: the config's, the control
    record = json.loads(out.with_name("o.run.json").read_text())
    assert record["config"]["export"]["texture_format"] == texture_format
    assert record["cli"]["settings"]["texture_format"] == ("webp" if texture_format == "webp" else None)
