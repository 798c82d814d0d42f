"""Input image: load and validate it, remove the background, crop around the object, composite on black.

``load_image`` turns any file Pillow reads into an upright RGB or RGBA image, or raises ``ImageError``
with what is wrong and what to do: not an image, truncated, too small, too large to decode. EXIF
orientation is applied (an unreadable EXIF block is ignored with a warning: it is metadata, the pixels are
fine); grayscale, palette, 1-bit, LA, 16-bit and CMYK inputs are converted, then very large images are
reduced (very large JPEGs are already decoded at a reduced scale, ``Image.draft``). ``require_alpha`` says,
before any weight is read, that an image cannot be used without a background remover.

``preprocess_image`` is the reference ``preprocess_image`` (Pixal3D): alpha used as is when the RGBA image
has any transparency, otherwise a background remover (rembg, BiRefNet family) makes it; then downscale to
max side 1024 (LANCZOS), bbox of alpha > 0.8·255, square crop of ``int(1.1 · max side)`` around its centre
(transparent padding outside), composite on black in float32, truncate to uint8.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from PIL import Image, UnidentifiedImageError

logger = logging.getLogger(__name__)

MIN_SIDE = 16
"""Smallest accepted width/height in pixels."""
MAX_SIDE = 1024
"""The reference downscales the input to this max side before anything else."""
LARGE_SIDE = 4096
"""Images with a longer side are reduced at load time to at least ``REDUCED_SIDE`` (not bit-exact to the
reference, which decodes everything; below this size loading is exact)."""
REDUCED_SIDE = 2048
MAX_DECODE_PIXELS = 12_000 * 12_000
"""Non-JPEG images above this many pixels are refused: Pillow must decode them whole."""
DEFAULT_REMBG_MODEL = "birefnet-general"

_pixel_limit_lock = threading.Lock()


class ImageError(ValueError):
    """The input image cannot be used; the message says why and what to do."""


class MaskSession(Protocol):
    """What a rembg session offers: ``predict(image) -> [mask (mode L), ...]``."""

    def predict(self, img: Image.Image, *args: Any, **kwargs: Any) -> list[Image.Image]: ...


# -- loading ----------------------------------------------------------------------------------
def load_image(path: str | Path) -> Image.Image:
    """Open, validate and normalise an image file to an upright ``RGB`` or ``RGBA`` PIL image."""
    path = Path(path)
    if not path.is_file():
        raise ImageError(f"input image {path} does not exist (or is not a file); check the path")
    with _decompression_limit_lifted():
        try:
            image = Image.open(path)
        except UnidentifiedImageError:
            raise ImageError(f"{path} is not an image Pillow can read; pass a PNG, JPEG or WebP file") from None
        except (OSError, SyntaxError, ValueError) as err:
            raise ImageError(f"{path} cannot be opened as an image ({err}); re-export it as PNG") from None
        _check_size(image.size, str(path))
        width, height = image.size
        if image.format == "JPEG" and max(width, height) > LARGE_SIDE:
            scale = REDUCED_SIDE / max(width, height)
            image.draft(image.mode, (max(1, int(width * scale)), max(1, int(height * scale))))
            logger.info("%s is %dx%d: decoding the JPEG at reduced scale %s", path, width, height, image.size)
        elif width * height > MAX_DECODE_PIXELS:
            raise ImageError(f"{path} is {width}x{height} ({width * height / 1e6:.0f} MP); images over "
                             f"{MAX_DECODE_PIXELS / 1e6:.0f} MP are only accepted as JPEG (decoded at reduced scale); "
                             f"downscale it to at most {LARGE_SIDE} px first")
        try:
            image.load()
        except (OSError, SyntaxError, ValueError, EOFError) as err:
            raise ImageError(f"{path} is truncated or corrupt ({err}); re-export or re-download it") from None
    return normalize_image(image, str(path))


# EXIF orientation (tag 0x0112) → the transpose that shows the image upright (as ImageOps.exif_transpose).
ORIENTATION_TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
                         4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
                         6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_90}


def normalize_image(image: Image.Image, name: str = "the image") -> Image.Image:
    """A decoded image as every run sees it: RGB or RGBA, large ones reduced, EXIF orientation applied.

    The mode is converted before the reduction: ``Image.reduce`` refuses palette, 1-bit and 16-bit modes
    (and averaging palette indices would be meaningless anyway)."""
    _check_size(image.size, name)
    transpose = _orientation(image, name)  # read first: a conversion drops some formats' EXIF
    image = to_rgb_or_rgba(image)
    if max(image.size) > LARGE_SIDE:
        factor = max(image.size) // REDUCED_SIDE
        image = image.reduce(factor)
        logger.info("%s reduced by %d to %s before any other work", name, factor, image.size)
    return image.transpose(transpose) if transpose is not None else image


def _orientation(image: Image.Image, name: str) -> Image.Transpose | None:
    """The transpose the EXIF orientation asks for; ``None`` when there is none or the EXIF is unreadable."""
    try:
        orientation = image.getexif().get(0x0112)
    except Exception as err:  # noqa: BLE001 -- Pillow's EXIF parser raises SyntaxError, struct.error, ValueError, ...
        logger.warning("%s: its EXIF block cannot be read (%s: %s); the image is used as stored, without "
                       "applying an orientation", name, type(err).__name__, err)
        return None
    return ORIENTATION_TRANSPOSE.get(orientation)


def as_image(image: Any) -> Image.Image:
    """The run's input as an upright RGB/RGBA PIL image: a path (``load_image``), a PIL image, or a uint8
    array ``[H, W]``, ``[H, W, 3]`` or ``[H, W, 4]`` (RGBA: alpha marks the object)."""
    if isinstance(image, (str, Path)):
        return load_image(image)
    if isinstance(image, Image.Image):
        return normalize_image(image, "the input image")
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (3, 4)):
            raise ImageError(f"an image array must be uint8 [H, W], [H, W, 3] or [H, W, 4]; got {image.dtype} "
                             f"{list(image.shape)}")
        mode = "L" if image.ndim == 2 else ("RGB" if image.shape[2] == 3 else "RGBA")
        return normalize_image(Image.fromarray(np.ascontiguousarray(image), mode=mode), "the input array")
    raise ImageError(f"the input must be a path, a PIL image or a uint8 array, not {type(image).__name__}")


def probe_image(path: str | Path) -> tuple[int, int]:
    """Check that ``path`` is an image Pillow can open and large enough, reading only its header; returns
    its size. Decoding (``load_image``) happens when the run needs the pixels."""
    path = Path(path)
    if not path.is_file():
        raise ImageError(f"input image {path} does not exist (or is not a file); check the path")
    with _decompression_limit_lifted():
        try:
            with Image.open(path) as image:
                size = image.size
        except UnidentifiedImageError:
            raise ImageError(f"{path} is not an image Pillow can read; pass a PNG, JPEG or WebP file") from None
        except (OSError, SyntaxError, ValueError) as err:
            raise ImageError(f"{path} cannot be opened as an image ({err}); re-export it as PNG") from None
    _check_size(size, str(path))
    return size


@contextmanager
def _decompression_limit_lifted() -> Iterator[None]:
    """Pillow refuses files over ~179 MP at open; our own limits (above) apply instead, restored after."""
    with _pixel_limit_lock:
        saved = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = None
        try:
            yield
        finally:
            Image.MAX_IMAGE_PIXELS = saved


def _check_size(size: tuple[int, int], name: str) -> None:
    if min(size) < MIN_SIDE:
        raise ImageError(f"{name} is {size[0]}x{size[1]} pixels; at least {MIN_SIDE}x{MIN_SIDE} is needed "
                         f"to see an object")


def to_rgb_or_rgba(image: Image.Image) -> Image.Image:
    """Convert any Pillow mode to ``RGB`` (no alpha) or ``RGBA`` (alpha kept); 16-bit gray is scaled, not clipped.

    A PNG's ``tRNS`` chunk (a transparent palette entry, gray level or RGB colour) is an alpha channel too."""
    mode = image.mode
    if mode in ("LA", "La", "PA", "RGBa") or (mode in ("1", "L", "P", "RGB") and "transparency" in image.info):
        return image.convert("RGBA")
    if mode in ("RGB", "RGBA"):
        return image
    if mode.startswith("I"):  # 16-bit PNG gray ("I;16*") or 32-bit int holding 16-bit values
        values = np.asarray(image, dtype=np.float64)
        gray = np.clip(np.round(values / 257.0), 0, 255).astype(np.uint8)
        return Image.fromarray(gray, mode="L").convert("RGB")
    if mode == "F":
        return Image.fromarray(np.clip(np.asarray(image), 0, 255).astype(np.uint8), mode="L").convert("RGB")
    return image.convert("RGB")  # 1, L, P, CMYK, YCbCr, LAB, HSV


