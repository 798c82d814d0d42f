"""Posed views (a folder with a ``transforms.json``, upstream's ``inference_mv.py``): the multi-view cascade's input.

The ``views`` stage takes the place of preprocess and camera, and the features and flow stages read the posed views
instead of the image and its camera (``flow_stage.on_views``); the rest of the cascade is the single-view one.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from pixal3d.config import UsageError

from .kind import InputKind, UploadField


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
    upload = (UploadField("views", "views (images; the main view first)", many=True),
              UploadField("transforms", "transforms.json", required=False),
              UploadField("azimuths", "azimuths (degrees, one per view, in the views' order)", file=False,
                          required=False),
              UploadField("views_fov", "views' field of view (degrees)", file=False, required=False))

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
