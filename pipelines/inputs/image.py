"""One image (a path, a PIL image or a uint8 array): the single-view cascade's input."""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from pixal3d.config import UsageError

from .kind import InputKind, UploadField

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
READABLE_IMAGES = "a path, a PIL image or a uint8 numpy array"
NO_IMAGE = "no image: upload a PNG, JPEG or WebP (an RGBA image's alpha marks the object), or pick the example"
ONE_IMAGE = ("this server's config ({config}) takes one image in the field 'image'; posed views need a server on a "
             "multi-view config (pixal3d-serve --config 1024_cascade_mv)")


class ImageInput(InputKind):
    """One image per run; its camera from the run's field of view, else the config's, else MoGe-2."""

    name = "image"
    argument = "image"
    noun = "image"
    readable = READABLE_IMAGES
    batch_argument = "images"
    provides = ("input_image",)
    options = ("fov",)
    upload = (UploadField("image", "image (RGBA: the alpha marks the object)", example="example.png",
                          ask="send the image file in the multipart field 'image'", missing=NO_IMAGE),)
    upload_title = ("# Pixal3D, staged\nOne image in, a textured 3D mesh (GLB) out — with the memory in view: the "
                    "plan before the run, memory per stage while it runs, and what each stage cost after.")
    upload_prompt = "upload an image (or pick the example), then press Generate"
    request_help = "send multipart/form-data with the image in field 'image' (and JSON in 'settings')"
    upload_noun = "one image"
    default_config = "1024_cascade.yaml"

    def takes(self, config: Any, given: Collection[str] = ()) -> bool:
        return config.views is None

    def stage_classes(self, config: Any) -> tuple[type, ...]:
        """The 1024 cascade: preprocess, camera, features, structure, shape 512, upsample, shape 1024, texture,
        decode, export."""
        from pipelines.camera import CameraStage
        from pipelines.decode import DecodeStage
        from pipelines.export import ExportStage
        from pipelines.features import FeaturesStage
        from pipelines.preprocess import PreprocessStage
        from pipelines.shape_512 import Shape512Stage
        from pipelines.shape_1024 import Shape1024Stage
        from pipelines.structure import StructureStage
        from pipelines.texture import TextureStage
        from pipelines.upsample import UpsampleStage

        return (PreprocessStage, CameraStage, FeaturesStage, StructureStage, Shape512Stage, UpsampleStage,
                Shape1024Stage, TextureStage, DecodeStage, ExportStage)

    def check(self, value: Any, argument: str) -> None:
        """A path, an open PIL image, or a uint8 array."""
        import numpy as np
        from PIL import Image

        if isinstance(value, (str, Path)):
            return
        if isinstance(value, Image.Image):
            try:  # without loading it: a huge image is refused later from its header, before its pixels are read
                value.im  # noqa: B018  (once closed, Pillow raises "Operation on closed image" on this access)
            except ValueError:
                raise ValueError(f"{argument} is a closed PIL image (its file was closed before the run); call run "
                                 f"before closing it, or pass its path") from None
            except AssertionError:  # opened lazily and not loaded yet (Pillow asserts it has pixels): still open
                pass
            return
        if isinstance(value, np.ndarray):
            if value.dtype != np.uint8:
                raise ValueError(f"{argument} is a {value.dtype} array; pass uint8 pixels (H x W x 3 or 4)")
            return
        raise TypeError(f"{argument} must be {READABLE_IMAGES}, not {type(value).__name__}")

    def refuse_option(self, config: Any, name: str) -> str:
        if name == "mesh_pose":
            return "mesh_pose goes with a mesh to texture: pass mesh= too, or drop mesh_pose"
        return (f"{config.source or config.name} takes one image: views= and num_views= need a multi-view config "
                f"(one with a 'views' section, e.g. 1024_cascade_mv.yaml)")

    def refuse_setting(self, name: str) -> str:
        if name == "num_views":
            return ("a number of views applies to a multi-view config (one with a views section, e.g. "
                    "1024_cascade_mv); this one takes images")
        if name == "mesh_pose":
            return "a mesh pose goes with a mesh to texture (--mesh, or an upload's mesh field); drop it"
        return super().refuse_setting(name)

    def refuse_other(self, config: Any, argument: str) -> str:
        """Another kind's argument given to a cascade of this kind."""
        return self.refuse_option(config, argument)

    def refuse_command(self, config: Any, given: Mapping[str, Sequence[Path]]) -> str | None:
        if given.get("views"):
            return (f"--views needs a multi-view config ({_named(config)} takes images): e.g. --config "
                    f"1024_cascade_mv, or pass images")
        if not given.get(self.name):
            return "no input: pass an image, a folder of images, or --views DIR"
        return None

    def open(self, source: Any, options: Mapping[str, Any]) -> Any:
        from pixal3d.models.preprocess import probe_image

        if isinstance(source, (str, Path)):
            probe_image(source)  # not an image, or too small: from its header
        return source

    def digest(self, source: Any) -> str:
        from pipelines.work_dir import input_digest

        return input_digest(source)

    def provided(self, digest: str | None) -> dict[str, Any]:
        return {"input_image": digest}

    def state(self, source: Any, *, reads_input: bool) -> dict[str, Any]:
        from pixal3d.models.preprocess import as_image

        return {"input_image": as_image(source) if reads_input else None}

    def upload_stem(self, parts: Mapping[str, Any]) -> str:
        """The uploaded file's name (``cup.png``: ``cup``)."""
        return Path(parts["image"][0].filename).stem or self.name

    def refuse_upload(self, config: Any, other: InputKind | None) -> str:
        return ONE_IMAGE.format(config=config.name)

    def receive(self, parts: Mapping[str, Any], folder: Path, options: Mapping[str, Any]) -> Any:
        """The web app's upload where it lies (the run checks it, as the command's); the server's written as
        ``input.<its format>``, byte for byte (checked from its header before)."""
        from pixal3d.files import write_bytes_atomic

        [image] = parts["image"]
        if image.path is not None:
            return str(image.path)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"input{image.suffix}"
        write_bytes_atomic(path, image.data)
        return path

    def expand(self, paths: Sequence[Path]) -> list[Path]:
        """Image files named directly, plus the images inside named folders (sorted; hidden files such as macOS's
        ``._cup.png`` AppleDouble companions and ``.DS_Store`` are not images and are skipped); checked to exist.
        (Whether each is a usable image is checked from its header by ``probe``.)"""
        found: list[Path] = []
        for path in paths:
            if path.is_dir():
                images = sorted(p for p in path.iterdir()
                                if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith(".") and p.is_file())
                if not images:
                    raise UsageError(f"folder {path} holds no images ({', '.join(IMAGE_SUFFIXES)})")
                found += images
            elif path.is_file():
                found.append(path)
            else:
                raise UsageError(f"input {path} does not exist")
        stems = [p.stem for p in found]
        duplicates = sorted({s for s in stems if stems.count(s) > 1})
        if duplicates:
            raise UsageError(f"several inputs are named {duplicates}; their outputs would overwrite each other")
        return found

    def probe(self, path: Path, options: Mapping[str, Any]) -> Any:
        from pixal3d.models.preprocess import probe_image

        probe_image(path)  # not an image, or too small: from the header, before any weight is read
        return path

    def several(self, paths: Sequence[Path]) -> bool:
        return len(paths) > 1 or any(p.is_dir() for p in paths)


def _named(config: Any) -> str:
    return Path(config.source).name if config.source else config.name


IMAGE = ImageInput()
