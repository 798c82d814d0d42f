"""Preprocess: alpha passthrough, injected rembg session, hand-computed crop/composite, every bad image."""
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from pixal3d.models.preprocess import (
    BackgroundRemover,
    ImageError,
    load_image,
    preprocess_image,
    to_rgb_or_rgba,
)


class FakeSession:
    """A rembg-like session: the mask is a fixed rectangle in relative coordinates; records its inputs."""

    def __init__(self, box=(0.3, 0.25, 0.6, 0.5)):
        self.box = box
        self.seen = []

    def predict(self, img):
        self.seen.append((img.mode, img.size))
        mask = np.zeros((img.height, img.width), np.uint8)
        x0, y0, x1, y1 = (int(v * s) for v, s in zip(self.box, (img.width, img.height) * 2))
        mask[y0:y1, x0:x1] = 255
        return [Image.fromarray(mask, mode="L")]


def rgba_scene() -> Image.Image:
    """100x80: opaque (200, 100, 50) object at rows 20..39, cols 30..59; half-transparent strip below it."""
    pixels = np.zeros((80, 100, 4), np.uint8)
    pixels[..., :3] = (200, 100, 50)
    pixels[20:40, 30:60, 3] = 255
    pixels[40:43, 30:60, 3] = 128  # below the 0.8·255 threshold: not part of the bbox, but composited
    return Image.fromarray(pixels, mode="RGBA")


def test_alpha_passthrough_matches_hand_computed_crop_and_composite():
    out = preprocess_image(rgba_scene(), remover=None)
    # bbox cols 30..59, rows 20..39 -> centre (44.5, 29.5), size int(29*1.1) = 31, half 15
    # crop box (29.5, 14.5, 59.5, 44.5) -> Pillow rounds half to even: (30, 14, 60, 44) -> 30x30
    expected = np.zeros((30, 30, 3), np.uint8)
    expected[6:26, 0:30] = (200, 100, 50)
    strip = np.floor(np.float32(np.float32([200, 100, 50]) / 255) * np.float32(128 / 255) * 255)
    expected[26:29, 0:30] = strip.astype(np.uint8)  # float32 composite, truncated
    assert out.mode == "RGB" and out.size == (30, 30)
    assert np.array_equal(np.asarray(out), expected)


def test_crop_beyond_the_border_pads_with_black():
    pixels = np.zeros((64, 64, 4), np.uint8)
    pixels[:, :, :3] = 255
    pixels[0:30, 0:64, 3] = 255  # object touches the top border: the square crop extends above it
    out = np.asarray(preprocess_image(Image.fromarray(pixels, mode="RGBA")))
    assert out.shape == (68, 68, 3)  # int(63 * 1.1) = 69 -> half 34 -> 68
    assert out[:5].max() == 0 and out[20, 20].tolist() == [255, 255, 255]


def test_rembg_path_uses_the_injected_session_on_the_downscaled_rgb():
    session = FakeSession()
    image = Image.new("RGB", (2000, 1000), (10, 200, 30))
    out = preprocess_image(image, BackgroundRemover(session=session))
    assert session.seen == [("RGB", (1024, 512))]  # downscaled to max side 1024 before removal
    # mask cols 307..613, rows 128..255 -> size int(306 * 1.1) = 336
    assert out.size == (336, 336)
    centre = np.asarray(out)[168, 168]
    assert centre.tolist() == [10, 200, 30]


def test_opaque_rgba_goes_through_background_removal():
    session = FakeSession()
    preprocess_image(Image.new("RGBA", (64, 64), (1, 2, 3, 255)), BackgroundRemover(session=session))
    assert session.seen == [("RGB", (64, 64))]
    with pytest.raises(ValueError, match="background removal is needed"):
        preprocess_image(Image.new("RGBA", (64, 64), (1, 2, 3, 255)), None)


def test_fully_transparent_image_has_nothing_to_model():
    with pytest.raises(ImageError, match="no object found.*alpha"):
        preprocess_image(Image.new("RGBA", (64, 64), (255, 0, 0, 0)))


def test_empty_mask_from_background_removal_is_an_image_error():
    with pytest.raises(ImageError, match="no object found: background removal"):
        preprocess_image(Image.new("RGB", (64, 64)), BackgroundRemover(session=FakeSession((0, 0, 0, 0))))


# -- bad files --------------------------------------------------------------------------------
def save(image: Image.Image, path, **kwargs):
    image.save(path, **kwargs)
    return path


