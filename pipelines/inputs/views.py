"""Posed views (a folder with a ``transforms.json``, upstream's ``inference_mv.py``): the multi-view cascade's input.

The ``views`` stage takes the place of preprocess and camera, and the features and flow stages read the posed views
instead of the image and its camera (``flow_stage.on_views``); the rest of the cascade is the single-view one.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from pixal3d.config import UsageError

from .kind import JSON_FILE, NUMBER, TEXT, InputKind, UploadField

VIEWS_ASK = ("send each view image in a multipart field 'views' (the main view first), with 'azimuths' (degrees, "
             "default 0,90,180,270 for four views) or a 'transforms' file (transforms.json)")
NO_VIEWS = "no views: upload the view images (the main view first) with their azimuths or a transforms.json"


class ViewsInput(InputKind):
    """A views folder per run (or a ``ViewSet`` from ``read_views``); ``num_views`` takes the first N frames."""

    name = "views"
    argument = "views"
    noun = "views folder"
    readable = "a folder with a transforms.json, or a ViewSet from read_views"
    batch_argument = "views"
    flag = "--views"
    provides = ("input_views",)
    options = ("num_views",)
    upload_prompt = "upload the views (or take the example views), then press Generate"
    request_help = f"send multipart/form-data: {VIEWS_ASK}"
    upload_noun = "posed views"

    @property
    def upload(self) -> tuple[UploadField, ...]:
        """The view images (the main view first), their transforms.json, or their azimuths and field of view on
        upstream's rig (the defaults: ``pixal3d.models.views``, imported here, not with the table)."""
        from pixal3d.models.views import MAX_VIEWS, RIG_AZIMUTHS, RIG_FOV_DEG

        return (UploadField("views", "views (images; the main view first)", most=MAX_VIEWS, item="view",
                            ask=VIEWS_ASK, missing=NO_VIEWS, example="views_example/*.png"),
                UploadField("azimuths", "azimuths (degrees, one per view, in the views' order)", accepts=TEXT,
                            required=False, unit="degrees", default=", ".join(f"{a:g}" for a in RIG_AZIMUTHS)),
                UploadField("views_fov", "views' field of view (degrees)", accepts=NUMBER, required=False,
                            unit="degrees", default=RIG_FOV_DEG),
                UploadField("transforms", "or their transforms.json (its cameras instead of the azimuths)",
                            accepts=JSON_FILE, required=False))

    @property
    def upload_title(self) -> str:
        from pixal3d.models.views import RIG_FOV_DEG

        return ("# Pixal3D, staged: several views\nPosed views in (the main view first), one textured 3D mesh (GLB) "
                "out. Give each view's azimuth on upstream's rig (the cameras on a circle about the object, "
                f"{RIG_FOV_DEG:g}° field of view; 0, 90, 180, 270 for four) or upload their transforms.json.")

    def takes(self, config: Any, given: Collection[str] = ()) -> bool:
        return config.views is not None

    def stage_classes(self, config: Any) -> tuple[type, ...]:
        """The ``views`` stage in place of preprocess and camera, then the single-view cascade's."""
        from pipelines.views import ViewsStage

        from .image import IMAGE

        return (ViewsStage, *IMAGE.stage_classes(config)[2:])

    def adapt(self, stage: Any, config: Any) -> Any:
        """The features and flow stages read the posed views instead of the image and its camera."""
        from pipelines.flow_stage import IMAGE_SOURCE, on_views

        if any(f in stage.inputs for f in IMAGE_SOURCE):
            return on_views(stage, config.views.plan_views)
        return stage

    def check(self, value: Any, argument: str) -> None:
        """A views folder (a path) or a checked ``ViewSet``."""
        from pixal3d.models.views import ViewSet

        if not isinstance(value, (str, Path, ViewSet)):
            raise TypeError(f"{argument} must be a views folder (a path to a folder with a transforms.json) or a "
                            f"ViewSet, not {type(value).__name__}")

    def check_options(self, config: Any, options: Mapping[str, Any]) -> None:
        fov = options.get("fov")
        if fov is not None and not (isinstance(fov, Sequence) and all(f is None for f in fov)):
            raise ValueError("the views' cameras come from their transforms.json: drop fov")
        count = options.get("num_views")
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise ValueError(f"num_views must be an integer >= 1 or None, not {count!r}")

    def refuse_setting(self, name: str) -> str:
        if name == "fov":
            return ("a field of view does not apply to posed views: their cameras come from their transforms.json; "
                    "drop it")
        return super().refuse_setting(name)

    def refuse_other(self, config: Any, argument: str) -> str:
        return (f"{config.source or config.name} is a multi-view cascade: pass views=FOLDER (a folder with a "
                f"transforms.json), not an image; for one image use a single-view config such as 1024_cascade.yaml")

    def refuse_command(self, config: Any, given: Mapping[str, Sequence[Path]]) -> str | None:
        named = Path(config.source).name if config.source else config.name
        if given.get("image"):
            return (f"{named} takes posed views: pass --views DIR (a folder with a transforms.json), not images; for "
                    f"images use a single-view config (e.g. --config 1024_cascade)")
        if not given.get(self.name):
            return f"{named} takes posed views: pass --views DIR (a folder with a transforms.json)"
        return None

    def missing(self, config: Any) -> str | None:
        return self.refuse_other(config, "image")

    def default_name(self, source: Any, index: int) -> str:
        from pixal3d.models.views import view_name

        return view_name(source)

    def label(self, source: Any) -> str:
        return str(getattr(source, "folder", source))

    def open(self, source: Any, options: Mapping[str, Any]) -> Any:
        """transforms.json and every frame checked, once (``read_views``)."""
        from pixal3d.models.views import ViewSet, read_views

        count = options.get("num_views")
        if isinstance(source, ViewSet) and count is None:
            return source
        return read_views(getattr(source, "folder", source), count)

    def digest(self, source: Any) -> str:
        return source.digest()

    def provided(self, digest: str | None) -> dict[str, Any]:
        return {"input_views": digest}

    def state(self, source: Any, *, reads_input: bool) -> dict[str, Any]:
        return {"input_views": source}

    def refuse_upload(self, config: Any, other: InputKind | None) -> str:
        instead = "" if other is None else f", not {other.upload_noun}"
        return f"this server's config ({config.name}) takes {self.upload_noun}{instead}: {VIEWS_ASK}"

    def refuse_request(self, parts: Mapping[str, Any]) -> str | None:
        if parts.get("transforms") and (parts.get("azimuths") is not None or parts.get("views_fov") is not None):
            return "send 'transforms' or 'azimuths'/'views_fov', not both: transforms.json gives the cameras"
        return None

    def receive(self, parts: Mapping[str, Any], folder: Path, options: Mapping[str, Any]) -> Any:
        """The views folder ``folder/views`` (``write_views``: with the transforms.json, else the rig's cameras at
        the azimuths and field of view; the azimuths beside a transforms.json are ignored), checked as a run reads
        it (``read_views``: ``ViewsError``)."""
        from pixal3d.models.views import (
            RIG_FOV_DEG,
            ViewsError,
            read_views,
            write_views,
        )

        transforms = parts.get("transforms") or ()
        fov = parts.get("views_fov")
        if isinstance(fov, str):
            try:
                fov = float(fov) if fov.strip() else None
            except ValueError:
                raise ViewsError(f"views_fov {fov[:40]!r} is not a number of degrees; the rig's is "
                                 f"{RIG_FOV_DEG:g}") from None
        views = write_views(folder / "views", [(f.filename, f.read()) for f in parts.get("views") or ()],
                            transforms=transforms[0].read() if transforms else None,
                            azimuths=None if transforms else parts.get("azimuths"),
                            fov_deg=RIG_FOV_DEG if fov is None else fov)
        read_views(views, options.get("num_views"))
        return views

    def expand(self, paths: Sequence[Path]) -> list[Path]:
        """The views folders the command was given (``--views``): each an existing folder, their names (what the
        outputs are called) unique. (Each folder's ``transforms.json`` and frames are checked by ``probe``.)"""
        for path in paths:
            if not path.is_dir():
                raise UsageError(f"--views {path}: {'is a file, not a folder' if path.exists() else 'does not exist'}; "
                                 f"pass a folder holding transforms.json and the view images")
        names = [p.resolve().name for p in paths]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise UsageError(f"several views folders are named {duplicates}; their outputs would overwrite each other")
        return list(paths)

    def probe(self, path: Path, options: Mapping[str, Any]) -> Any:
        from pixal3d.models.views import read_views

        return read_views(path, options.get("num_views"))


VIEWS = ViewsInput()