ALPHA_MODES = ("RGBA", "LA", "La", "PA", "RGBa")
NEEDS_ALPHA_ADVICE = ("and this config has no background remover (weights.rembg: null, as in the offline demo); "
                      "pass a PNG whose alpha channel marks the object (a transparent background), or use a "
                      "config with a remover (configs/1024_cascade.yaml: weights.rembg: birefnet-general)")


def require_alpha(image: str | Path | Image.Image, name: str | None = None) -> None:
    """``ImageError`` unless ``image`` (a path or a PIL image) has an alpha channel with some transparency:
    what a run without a background remover needs. A path is judged from its header when its mode has no
    alpha at all, and decoded only when it may."""
    if isinstance(image, (str, Path)):
        name = name or str(image)
        with _decompression_limit_lifted(), Image.open(image) as header:
            mode, maybe = header.mode, header.mode in ALPHA_MODES or "transparency" in header.info
        if not maybe:
            raise ImageError(f"{name} has no alpha channel (mode {mode}), {NEEDS_ALPHA_ADVICE}")
        image = load_image(image)
    name = name or "the image"
    if image.mode not in ALPHA_MODES and "transparency" not in image.info:
        raise ImageError(f"{name} has no alpha channel (mode {image.mode}), {NEEDS_ALPHA_ADVICE}")
    if not has_transparency(to_rgb_or_rgba(image)):
        raise ImageError(f"{name} has an alpha channel but it is fully opaque, so it does not mark the object, "
                         f"{NEEDS_ALPHA_ADVICE}")


