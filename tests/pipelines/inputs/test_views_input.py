"""A views folder (pixal3d/models/views.py): the one validation, every refusal in one line, the front-pose warning.

Each refusal test starts from a copy of the example folder (assets/views_example), which reads (the control), and
breaks one thing.
"""
from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest

from pixal3d.models.views import (
    ViewsError,
    front_pose,
    orbit_pose,
    read_views,
    transforms_json,
    view_name,
)

EXAMPLE = Path(__file__).resolve().parents[3] / "assets" / "views_example"
UPSTREAM_DISTANCE = 3.1192049980163574
# upstream's assets/mv_images/example/transforms.json, frames 1 and 3 (as public ports quote it)
UPSTREAM_AZIM090 = ((0.0, 0.0, 1.0, UPSTREAM_DISTANCE), (1.0, 0.0, 0.0, 0.0), (0.0, 1.0, 0.0, 0.0),
                    (0.0, 0.0, 0.0, 1.0))
UPSTREAM_AZIM270 = ((0.0, 0.0, -1.0, -UPSTREAM_DISTANCE), (-1.0, 0.0, 0.0, 0.0), (0.0, 1.0, 0.0, 0.0),
                    (0.0, 0.0, 0.0, 1.0))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    copy = tmp_path / "views"
    shutil.copytree(EXAMPLE, copy)
    return copy


def edit(folder: Path, change) -> None:
    path = folder / "transforms.json"
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


def test_the_example_folder_reads_as_upstreams_rig(folder):
    views = read_views(folder)
    assert views.count == views.given == 4 and views.front and views.mesh_scale == 1.0
    assert [f.name for f in views.frames] == ["azim000", "azim090", "azim180", "azim270"]
    assert views.distance == UPSTREAM_DISTANCE and all(f.fov == 0.3490658503988659 for f in views.frames)
    assert views.frames[0].transform == front_pose(UPSTREAM_DISTANCE)
    assert views.frames[1].transform == UPSTREAM_AZIM090 and views.frames[3].transform == UPSTREAM_AZIM270
    assert view_name(folder) == "views" and view_name(views) == "views"


def test_orbit_poses_are_upstreams_and_transforms_json_round_trips(tmp_path):
    assert orbit_pose(0, 2.0) == front_pose(2.0)
    assert orbit_pose(90, UPSTREAM_DISTANCE) == UPSTREAM_AZIM090
    assert orbit_pose(270, UPSTREAM_DISTANCE) == UPSTREAM_AZIM270
    oblique = orbit_pose(30, 2.0)  # the camera at (2 sin 30°, -2 cos 30°, 0), still looking at the origin
    assert math.isclose(oblique[0][3], 1.0) and math.isclose(oblique[1][3], -math.sqrt(3))
    shutil.copy(EXAMPLE / "view00_azim000.png", tmp_path / "a.png")
    shutil.copy(EXAMPLE / "view01_azim090.png", tmp_path / "b.png")
    poses = [orbit_pose(0, 2.5), orbit_pose(30, 2.5)]
    (tmp_path / "transforms.json").write_text(json.dumps(transforms_json(["a.png", "b.png"], poses, 0.4)))
    views = read_views(tmp_path)
    assert [f.transform for f in views.frames] == poses and views.frames[1].fov == 0.4 and views.front


def test_num_views_takes_the_first_frames_and_the_digest_follows_them(folder):
    all_four, two = read_views(folder), read_views(folder, 2)
    assert two.count == 2 and two.given == 4 and [f.name for f in two.frames] == ["azim000", "azim090"]
    assert two.digest() != all_four.digest() and read_views(folder, 2).digest() == two.digest()
    before = all_four.digest()
    with open(folder / "view03_azim270.png", "ab") as stream:
        stream.write(b"\0")  # the last view's bytes change: so does the digest of every read that uses it
    assert read_views(folder).digest() != before and read_views(folder, 2).digest() == two.digest()


@pytest.mark.parametrize("num_views, message", [
    (5, "num_views=5 is above the 4 frames .* gives; pass at most 4"),
    (0, "num_views=0 is not an integer >= 1"),
])
def test_num_views_out_of_range_is_refused(folder, num_views, message):
    with pytest.raises(ViewsError, match=message):
        read_views(folder, num_views)