def png_bytes(width: int, height: int, rows=None) -> bytes:
    """A grayscale PNG written chunk by chunk (no image in memory); ``rows`` of zeros are streamed."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    packer = zlib.compressobj(1)
    row = b"\x00" * (width + 1)
    data = b"".join(packer.compress(row * 1000) for _ in range((rows if rows is not None else height) // 1000))
    data += packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")


def huge_gray_jpeg(side: int) -> bytes:
    """A baseline gray JPEG of side×side mid-gray pixels without building the image: every 8x8 block is
    'DC diff 0 (00), EOB (1010)' in the standard Huffman tables, so 4 blocks pack into 3 bytes."""
    template = io.BytesIO()
    Image.new("L", (16, 16), 128).save(template, "JPEG", quality=90)
    data = template.getvalue()
    sof = data.index(b"\xff\xc0")
    data = data[:sof + 5] + struct.pack(">HH", side, side) + data[sof + 9:]
    sos = data.index(b"\xff\xda")
    scan_start = sos + 2 + struct.unpack(">H", data[sos + 2:sos + 4])[0]
    blocks = (side // 8) ** 2
    assert blocks % 4 == 0
    return data[:scan_start] + b"\x28\xa2\x8a" * (blocks // 4) + b"\xff\xd9"


def test_not_an_image(tmp_path):
    (tmp_path / "notes.png").write_text("hello")
    with pytest.raises(ImageError, match="not an image"):
        load_image(tmp_path / "notes.png")
    with pytest.raises(ImageError, match="does not exist"):
        load_image(tmp_path / "missing.png")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_file(tmp_path, fmt):
    rng = np.random.default_rng(0)
    full = save(Image.fromarray(rng.integers(0, 255, (64, 64, 3), np.uint8)), tmp_path / f"full.{fmt.lower()}")
    cut = tmp_path / f"cut.{fmt.lower()}"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    with pytest.raises(ImageError, match="truncated or corrupt"):
        load_image(cut)


def test_zero_by_zero_png_is_an_image_error(tmp_path):
    path = tmp_path / "empty.png"
    path.write_bytes(png_bytes(0, 0, rows=0))
    with pytest.raises(ImageError, match="cannot be opened|not an image|at least 16x16"):
        load_image(path)


def test_one_pixel_image_is_too_small(tmp_path):
    with pytest.raises(ImageError, match="is 1x1 pixels; at least 16x16"):
        load_image(save(Image.new("RGB", (1, 1)), tmp_path / "one.png"))
    with pytest.raises(ImageError, match="at least 16x16"):
        preprocess_image(Image.new("RGBA", (1, 1), (255, 255, 255, 128)))


@pytest.mark.parametrize("mode, expected_mode", [("L", "RGB"), ("P", "RGB"), ("LA", "RGBA"), ("I;16", "RGB")])
def test_modes_are_normalised(tmp_path, mode, expected_mode):
    if mode == "I;16":
        values = np.full((32, 32), 65535 // 2, np.uint16)
        image = Image.fromarray(values)
    elif mode == "LA":
        image = Image.new("LA", (32, 32), (90, 100))
    else:
        image = Image.new(mode, (32, 32), 77)
    loaded = load_image(save(image, tmp_path / "m.png"))
    assert loaded.mode == expected_mode
    if mode == "I;16":
        assert np.asarray(loaded)[0, 0].tolist() == [127, 127, 127]  # scaled by 1/257, not clipped to 255
    if mode == "LA":
        assert np.asarray(loaded)[0, 0].tolist() == [90, 90, 90, 100]


def test_palette_with_transparency_keeps_alpha(tmp_path):
    image = Image.new("P", (32, 32), 1)
    image.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    image.info["transparency"] = 0
    image.paste(0, (0, 0, 16, 32))
    loaded = load_image(save(image, tmp_path / "p.png", transparency=0))
    assert loaded.mode == "RGBA"
    assert np.asarray(loaded)[0, 0, 3] == 0 and np.asarray(loaded)[0, 20].tolist() == [255, 0, 0, 255]


@pytest.mark.parametrize("mode, key", [("RGB", (0, 0, 0)), ("L", 0)])
def test_a_png_tRNS_colour_key_is_an_alpha_channel(tmp_path, mode, key):
    """An RGB or gray PNG whose tRNS chunk marks one colour transparent: that colour is the background."""
    from pixal3d.models.preprocess import require_alpha

    pixels = np.zeros((64, 64, 3), np.uint8)
    pixels[16:48, 16:48] = 200
    image = Image.fromarray(pixels if mode == "RGB" else pixels[..., 0], mode)
    path = save(image, tmp_path / "key.png", transparency=key)
    loaded = load_image(path)
    assert loaded.mode == "RGBA"
    alpha = np.asarray(loaded)[..., 3]
    assert alpha[0, 0] == 0 and alpha[32, 32] == 255 and int((alpha == 255).sum()) == 32 * 32
    require_alpha(path)  # the offline demo takes it: its alpha marks the object
    with pytest.raises(ImageError, match="no alpha channel"):  # control: the same pixels without tRNS
        require_alpha(save(image, tmp_path / "opaque.png"))


def test_cmyk_jpeg_becomes_rgb(tmp_path):
    loaded = load_image(save(Image.new("CMYK", (32, 32), (0, 255, 255, 0)), tmp_path / "c.jpg", quality=95))
    assert loaded.mode == "RGB"
    r, g, b = np.asarray(loaded)[16, 16].tolist()
    assert r > 240 and g < 15 and b < 15


def test_exif_rotation_is_applied(tmp_path):
    pixels = np.zeros((20, 40, 3), np.uint8)
    pixels[:, :20] = (255, 0, 0)
    pixels[:, 20:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    loaded = load_image(save(Image.fromarray(pixels), tmp_path / "r.jpg", exif=exif, quality=95))
    assert loaded.size == (20, 40)
    top, bottom = np.asarray(loaded)[5, 10], np.asarray(loaded)[35, 10]
    assert top[0] > 200 and top[2] < 50 and bottom[2] > 200 and bottom[0] < 50


def test_huge_jpeg_is_decoded_at_reduced_scale(tmp_path):
    path = tmp_path / "huge.jpg"
    path.write_bytes(huge_gray_jpeg(20000))
    saved_limit = Image.MAX_IMAGE_PIXELS
    loaded = load_image(path)
    assert loaded.size == (2500, 2500)  # DCT-domain 1/8 decode: 25 MB instead of 400 MB
    assert loaded.mode == "RGB" and abs(int(np.asarray(loaded)[1000, 1000, 0]) - 128) <= 1
    assert Image.MAX_IMAGE_PIXELS == saved_limit


def test_huge_png_is_refused_before_decoding(tmp_path):
    path = tmp_path / "huge.png"
    path.write_bytes(png_bytes(20000, 20000, rows=1000))  # the header is enough: nothing is decoded
    with pytest.raises(ImageError, match="20000x20000 .*downscale"):
        load_image(path)


def test_wide_png_is_reduced_after_decoding(tmp_path):
    path = tmp_path / "wide.png"
    save(Image.new("RGB", (5000, 64), (5, 6, 7)), path)
    loaded = load_image(path)
    assert loaded.size == (2500, 32) and np.asarray(loaded)[0, 0].tolist() == [5, 6, 7]


def test_to_rgb_or_rgba_keeps_rgb_and_rgba_untouched():
    image = Image.new("RGBA", (4, 4))
    assert to_rgb_or_rgba(image) is image


# -- issue 16: large palette / 1-bit / 16-bit images, garbage EXIF, a clear "needs alpha" check -----------
@pytest.mark.parametrize("mode", ["P", "P+transparency", "1", "I;16"])
def test_large_images_in_any_mode_are_reduced_after_conversion(tmp_path, mode):
    side = 5000
    if mode == "I;16":
        image = Image.fromarray(np.full((64, side), 40000, np.uint16))
    elif mode == "1":
        image = Image.new("1", (side, 64), 1)
    else:
        image = Image.new("RGB", (side, 64), (200, 20, 20)).quantize(16)
    kwargs = {"transparency": 0} if mode == "P+transparency" else {}
    loaded = load_image(save(image, tmp_path / "big.png", **kwargs))
    assert loaded.size == (2500, 32) and loaded.mode == ("RGBA" if mode == "P+transparency" else "RGB")
    expected = {"P": [200, 20, 20], "1": [255, 255, 255], "I;16": [156, 156, 156]}.get(mode)
    if expected is not None:
        assert np.asarray(loaded)[10, 10].tolist() == expected


@pytest.mark.parametrize("fmt", ["png", "webp"])
def test_a_garbage_exif_block_is_ignored_with_a_warning(tmp_path, fmt, caplog):
    path = tmp_path / f"x.{fmt}"
    pixels = np.zeros((20, 40, 4), np.uint8)
    pixels[:, :20] = (255, 0, 0, 255)
    Image.fromarray(pixels).save(path, exif=b"Exif\x00\x00this is not a TIFF header at all", lossless=True)
    with caplog.at_level("WARNING"):
        loaded = load_image(path)
    assert loaded.size == (40, 20) and np.asarray(loaded)[5, 5].tolist() == [255, 0, 0, 255]
    assert "EXIF" in caplog.text and str(path) in caplog.text


def test_orientation_matches_pillows_exif_transpose_for_every_value(tmp_path):
    from PIL import ImageOps

    from pixal3d.models.preprocess import normalize_image

    pixels = np.arange(20 * 40 * 3, dtype=np.uint32).reshape(20, 40, 3).astype(np.uint8)
    for orientation in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = orientation
        path = save(Image.fromarray(pixels), tmp_path / f"o{orientation}.png", exif=exif)
        with Image.open(path) as reference_source:
            reference = ImageOps.exif_transpose(reference_source)
            assert np.array_equal(np.asarray(normalize_image(Image.open(path))), np.asarray(reference)), orientation


@pytest.mark.parametrize("image, reason", [
    (Image.new("RGB", (64, 64), (1, 2, 3)), "has no alpha channel"),
    (Image.new("RGBA", (64, 64), (1, 2, 3, 255)), "fully opaque"),
])
def test_check_alpha_says_why_and_what_to_do(image, reason):
    from pixal3d.models.preprocess import require_alpha

    with pytest.raises(ImageError) as info:
        require_alpha(image, "cup.jpg")
    message = str(info.value)
    assert "cup.jpg" in message and reason in message and "weights.rembg" in message
    require_alpha(Image.new("RGBA", (64, 64), (1, 2, 3, 0)), "clear.png")  # any transparency will do