# -- background removal -----------------------------------------------------------------------
class BackgroundRemover:
    """rembg matting (BiRefNet family by default). The rembg session is created on first use; tests inject one."""

    def __init__(self, model_name: str = DEFAULT_REMBG_MODEL, session: MaskSession | None = None):
        self.model_name = model_name
        self._session = session

    @property
    def session(self) -> MaskSession:
        if self._session is None:
            # heavy (onnxruntime), so imported on first use; rembg downloads and caches its own model
            from rembg import new_session

            self._session = new_session(self.model_name)
        return self._session

    def __call__(self, image: Image.Image) -> Image.Image:
        """``RGBA`` copy of an ``RGB`` image with the predicted foreground mask as alpha."""
        masks = self.session.predict(image)
        if not masks:
            raise RuntimeError(f"rembg model {self.model_name!r} returned no mask")
        mask = masks[0].convert("L")
        if mask.size != image.size:
            mask = mask.resize(image.size, Image.BICUBIC)
        output = image.convert("RGB")
        output.putalpha(mask)
        return output


def load_background_remover(model_name: str = DEFAULT_REMBG_MODEL) -> BackgroundRemover:
    """The ``rembg`` stage model (its session, and any model download, happen on first use)."""
    return BackgroundRemover(model_name)


# -- the reference preprocessing ----------------------------------------------------------------
def has_transparency(image: Image.Image) -> bool:
    """An ``RGBA`` image whose alpha is not all 255: the alpha is used as the object mask."""
    return image.mode == "RGBA" and image.getchannel("A").getextrema()[0] < 255


def preprocess_image(image: Image.Image, remover: BackgroundRemover | None = None, *,
                     bg_color: tuple[int, int, int] = (0, 0, 0)) -> Image.Image:
    """Object-centred square ``RGB`` image: mask (alpha or ``remover``), crop ×1.1 around the object, composite."""
    _check_size(image.size, "the input image")
    image = to_rgb_or_rgba(image)
    use_alpha = has_transparency(image)
    # 1. Downscale to max side 1024 (int truncation of the new size, as the reference).
    scale = min(1.0, MAX_SIDE / max(image.size))
    if scale < 1.0:
        image = image.resize((int(image.width * scale), int(image.height * scale)), Image.LANCZOS)
    # 2. Object mask.
    if use_alpha:
        output = image
    elif remover is None:
        raise ImageError("the image has no transparency, so background removal is needed: pass a remover "
                         "(load_background_remover()) or an RGBA image whose alpha marks the object")
    else:
        output = remover(image.convert("RGB"))
    alpha = np.asarray(output.getchannel("A"))
    # 3. Square crop around the bbox of alpha > 0.8*255, 1.1× its longer side.
    found = np.argwhere(alpha > 0.8 * 255)
    if found.size == 0:
        source = "the image's alpha" if use_alpha else "background removal"
        raise ImageError(f"no object found: {source} leaves no pixel above 80% opacity; pass an image with a "
                         f"clearly visible object (or a correct alpha mask)")
    left, top, right, bottom = found[:, 1].min(), found[:, 0].min(), found[:, 1].max(), found[:, 0].max()
    centre = ((left + right) / 2, (top + bottom) / 2)
    size = int(max(right - left, bottom - top) * 1.1)
    half = size // 2
    if half < 1:
        raise ImageError(f"the object is only {right - left + 1}x{bottom - top + 1} pixels; pass an image in which "
                         f"the object is clearly visible")
    cropped = output.crop((centre[0] - half, centre[1] - half, centre[0] + half, centre[1] + half))
    # 4. Composite on the background in float32, truncate to uint8.
    pixels = np.asarray(cropped, dtype=np.float32) / 255
    rgb, a = pixels[:, :, :3], pixels[:, :, 3:4]
    background = np.asarray(bg_color, dtype=np.float32) / 255
    composite = rgb * a + background * (1 - a)
    return Image.fromarray((np.clip(composite, 0, 1) * 255).astype(np.uint8))
