"""The web app on a multi-view config: the page takes several images with their azimuths on upstream's rig (default
0/90/180/270 degrees at 20 degrees' field of view) or a transforms.json, writes the job's views folder and runs it
as the library runs a views folder; a wrong upload is one line in the status. The image page is as it was (no
views' fields, no number of views). Control: the swapped-colour views give other fingerprints."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines import Pixal3D
from pipelines.job import SETTINGS
from pixal3d.config import load_config
from tests.support.cascade_fixtures import TINY_CONFIG, tiny_cache  # noqa: F401
from tests.support.views_fixtures import EXAMPLE_VIEWS, fast_mv_config, swapped_views  # noqa: F401

gr = pytest.importorskip("gradio")

FORM = {"seed": 9, "memory_policy": "staged"}


def _page(config, outputs):
    from pipelines.app.ui import build_ui
    from pipelines.session import Session

    session = Session("app", device="cpu")
    return session, build_ui(session, config, outputs=outputs)


def _handler(page, name):
    [fn] = [f.fn for f in page.fns.values() if getattr(f.fn, "__name__", "") == name]
    return fn


def _ids(page) -> set[str]:
    return {b.elem_id for b in page.blocks.values() if getattr(b, "elem_id", None)}


def _files(folder: Path) -> list[str]:
    return [str(p) for p in sorted(folder.glob("*.png"))]


def _run(on_views, files, azimuths="0, 90, 180, 270", fov=20.0, transforms=None, **form) -> list:
    values = {**FORM, **form}
    return list(on_views(files, azimuths, fov, transforms, lambda *a, **k: None,
                         *(values.get(s.name) for s in SETTINGS)))


def _prints(glb: str) -> dict:
    record = json.loads(Path(glb).with_suffix(".run.json").read_text())
    return {s["stage"]: s["fingerprints"] for s in record["stages"] if s["fingerprints"]}


def test_the_image_page_has_no_views_fields_and_the_views_page_no_field_of_view(tiny_cache, tmp_path):
    session, page = _page(load_config(TINY_CONFIG), tmp_path)
    session.close()
    assert {"image", "fov", "fov-auto"} <= _ids(page) and not {"views", "num-views", "azimuths"} & _ids(page)
    session, page = _page(load_config("tiny_mv"), tmp_path)
    session.close()
    assert {"views", "azimuths", "views-fov", "transforms", "example-views", "num-views"} <= _ids(page)
    assert not {"image", "fov", "fov-auto"} & _ids(page)


def test_uploaded_views_with_the_rig_or_a_transforms_json_give_the_librarys_run(fast_mv_config, tmp_path):
    swapped = swapped_views(tmp_path / "swapped")
    with Pixal3D.from_config(fast_mv_config, policy="staged", device="cpu") as pipe:
        expected = pipe.run(views=EXAMPLE_VIEWS, seed=9).fingerprints()
        control = pipe.run(views=swapped, seed=9).fingerprints()
    session, page = _page(load_config(fast_mv_config), tmp_path / "app")
    on_views = _handler(page, "on_run")
    try:
        last = _run(on_views, _files(EXAMPLE_VIEWS))[-1]
        assert last[0].startswith("done in"), last[0]
        assert _prints(last[2]) == expected
        last = _run(on_views, _files(EXAMPLE_VIEWS), azimuths="", fov=None,  # ignored beside a transforms.json
                    transforms=str(EXAMPLE_VIEWS / "transforms.json"))[-1]
        assert _prints(last[2]) == expected
        last = _run(on_views, _files(swapped))[-1]  # control: another object on the same rig
        assert _prints(last[2]) == control != expected
        last = _run(on_views, _files(EXAMPLE_VIEWS), num_views=2)[-1]
        assert json.loads(Path(last[2]).with_suffix(".run.json").read_text())["views"]["views"] == 2
    finally:
        session.close()


@pytest.mark.parametrize("case", ["no views", "three views, no azimuths", "azimuths not numbers",
                                  "more views asked for than given", "a frame missing from transforms.json"])
def test_a_wrong_upload_is_one_line_in_the_status(case, tiny_cache, tmp_path):
    session, page = _page(load_config("tiny_mv"), tmp_path)
    on_views = _handler(page, "on_run")
    files = _files(EXAMPLE_VIEWS)
    args, form, words = {
        "no views": (([], ), {}, "no views: upload the view images"),
        "three views, no azimuths": ((files[:3], ""), {}, "3 views and no azimuths"),
        "azimuths not numbers": ((files, "front, left"), {}, "azimuths 'front, left' are not numbers"),
        "more views asked for than given": ((files,), {"num_views": 5}, "num_views=5 is above the 4 frames"),
        "a frame missing from transforms.json": ((files[:3], "", None, str(EXAMPLE_VIEWS / "transforms.json")), {},
                                                 "view03_azim270.png does not exist"),
    }[case]
    try:
        last = _run(on_views, *args, **form)[-1]
    finally:
        session.close()
    assert last[0].startswith("**error: ") and words in last[0] and "\n" not in last[0], last[0]
    assert not list(tmp_path.rglob("*.glb"))
