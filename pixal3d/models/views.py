"""Posed views: a folder of images with a ``transforms.json``, read and checked once (upstream's ``inference_mv.py``).

The layout (Blender / NeRF convention, as upstream's training renders)::

    my_views/
        transforms.json      {"camera_angle_x": 0.349, "mesh_scale": 1.0, "frames": [
        view00_azim000.png      {"file_path": "view00_azim000.png", "transform_matrix": [[...4x4...]]}, ...]}
        view01_azim090.png

``transform_matrix`` is a camera-to-world matrix (world Z up, the camera looking along its -Z with +Y up);
``camera_angle_x`` the horizontal field of view in radians, per frame or once at the top level (a frame's own
wins); ``mesh_scale`` (default 1) divides the grid as in the single-view cascade; ``name`` names a frame
(default: its file's stem). Frame 0 is the main view: every view is projected through its pose relative to
frame 0's, with frame 0 snapped onto the canonical front pose (the camera at ``(0, -d, 0)``, ``d`` its
distance from the origin); a frame 0 elsewhere is warned about (the mesh is then posed in that view's frame)
and the run goes on, as upstream's.

``read_views`` is the one validation of such a folder: every error a user can make (no ``transforms.json``, a
frame whose file is missing, a matrix that is not finite or not rigid, no frames, more views asked for than
given) is a ``ViewsError`` of one line, raised before any pixel or weight is read. ``load_view`` decodes one
view (``load_image``: RGB or RGBA, upright); views without transparency are matted (not cropped, not
rescaled) by the cascade's ``views`` stage.

``write_views`` makes such a folder from uploaded files (the web app and the job server): the images with the
visitor's ``transforms.json``, or with azimuths on upstream's example rig (``RIG_*``: the cameras on a circle
about the object's vertical axis, the first at the front pose).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from ..files import sync_folder, write_bytes_atomic, write_json_atomic
from .preprocess import ImageError, load_image, probe_image

logger = logging.getLogger(__name__)

TRANSFORMS = "transforms.json"
FRONT_TOLERANCE = 1e-4
"""Largest entry-wise deviation of frame 0's matrix from the front pose that still counts as the front pose
(upstream's ``check_main_view`` tolerance)."""
RIGID_TOLERANCE = 1e-3
"""Largest deviation of ``RᵀR`` from the identity (and of ``det R`` from 1, of the last row from ``0 0 0 1``)
a camera-to-world matrix may have: 1e-3 takes matrices written with a few decimals, refuses any scale or shear."""

RIG_AZIMUTHS = (0.0, 90.0, 180.0, 270.0)
"""Upstream's example rig (``assets/example_mv``): four views a quarter turn apart, the first the main (front)
view."""
RIG_FOV_DEG = 20.0
RIG_DISTANCE = 3.1192049980163574
"""The rig's horizontal field of view (degrees) and camera distance: a unit object fills the frame at 20 degrees."""
MAX_VIEWS = 32
"""The most views an upload may hold (each view's DINOv3 features are held until the average: docs/views.md's memory per
view)."""
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_SUFFIX = re.compile(r"\.[a-z0-9]{1,5}")


class ViewsError(ImageError):
    """A views folder cannot be used; the message names the folder (or frame) and what to do."""


@dataclass(frozen=True)
class ViewFrame:
    """One posed view: its image file, its camera-to-world matrix (4×4, as written) and horizontal fov (radians)."""

    path: Path
    name: str
    transform: tuple[tuple[float, ...], ...]
    fov: float


@dataclass(frozen=True)
class ViewSet:
    """A checked views folder: the frames used (the first ``num_views`` of ``given``), in file order.

    ``front``: whether frame 0 is the canonical front pose (within ``FRONT_TOLERANCE``)."""

    folder: Path
    frames: tuple[ViewFrame, ...]
    mesh_scale: float
    given: int
    front: bool

    @property
    def count(self) -> int:
        return len(self.frames)

    @property
    def distance(self) -> float:
        """Frame 0's distance from the origin: the front pose every view is placed against."""
        return math.dist((0.0, 0.0, 0.0), [row[3] for row in self.frames[0].transform[:3]])

    def describe(self) -> dict[str, Any]:
        """What run.json says about the input views."""
        return {"folder": str(self.folder), "views": self.count, "given": self.given,
                "names": [f.name for f in self.frames], "fov_deg": [math.degrees(f.fov) for f in self.frames],
                "mesh_scale": self.mesh_scale,
                "distance": self.distance, "front_pose": self.front}

    def digest(self) -> str:
        """sha256 of what decides a run on these views: the frames used (names, matrices, fovs), mesh_scale and
        each frame file's bytes (a work directory's key)."""
        digest = hashlib.sha256(json.dumps({
            "mesh_scale": self.mesh_scale,
            "frames": [[f.name, f.transform, f.fov] for f in self.frames]}, sort_keys=True).encode())
        for frame in self.frames:
            with open(frame.path, "rb") as stream:
                for block in iter(lambda: stream.read(1 << 20), b""):
                    digest.update(block)
        return digest.hexdigest()


def view_name(views: str | Path | ViewSet) -> str:
    """What outputs and records call a views input: its folder's name."""
    folder = views.folder if isinstance(views, ViewSet) else Path(views)
    return folder.resolve().name if folder.name in ("", ".", "..") else folder.name


def front_pose(distance: float) -> tuple[tuple[float, ...], ...]:
    """The canonical front camera-to-world matrix at ``distance``: the camera at ``(0, -distance, 0)`` looking at
    the origin along +Y, world +Z up in the image (upstream's ``front_view_transform_matrix``)."""
    return ((1.0, 0.0, 0.0, 0.0), (0.0, 0.0, -1.0, -distance), (0.0, 1.0, 0.0, 0.0), (0.0, 0.0, 0.0, 1.0))


def orbit_pose(azimuth_deg: float, distance: float) -> tuple[tuple[float, ...], ...]:
    """The front pose turned by ``azimuth_deg`` about world +Z (counter-clockwise seen from above): 90 puts the
    camera at ``(distance, 0, 0)``, as upstream's example rig (``view01_azim090``)."""
    quarter, rest = divmod(azimuth_deg, 90.0)
    if rest == 0.0:  # the rig's exact matrices (cos/sin of multiples of 90 degrees written as 0 and ±1)
        c, s = ((1.0, 0.0), (0.0, 1.0), (-1.0, 0.0), (0.0, -1.0))[int(quarter) % 4]
    else:
        c, s = math.cos(math.radians(azimuth_deg)), math.sin(math.radians(azimuth_deg))
    front = front_pose(distance)
    turn = ((c, -s, 0.0), (s, c, 0.0), (0.0, 0.0, 1.0))
    rows = [[sum(turn[i][k] * front[k][j] for k in range(3)) + 0.0 for j in range(4)] for i in range(3)]
    return (*(tuple(r) for r in rows), (0.0, 0.0, 0.0, 1.0))


def transforms_json(files: list[str], poses: list[tuple[tuple[float, ...], ...]], fov: float, *,
                    names: list[str] | None = None, mesh_scale: float = 1.0) -> dict[str, Any]:
    """A ``transforms.json`` document for ``files`` posed by ``poses`` at horizontal fov ``fov`` (radians)."""
    names = names or [Path(f).stem for f in files]
    frames = [{"file_path": f, "name": n, "transform_matrix": [list(row) for row in pose]}
              for f, n, pose in zip(files, names, poses)]
    return {"camera_angle_x": fov, "mesh_scale": mesh_scale, "frames": frames}


def parse_azimuths(text: str | Sequence[float] | None, count: int) -> tuple[float, ...]:
    """The azimuths (degrees) of ``count`` uploaded views: comma- or space-separated numbers, one per view (empty:
    the rig's 0/90/180/270 for four views); ``ViewsError`` when they do not fit."""
    if text is None or (isinstance(text, str) and not text.strip()):
        if count != len(RIG_AZIMUTHS):
            raise ViewsError(f"{count} views and no azimuths: give one azimuth (degrees) per view, the first view's 0, "
                             f"e.g. {', '.join(f'{360 * i / max(count, 1):g}' for i in range(count))}")
        return RIG_AZIMUTHS
    if isinstance(text, str):
        try:
            values = tuple(float(part) for part in re.split(r"[\s,]+", text.strip()) if part)
        except ValueError:
            raise ViewsError(f"azimuths {text.strip()[:60]!r} are not numbers; give degrees such as "
                             f"0, 90, 180, 270") from None
    else:
        values = tuple(float(v) for v in text)
    if not all(math.isfinite(v) for v in values):
        raise ViewsError(f"azimuths {list(values)} are not all finite; give degrees such as 0, 90, 180, 270")
    if len(values) != count:
        raise ViewsError(f"{len(values)} azimuths for {count} views; give one per view, in the views' order")
    return values


def write_views(folder: str | Path, images: Sequence[tuple[str, bytes]], *, transforms: bytes | None = None,
                azimuths: str | Sequence[float] | None = None, fov_deg: float = RIG_FOV_DEG,
                distance: float = RIG_DISTANCE) -> Path:
    """A views folder at ``folder`` (created; each file written atomically, the folder flushed) from uploaded
    ``images`` (their file names and bytes, the main view first): with ``transforms`` (a ``transforms.json``'s
    bytes, naming the images by their file names) written as given, else the rig's (``azimuths`` in degrees, one
    per image, default 0/90/180/270; ``fov_deg``; ``distance``). ``ViewsError`` for an upload that cannot make
    one (no images, too many, a file name that is not a plain name); ``read_views`` checks the folder itself."""
    folder = Path(folder)
    if not images:
        raise ViewsError("no views: upload the view images (the main view first) with their azimuths or a "
                         "transforms.json")
    if len(images) > MAX_VIEWS:
        raise ViewsError(f"{len(images)} views uploaded; at most {MAX_VIEWS}")
    if transforms is None:
        angles = parse_azimuths(azimuths, len(images))
        if isinstance(fov_deg, bool) or not isinstance(fov_deg, (int, float)) or not 1.0 <= fov_deg <= 170.0:
            raise ViewsError(f"the views' field of view {fov_deg!r} is not a number of degrees in [1, 170]; the "
                             f"rig's is {RIG_FOV_DEG:g}")
        suffixes = [Path(name).suffix.lower() for name, _ in images]  # the file's kind is read from its bytes
        names = [f"view{i:02d}_azim{round(a) % 360:03d}{s if _SUFFIX.fullmatch(s) else '.img'}"
                 for i, (a, s) in enumerate(zip(angles, suffixes))]
        document = transforms_json(names, [orbit_pose(a, distance) for a in angles], math.radians(fov_deg),
                                   names=[f"view{i:02d}" for i in range(len(names))])
    else:
        names = [Path(name.replace("\\", "/")).name for name, _ in images]
        for given, name in zip(images, names):
            if not _FILE_NAME.fullmatch(name) or name == TRANSFORMS:
                raise ViewsError(f"view file name {given[0][:60]!r} is not a plain file name (letters, digits, . _ -); "
                                 f"name the files as transforms.json's file_path does")
        if len(set(names)) != len(names):
            raise ViewsError(f"two uploaded views are named alike ({sorted({n for n in names if names.count(n) > 1})})")
        try:
            document = json.loads(transforms.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ViewsError(f"the uploaded {TRANSFORMS} is not valid JSON ({err})") from None
    folder.mkdir(parents=True, exist_ok=True)
    for name, (_, data) in zip(names, images):
        write_bytes_atomic(folder / name, data)
    write_json_atomic(folder / TRANSFORMS, document)
    sync_folder(folder)
    return folder


def read_views(folder: str | Path, num_views: int | None = None) -> ViewSet:
    """Check the views folder ``folder`` and return its first ``num_views`` frames (default: all); ``ViewsError``
    (one line) for anything a user must fix. Reads ``transforms.json`` and each image's header, no pixels."""
    folder = Path(folder)
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise ViewsError(f"views folder {folder} {what}; pass a folder holding {TRANSFORMS} and the view images")
    meta = _read_transforms(folder)
    frames = meta.get("frames")
    if not isinstance(frames, list):
        raise ViewsError(f"{folder / TRANSFORMS} has no 'frames' list; each frame needs file_path and "
                         f"transform_matrix (see docs/views.md)")
    if not frames:
        raise ViewsError(f"{folder / TRANSFORMS} lists no frames (V = 0); add at least the main view")
    if num_views is not None:
        if isinstance(num_views, bool) or not isinstance(num_views, int) or num_views < 1:
            raise ViewsError(f"num_views={num_views!r} is not an integer >= 1")
        if num_views > len(frames):
            raise ViewsError(f"num_views={num_views} is above the {len(frames)} frames {folder / TRANSFORMS} gives; "
                             f"pass at most {len(frames)}")
    mesh_scale = _number(meta.get("mesh_scale", 1.0), f"{folder / TRANSFORMS}: mesh_scale", positive=True)
    checked = tuple(_frame(folder, meta, i, frame) for i, frame in enumerate(frames[:num_views or len(frames)]))
    names = [f.name for f in checked]
    if len(set(names)) != len(names):
        alike = sorted({n for n in names if names.count(n) > 1})
        raise ViewsError(f"{folder / TRANSFORMS} names two frames alike ({alike}); give each frame its own name")
    views = ViewSet(folder, checked, mesh_scale, len(frames), front=False)
    if views.distance == 0.0:
        raise ViewsError(f"{folder / TRANSFORMS}: frame 0's camera sits at the origin; the main view's camera must "
                         f"look at the object from a distance")
    deviation = max(abs(a - b) for row, front in zip(checked[0].transform, front_pose(views.distance))
                    for a, b in zip(row, front))
    front = deviation <= FRONT_TOLERANCE
    if not front:
        logger.warning("%s: frame 0 (%s) is not the canonical front pose (camera at (0, -d, 0) looking along +Y, "
                       "largest deviation %.3g); the mesh comes out posed in that view's frame", folder / TRANSFORMS,
                       checked[0].name, deviation)
    return ViewSet(folder, checked, mesh_scale, len(frames), front=front)


def load_view(frame: ViewFrame) -> Image.Image:
    """The frame's pixels: an upright RGB or RGBA image (``load_image``'s checks and messages)."""
    return load_image(frame.path)


def _read_transforms(folder: Path) -> dict[str, Any]:
    path = folder / TRANSFORMS
    if not path.is_file():
        raise ViewsError(f"{folder} has no {TRANSFORMS}; a views folder holds the images and a {TRANSFORMS} giving "
                         f"each one's camera (see docs/views.md)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ViewsError(f"{path} is not valid JSON ({err}); fix it or write it again") from None
    except OSError as err:
        raise ViewsError(f"{path} cannot be read ({err.strerror or err})") from None
    if not isinstance(meta, dict):
        raise ViewsError(f"{path} must hold a JSON object with 'frames', got {type(meta).__name__}")
    return meta


def _frame(folder: Path, meta: dict[str, Any], index: int, frame: Any) -> ViewFrame:
    where = f"{folder / TRANSFORMS}: frame {index}"
    if not isinstance(frame, dict):
        raise ViewsError(f"{where} must be an object with file_path and transform_matrix")
    file_path = frame.get("file_path")
    if not isinstance(file_path, str) or not file_path.strip():
        raise ViewsError(f"{where} has no file_path (the view's image, relative to {folder})")
    relative = Path(file_path)
    path = folder / relative
    if relative.is_absolute() or ".." in relative.parts:
        raise ViewsError(f"{where}'s file_path {file_path!r} points outside {folder}; keep the views in the folder")
    if not path.is_file():
        raise ViewsError(f"{where}'s file {file_path} does not exist in {folder}; check file_path (with its "
                         f"extension)")
    try:
        probe_image(path)
    except ImageError as err:
        raise ViewsError(f"{where}: {err}") from None
    transform = _matrix(frame.get("transform_matrix"), where)
    fov = frame.get("camera_angle_x", meta.get("camera_angle_x"))
    if fov is None:
        raise ViewsError(f"{where} has no camera_angle_x, and {TRANSFORMS} gives none for all frames; add the "
                         f"horizontal field of view in radians")
    fov = _number(fov, f"{where}: camera_angle_x")
    if not 0.0 < fov < math.pi:
        raise ViewsError(f"{where}: camera_angle_x {fov} is not a field of view in radians (0, pi); e.g. 0.349 for "
                         f"20 degrees")
    name = frame.get("name", relative.stem)
    return ViewFrame(path, str(name), transform, fov)


def _number(value: Any, where: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ViewsError(f"{where} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ViewsError(f"{where} must be > 0, got {value!r}")
    return float(value)


def _matrix(value: Any, where: str) -> tuple[tuple[float, ...], ...]:
    """A rigid 4×4 camera-to-world matrix, as written, or a ``ViewsError``."""
    if not isinstance(value, list) or len(value) != 4 or any(not isinstance(r, list) or len(r) != 4 for r in value):
        raise ViewsError(f"{where}: transform_matrix must be 4 rows of 4 numbers (camera-to-world)")
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for r in value for v in r):
        raise ViewsError(f"{where}: transform_matrix holds a value that is not a finite number")
    m = tuple(tuple(float(v) for v in r) for r in value)
    rotation = [r[:3] for r in m[:3]]
    gram = max(abs(sum(rotation[k][i] * rotation[k][j] for k in range(3)) - (i == j))
               for i in range(3) for j in range(3))
    det = (rotation[0][0] * (rotation[1][1] * rotation[2][2] - rotation[1][2] * rotation[2][1])
           - rotation[0][1] * (rotation[1][0] * rotation[2][2] - rotation[1][2] * rotation[2][0])
           + rotation[0][2] * (rotation[1][0] * rotation[2][1] - rotation[1][1] * rotation[2][0]))
    last = max(abs(a - b) for a, b in zip(m[3], (0.0, 0.0, 0.0, 1.0)))
    if gram > RIGID_TOLERANCE or abs(det - 1.0) > RIGID_TOLERANCE or last > RIGID_TOLERANCE:
        raise ViewsError(f"{where}: transform_matrix is not a rigid camera-to-world matrix (a rotation and a "
                         f"translation, last row 0 0 0 1; |RᵀR - I| = {gram:.2g}, det R = {det:.4g}); "
                         f"remove any scale, shear or mirroring")
    return m