def _nan_matrix(meta):
    meta["frames"][2]["transform_matrix"][0][3] = float("nan")  # json writes NaN, Python's json reads it back


def _scaled(meta):
    meta["frames"][1]["transform_matrix"] = [[v * 1.1 if j < 3 else v for j, v in enumerate(r)]
                                             for r in meta["frames"][1]["transform_matrix"][:3]] + [[0, 0, 0, 1]]


def _mirrored(meta):
    meta["frames"][1]["transform_matrix"][0] = [-v for v in meta["frames"][1]["transform_matrix"][0]]


BROKEN = {
    "no frames list": (lambda m: m.pop("frames"), "has no 'frames' list"),
    "no frames (V = 0)": (lambda m: m.update(frames=[]), r"lists no frames \(V = 0\)"),
    "a missing file": (lambda m: m["frames"][2].update(file_path="view02.png"),
                       "frame 2's file view02.png does not exist"),
    "a path outside": (lambda m: m["frames"][1].update(file_path="../x.png"), "points outside"),
    "no file_path": (lambda m: m["frames"][0].pop("file_path"), "frame 0 has no file_path"),
    "a 3x4 matrix": (lambda m: m["frames"][1]["transform_matrix"].pop(), "must be 4 rows of 4 numbers"),
    "a non-finite matrix": (_nan_matrix, "not a finite number"),
    "a scaled matrix": (_scaled, "not a rigid camera-to-world matrix"),
    "a mirrored matrix": (_mirrored, r"not a rigid camera-to-world matrix .*det R = -1"),
    "a projective last row": (lambda m: m["frames"][3]["transform_matrix"][3].__setitem__(2, 0.5), "not a rigid"),
    "no field of view": (lambda m: m.pop("camera_angle_x"), "frame 0 has no camera_angle_x"),
    "a field of view in degrees": (lambda m: m.update(camera_angle_x=20), r"is not a field of view in radians"),
    "a zero mesh_scale": (lambda m: m.update(mesh_scale=0), "mesh_scale must be > 0"),
    "two frames named alike": (lambda m: m["frames"][1].update(name="azim000"), "names two frames alike"),
    "a main camera at the origin": (lambda m: [r.__setitem__(3, 0.0) for r in m["frames"][0]["transform_matrix"][:3]],
                                    "frame 0's camera sits at the origin"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_folder_is_refused_in_one_line(folder, case):
    change, message = BROKEN[case]
    edit(folder, change)
    with pytest.raises(ViewsError, match=message) as caught:
        read_views(folder)
    assert "\n" not in str(caught.value) and str(folder) in str(caught.value)


def test_a_missing_folder_transforms_or_bad_json_is_refused(folder, tmp_path):
    with pytest.raises(ViewsError, match="does not exist"):
        read_views(tmp_path / "nowhere")
    with pytest.raises(ViewsError, match="is a file, not a folder"):
        read_views(folder / "view00_azim000.png")
    (folder / "transforms.json").write_text("{frames: [")
    with pytest.raises(ViewsError, match="is not valid JSON"):
        read_views(folder)
    (folder / "transforms.json").unlink()
    with pytest.raises(ViewsError, match="has no transforms.json"):
        read_views(folder)


def test_a_frame_that_is_not_an_image_is_refused(folder):
    (folder / "view01_azim090.png").write_bytes(b"not a png")
    with pytest.raises(ViewsError, match="frame 1: .* is not an image Pillow can read"):
        read_views(folder)


def test_a_per_frame_field_of_view_wins_over_the_folders(folder):
    edit(folder, lambda m: m["frames"][1].update(camera_angle_x=0.5))
    views = read_views(folder)
    assert [f.fov for f in views.frames] == [0.3490658503988659, 0.5, 0.3490658503988659, 0.3490658503988659]


def test_a_main_view_off_the_front_pose_is_one_warning_and_the_run_goes_on(folder, caplog):
    edit(folder, lambda m: m["frames"][0].update(transform_matrix=[list(r) for r in orbit_pose(10, 3.0)]))
    with caplog.at_level(logging.WARNING, logger="pixal3d.models.views"):
        views = read_views(folder)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert not views.front and len(warnings) == 1 and "not the canonical front pose" in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pixal3d.models.views"):
        assert read_views(EXAMPLE).front  # control: the front pose warns nothing
    assert not caplog.records
