"""Turning an image file (any format Pillow reads, any size, grey or colour) into model input.

Every site uses this one function, so a factory's training images, the server's test and proxy sets
and an inspection station's request are resized the same way:

- **Letterbox, never crop.** The longer side is scaled to ``size`` (bilinear, aspect ratio kept) and
  the shorter side is padded, centred, with the image's own mean colour. A crop could cut away the
  defect an image is labelled for; padding with the mean leaves per-image statistics nearly as they
  were. Square images are simply resized.
- **Strips are folded first** (`fold_strip`). A frame at least `STRIP_FOLD` (2.5) times as long as it is wide, as a
  line-scan camera writes, is cut along its length into k near-square pieces (k: its aspect ratio, rounded), laid out
  row by row on a grid of ceil(sqrt(k)) columns (cells left over in the strip's mean colour), and that mosaic is
  letterboxed. Letterboxed alone, a 4:1 strip fills a quarter of the model's input and a defect keeps a quarter of
  the pixels it would have in the mosaic; nothing is cropped either way. On a held-out data set with one factory's
  2048 x 512 line-scan strips, folding raised that factory's own model from 0.74 to 0.91 (docs/benchmarks.md).
- **Transparency is flattened onto white** (`flatten_alpha`). A background-removed cut-out (RGBA, LA, or a palette
  or grey PNG with a transparent colour) keeps some colour under its transparent pixels, and which one depends on the
  tool that wrote it: black, white, or the original background. Pillow's ``convert`` drops the alpha channel and shows
  that hidden colour, so one factory's cut-outs read on three backgrounds. Composited onto white (what a document or a
  light viewer shows), every copy of a cut-out reads alike whatever lies under its transparent pixels; an opaque
  image is unchanged. On a held-out data set with one factory's cut-outs, that factory's own model gained 1 to 2 of
  its 80 test images and the global model 1.5 points (docs/benchmarks.md).
- **Channels.** ``channels=1`` converts to 8-bit grey (ITU-R 601 luma), ``channels=3`` to RGB (a grey
  image is replicated into three equal channels).
- **Bit depth.** 8-bit images (and palette, bilevel, CMYK...) go through Pillow's conversion. Grey images of
  more bits, as industrial cameras write them, are scaled by their container's range: 16-bit (``I;16``, and
  ``I`` with values within 0..65535) by 65535, float (``F``) taken as it is when within [0, 1]. Pillow's own
  ``convert("L")`` clips such pixels at 255, which turns a 16-bit image white; values outside those ranges are
  refused naming the file, never guessed (a 32-bit unsigned TIFF, which Pillow reads into its signed ``I``, by its
  true range). A camera that writes 12 significant bits into the low bits of a 16-bit
  container (Mono12 as 0..4095) sets ``bit_depth`` 12 (``fedforge client --bit-depth 12``, the run's ``data-bit-depth``
  for the central site's folders): its images are then scaled by 4095, and a pixel above it is refused. Left at 16, such
  images read dark (0..0.06), which cost 10 points of global accuracy on a held-out data set (docs/benchmarks.md).
- **Large JPEGs** are decoded at a reduced scale (`JPEG_DRAFT`, in the DCT domain: 1/2, 1/4 or 1/8), never below
  twice ``size`` on either side, then resized as above: a 6-megapixel photograph decodes about 5x faster
  (`bench/data_loading.py --photos`), and the
  pixels ``size`` keeps are averaged from the same area of the photograph.
- **A pixel limit on what is decoded** (`MAX_PIXELS`, 256 Mpx; 64 for more than 8 bits per sample and for an inspection
  request), counted after a JPEG's reduction: a high-resolution camera's JPEGs are read however large, a PNG or TIFF
  over the limit is refused naming the file. Pillow's own check, on a file's nominal size, is off (`_pillow`).
- **Colour TIFFs of more than 8 bits per sample** (16-bit or float RGB, interleaved or planar) are read with tifffile
  (`common.data.tiff`) and scaled like grey images of more bits, by ``bit_depth`` for integer samples. Pillow reads
  such files by each sample's high byte, ignoring the bit depth (12-bit colour reads nearly black), reads planar ones
  as garbage (a red square as light grey) and cannot open float ones. Letterboxed and folded as floats, channel by
  channel. A 16-bit colour PNG, which Pillow reads by the high byte too, is refused when ``bit_depth`` is below 16.
- **Embedded colour profiles are applied** (`to_srgb`): an RGB image that carries an ICC profile (a camera set to
  Adobe RGB, a photographer's ProPhoto export, a phone's Display P3) is converted from it to sRGB
  (relative colorimetric, littlecms through Pillow's ImageCms), as a colour-managed viewer shows it. Read as stored, an
  Adobe RGB or ProPhoto file's colours come out washed out, so one factory's parts would read paler than the same parts
  elsewhere. An image without a profile is taken as sRGB, and one whose profile cannot be used (malformed, or for
  another colour space than its pixels') is read as stored; grey and CMYK images (Pillow's conversion, as before) and
  samples of more than 8 bits are not converted.
- **EXIF orientation** is applied (`upright`): a camera or phone that stores a portrait photograph as landscape pixels
  plus an orientation tag is read the way every viewer shows it, so a factory's training photos, an export that has
  already rotated them, and an inspection station's request all read alike. A file whose EXIF block cannot be
  parsed is read as stored (its pixels are fine; the tag is not).
- Values are float32 in [0, 1], shape (channels, size, size).
"""

from __future__ import annotations

import functools
import hashlib
import io
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from common.data import tiff
from common.data.icc import matrix_shaper_to_srgb, srgb_profile

SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".jfif", ".jpe", ".bmp", ".dib", ".tif", ".tiff", ".webp", ".gif", ".pgm", ".ppm",
                      ".pbm", ".pnm", ".jp2", ".j2k", ".avif", ".tga"})
# Image formats met in factories' folders that Pillow cannot read (phones' HEIF, cameras' raw files, vector drawings, industrial
# radiography's DICOM/DICONDE, JPEG XR): a file of one of these is named as not read (`common.data.folder.unread_files`), with
# what to convert it to, never silently dropped.
UNREAD_IMAGE_SUFFIXES = frozenset({".heic", ".heif", ".dng", ".cr2", ".cr3", ".nef", ".arw", ".orf", ".rw2", ".raf", ".raw", ".svg",
                                   ".psd", ".exr", ".jxl", ".dcm", ".dicom", ".jxr", ".wdp", ".hdp"})
# How files become arrays here, for caches keyed by a file's bytes (`common.features.content_keys`): bump it when decoding
# changes what an encoded file decodes to. 2: large JPEGs decoded at a reduced scale (`JPEG_DRAFT`); 3: EXIF orientation
# applied (`upright`); 4: line-scan strips folded (`fold_strip`); 5: transparency flattened onto white (`flatten_alpha`);
# 6: colour TIFFs of more than 8 bits per sample read by tifffile (`common.data.tiff`); 7: embedded colour profiles applied
# (`to_srgb`); 8: deep TIFFs of every compression (LZW, JPEG...) read by tifffile with imagecodecs (`common.data.tiff`);
# 9: deep colour TIFFs' embedded profiles applied too (`common.data.icc`).
DECODE_VERSION = 9
STRIP_FOLD = 2.5  # a frame this many times as long as it is wide, or more, is folded into a mosaic (`fold_strip`)
FOLDING_DECODE = 4  # the first decoding that folds strips: a model version recorded with an older one is fed them unfolded
FLATTENING_DECODE = 5  # the first that flattens transparency: an older version is fed the colour under transparent pixels
DEEP_COLOUR_DECODE = 6  # the first that reads deep colour TIFFs by tifffile: an older version is fed Pillow's 8-bit reading
COLOUR_MANAGED_DECODE = 7  # the first that applies embedded colour profiles: an older version is fed the stored values
TIFF_CODECS_DECODE = 8  # the first that decodes deep TIFFs of every codec: an older version is fed Pillow's reading of an LZW one
DEEP_COLOUR_MANAGED_DECODE = 9  # the first that applies a deep colour TIFF's profile: an older version is fed its stored values
ICC_MODES = {"RGB": "RGB", "RGBA": "RGBA"}  # modes whose embedded profile is applied, and the mode they become
DEEP_PNG_RAWMODES = frozenset({"RGB;16B", "RGBA;16B", "LA;16B"})  # 16-bit colour (and grey + alpha) PNGs, read by Pillow's high byte
ALPHA_BACKGROUND = (255, 255, 255)  # what transparent pixels show (`flatten_alpha`)
ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
JPEG_DRAFT = 2  # a JPEG is decoded at the smallest DCT scale that keeps both sides >= JPEG_DRAFT x size
# The most pixels one image may decode to (larger ones are refused naming the file: decompression bombs, and memory), checked
# after a JPEG's DCT-domain reduction (`JPEG_DRAFT`), so a 151-megapixel camera's JPEGs decode at 1/8 (2.4 Mpx, 55 MB, 0.24 s)
# where the check on the nominal size refused them: 256 Mpx is a 16k line-scan camera's square frame, 1 GB in memory as RGB.
MAX_PIXELS = 256_000_000
MAX_DEEP_PIXELS = 64_000_000  # images of more than 8 bits per sample are scaled as floats (8 bytes a sample): a quarter
MAX_REQUEST_PIXELS = 64_000_000  # an inspection request's image: its bytes are capped, but 8 MB of PNG can hold far more pixels
CHANNELS = (1, 3)


def folds(decoding: int) -> bool:
    """Whether images read for a model trained at ``decoding`` (its version's record; `DECODE_VERSION` today) fold strips."""
    return decoding >= FOLDING_DECODE


def flattens(decoding: int) -> bool:
    """Whether images read for a model trained at ``decoding`` have their transparency flattened (`flatten_alpha`)."""
    return decoding >= FLATTENING_DECODE


def manages_colour(decoding: int) -> bool:
    """Whether images read for a model trained at ``decoding`` have their embedded colour profile applied (`to_srgb`)."""
    return decoding >= COLOUR_MANAGED_DECODE


def manages_deep_colour(decoding: int) -> bool:
    """Whether images read for a model trained at ``decoding`` have a deep colour TIFF's profile applied (`common.data.icc`)."""
    return decoding >= DEEP_COLOUR_MANAGED_DECODE


def reads_every_tiff_codec(decoding: int) -> bool:
    """Whether images read for a model trained at ``decoding`` read deep TIFFs compressed by LZW, JPEG... by tifffile."""
    return decoding >= TIFF_CODECS_DECODE


def reads_deep_colour(decoding: int) -> bool:
    """Whether images read for a model trained at ``decoding`` read deep colour TIFFs by tifffile (`common.data.tiff`)."""
    return decoding >= DEEP_COLOUR_DECODE


class ImageError(ValueError):
    """An image that cannot be decoded (truncated, not an image, too large); the message says why."""


def _mode(channels: int) -> str:
    if channels not in CHANNELS:
        raise ValueError(f"channels must be 1 (grey) or 3 (RGB), got {channels}")
    return "L" if channels == 1 else "RGB"


HIGH_DEPTH_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I", "F"})
DEFAULT_BIT_DEPTH = 16  # significant bits of a grey image of more than 8 bits (the module doc)


def check_bit_depth(bit_depth: int) -> int:
    """``bit_depth`` if it is 8..16 (the significant bits of a 16-bit container), else `ValueError` naming it."""
    if not isinstance(bit_depth, int) or not 8 <= bit_depth <= 16:
        raise ValueError(f"bit-depth must be an integer from 8 to 16 (the significant bits of 16-bit grey images), got {bit_depth!r}")
    return bit_depth


def unit_range(values: np.ndarray, floating: bool, bit_depth: int, what: str) -> np.ndarray:
    """Samples of more than 8 bits (float64) scaled into [0, 1]: floats taken as they are within [0, 1], integers by the
    range of ``bit_depth`` bits; raises `ImageError` naming ``what`` for values that fit no known range (the module doc)."""
    if not np.isfinite(values).all():
        raise ImageError(f"{what} holds NaN or infinite pixels")
    low, high = float(values.min()), float(values.max())
    if floating:
        if low < 0.0 or high > 1.0:
            raise ImageError(f"{what} with pixel values in [{low:g}, {high:g}]; expected [0, 1]")
        return values
    scale = float(2**bit_depth - 1)
    if low < 0.0 or high > scale:
        raise ImageError(f"{what} with pixel values in [{low:g}, {high:g}]; expected {bit_depth}-bit (0..{scale:.0f})"
                         + ("; is it a camera's 16-bit image? then bit-depth is 16" if bit_depth < 16 and high <= 65535 else ""))
    return values / scale


def _unit_grey(img: object, bit_depth: int = DEFAULT_BIT_DEPTH) -> object:
    """A grey image of more than 8 bits (``HIGH_DEPTH_MODES``) as a float image (mode ``F``) in [0, 1] (`unit_range`)."""
    from PIL import Image

    assert isinstance(img, Image.Image)
    values = np.asarray(img, dtype=np.float64)  # every 16-bit byte order and I/F read as numbers
    floating = img.mode == "F"
    unit = unit_range(values, floating, bit_depth, "float (F) image" if floating else f"{img.mode} image")
    return Image.fromarray(unit.astype(np.float32), mode="F")


def to_array(img: object, size: int, channels: int, bit_depth: int = DEFAULT_BIT_DEPTH, decoding: int = DECODE_VERSION) -> np.ndarray:
    """A decoded PIL image -> float32 (channels, size, size) in [0, 1], read as a model trained at ``decoding`` reads it:
    converted to sRGB by its colour profile (`manages_colour`), transparency flattened (`flattens`), a strip folded (`folds`),
    then letterboxed (see the module doc)."""
    from PIL import Image

    assert isinstance(img, Image.Image)
    mode, fold = _mode(channels), folds(decoding)
    if img.mode in HIGH_DEPTH_MODES:  # more than 8 bits: letterboxed as floats, never rounded to 8 bits
        grey = np.clip(np.asarray(_fit(_unit_grey(img, bit_depth), size, fold), dtype=np.float32), 0.0, 1.0)[None]
        return grey if channels == 1 else np.repeat(grey, 3, axis=0)
    if manages_colour(decoding):
        img = to_srgb(img)
    if flattens(decoding):
        img = flatten_alpha(img)
    array = np.asarray(_fit(img.convert(mode), size, fold), dtype=np.float32) / 255.0
    return array[None] if channels == 1 else np.ascontiguousarray(array.transpose(2, 0, 1))


def to_srgb(img: object) -> object:
    """``img`` converted from its embedded ICC profile to sRGB when it is RGB or RGBA and carries one; any other image, and
    one whose profile cannot be used, as it is (why: the module doc)."""
    from PIL import Image

    assert isinstance(img, Image.Image)
    icc = img.info.get("icc_profile")
    if not icc or img.mode not in ICC_MODES:
        return img
    transform = _srgb_transform(bytes(icc), img.mode)
    if transform is None:
        return img
    from PIL import ImageCms

    return ImageCms.applyTransform(img, transform)


@functools.lru_cache(maxsize=16)
def _srgb_transform(icc: bytes, mode: str) -> object | None:
    """The transform from the profile ``icc`` to sRGB for images of ``mode``, built once per profile (a factory's camera
    writes the same one into every file); None when littlecms cannot use it. Built without littlecms' one-pixel cache
    (``NOCACHE``), so one transform may serve the decoding threads of inspection and training at once."""
    from PIL import ImageCms

    try:
        source = ImageCms.ImageCmsProfile(io.BytesIO(icc))
        return ImageCms.buildTransform(source, srgb_profile(), mode, ICC_MODES[mode], ImageCms.Intent.RELATIVE_COLORIMETRIC,
                                       flags=ImageCms.Flags.NOCACHE)
    except (ImageCms.PyCMSError, OSError, ValueError, TypeError):
        return None


def flatten_alpha(img: object) -> object:
    """``img`` composited onto `ALPHA_BACKGROUND` if it has transparency (an alpha channel, or a palette, grey or RGB
    image with a transparent colour), as RGB; any other image as it is. Why: the module doc. An alpha channel that hides
    every pixel is not meant as one (a viewer would show nothing to label; some tools write a zero fourth channel): such
    an image is read as its colours, as before flattening."""
    from PIL import Image

    assert isinstance(img, Image.Image)
    if img.mode not in ALPHA_MODES and not (img.mode in ("P", "L", "RGB") and "transparency" in img.info):
        return img
    rgba = img.convert("RGBA")
    if rgba.getchannel("A").getextrema() == (0, 0):
        return img
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (*ALPHA_BACKGROUND, 255)), rgba).convert("RGB")


def _fit(img: object, size: int, fold: bool) -> object:
    """``img`` (mode L, RGB or F) as the model's square input: folded if it is a strip (and ``fold``), then letterboxed."""
    return _letterbox(fold_strip(img) if fold else img, size)


def _letterbox(img: object, size: int) -> object:
    """``img`` (mode L, RGB or F) scaled so that its longer side is ``size``, centred on a square of its own mean colour."""
    from PIL import Image

    assert isinstance(img, Image.Image)
    w, h = img.size
    if w == h:
        return img.resize((size, size), Image.BILINEAR)
    scale = size / max(w, h)
    nw, nh = max(1, round(w * scale)), max(1, round(h * scale))
    resized = img.resize((nw, nh), Image.BILINEAR)
    out = Image.new(img.mode, (size, size), _mean_colour(resized))
    out.paste(resized, ((size - nw) // 2, (size - nh) // 2))
    return out


def _mean_colour(img: object) -> float | int | tuple[int, ...]:
    """``img``'s mean pixel as Pillow fills with it in ``img``'s mode (L, RGB or F)."""
    assert hasattr(img, "mode")
    mean = np.asarray(img, dtype=np.float64).reshape(-1, 1 if img.mode in ("L", "F") else 3).mean(axis=0)
    if img.mode == "F":
        return float(mean[0])
    return round(float(mean[0])) if img.mode == "L" else tuple(round(float(m)) for m in mean)


def fold_strip(img: object) -> object:
    """A strip (its long side at least `STRIP_FOLD` times its short side) as a near-square mosaic of its pieces; any
    other image as it is (see the module doc). Each piece keeps its orientation and pixels; piece i of k sits at row
    i // cols, column i % cols, so the strip reads left to right (top to bottom for a tall one), row after row."""
    from PIL import Image

    assert isinstance(img, Image.Image)
    w, h = img.size
    long_side, short_side = max(w, h), min(w, h)
    if long_side < STRIP_FOLD * short_side:
        return img
    k = int(long_side / short_side + 0.5)
    cols = math.ceil(math.sqrt(k))
    rows = math.ceil(k / cols)
    step = math.ceil(long_side / k)  # each piece's length along the strip (the last may be shorter)
    wide = w >= h
    cell_w, cell_h = (step, h) if wide else (w, step)
    out = Image.new(img.mode, (cols * cell_w, rows * cell_h), _mean_colour(img))
    for i in range(k):
        start, end = i * step, min(long_side, (i + 1) * step)
        piece = img.crop((start, 0, end, h) if wide else (0, start, w, end))
        out.paste(piece, ((i % cols) * cell_w, (i // cols) * cell_h))
    return out


EXIF_ORIENTATION = 0x0112  # also TIFF's Orientation tag (274)


def _orientation_transposes() -> dict[int, object]:
    from PIL import Image

    t = Image.Transpose
    return {2: t.FLIP_LEFT_RIGHT, 3: t.ROTATE_180, 4: t.FLIP_TOP_BOTTOM, 5: t.TRANSPOSE, 6: t.ROTATE_270, 7: t.TRANSVERSE,
            8: t.ROTATE_90}  # what `PIL.ImageOps.exif_transpose` does for each orientation


ORIENTATION_TRANSPOSE = _orientation_transposes()


def upright(img: object) -> object:
    """``img`` turned as its EXIF orientation tag says (1-8; any other value, or an unreadable EXIF block, leaves it as
    stored): what an image viewer shows, and what the person who labelled the photograph saw."""
    from PIL import Image, ImageOps

    assert isinstance(img, Image.Image)
    try:
        orientation = img.getexif().get(EXIF_ORIENTATION, 1)
    except Exception:  # noqa: BLE001 - Pillow's EXIF parser raises many kinds on a malformed block; the pixels are still good
        return img
    if orientation not in range(2, 9):
        return img
    return ImageOps.exif_transpose(img)


@functools.cache
def _pillow() -> object:
    """Pillow's ``Image`` module with its own decompression-bomb check off: it judges a file by its nominal size at open
    (warning over 89 Mpx, refusing over 179), where `_decode` judges the pixels it will decode, after a JPEG's reduction
    (`check_pixels`). Every image FedForge decodes goes through `_decode`."""
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = None
    return Image


def pixel_limit_error(width: int, height: int, deep: bool, max_pixels: int) -> str | None:
    """Why an image of ``width`` x ``height`` pixels (``deep``: more than 8 bits per sample, limited to `MAX_DEEP_PIXELS`
    at most) would decode to too many pixels for ``max_pixels``; None when it would not. One message for every reader."""
    limit = min(max_pixels, MAX_DEEP_PIXELS) if deep else max_pixels
    if width * height <= limit:
        return None
    what = "more than 8 bits per sample" if deep else "8 bits per sample"
    return (f"{width}x{height} pixels exceeds the {limit:,} pixel limit for images of {what}"
            + ("" if max_pixels < MAX_PIXELS else "; scale such images down, or cut them into tiles, before training"))


def check_pixels(img: object, name: str, max_pixels: int) -> None:
    """Refuse an opened (not yet loaded) image that would decode to more than ``max_pixels`` (`pixel_limit_error`), naming it."""
    width, height = img.size  # type: ignore[attr-defined]
    error = pixel_limit_error(width, height, img.mode in HIGH_DEPTH_MODES, max_pixels)  # type: ignore[attr-defined]
    if error:
        raise ImageError(f"{name}: {error}")


def _decode(source: object, size: int, channels: int, name: str, bit_depth: int, decoding: int = DECODE_VERSION,
            max_pixels: int | None = None) -> np.ndarray:
    """One encoded image -> float32 (channels, size, size) (the module doc); ``max_pixels``: `MAX_PIXELS` unless given."""
    from PIL import UnidentifiedImageError

    Image = _pillow()
    max_pixels = MAX_PIXELS if max_pixels is None else max_pixels
    check_bit_depth(bit_depth)
    try:
        if reads_deep_colour(decoding):
            try:
                too_large = functools.partial(pixel_limit_error, deep=True, max_pixels=max_pixels)
                deep = tiff.read_deep_colour(source, too_large, reads_every_tiff_codec(decoding))  # type: ignore[arg-type]
                if deep is not None:
                    what = f"float {deep.kind} TIFF" if deep.floating else f"{deep.kind} TIFF"
                    unit = unit_range(deep.samples, deep.floating, bit_depth, what)
                    srgb = matrix_shaper_to_srgb(unit[..., :3], deep.icc) if deep.icc and manages_deep_colour(decoding) else None
                    if srgb is not None:  # its profile applied (a profile of another kind: the samples as stored, as `to_srgb`)
                        unit = np.concatenate([srgb, unit[..., 3:]], axis=-1)
                    return deep_colour_to_array(deep.flattened(unit), deep.orientation, size, channels, decoding)
            except (tiff.DeepColourError, ImageError) as exc:
                raise ImageError(f"{name}: {exc}") from exc
        with Image.open(source) as img:  # type: ignore[arg-type,attr-defined]
            if img.format == "JPEG":
                img.draft(img.mode, (JPEG_DRAFT * size, JPEG_DRAFT * size))  # see the module doc: the same on every site
            check_pixels(img, name, max_pixels)
            if reads_deep_colour(decoding) and bit_depth < 16 and img.format == "PNG" and _rawmode(img) in DEEP_PNG_RAWMODES:
                raise ImageError(f"{name}: a 16-bit colour PNG cannot be read at bit-depth {bit_depth} (Pillow reads it by each "
                                 "sample's high byte, as 16 significant bits): save it as a TIFF, or set bit-depth 16")
            unsigned_32 = _is_unsigned_32(_rawmode(img))
            img.load()  # raises on truncated files (LOAD_TRUNCATED_IMAGES stays off)
            try:
                if unsigned_32:
                    _check_unsigned_32(img, bit_depth)
                return to_array(upright(img), size, channels, bit_depth, decoding)
            except ImageError as exc:
                raise ImageError(f"{name}: {exc}") from exc
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"{name}: cannot decode image: {exc}") from exc


def _rawmode(img: object) -> str:
    """How Pillow will unpack an image's first tile (before ``load``), e.g. ``RGB;16B`` (a PNG) or ``I;32N`` (a TIFF's
    ``(rawmode, ...)``); "" when it does not say."""
    tiles = getattr(img, "tile", None) or []
    args = tiles[0].args if tiles else None
    if isinstance(args, tuple) and args:
        args = args[0]
    return args if isinstance(args, str) else ""


def _is_unsigned_32(rawmode: str) -> bool:
    """Whether Pillow unpacks 32-bit *unsigned* grey samples (``I;32``, ``I;32N``, ``I;32B``...) into its signed mode ``I``,
    where a value of 2**31 or more reads as a negative number."""
    return rawmode.startswith("I;32") and not rawmode.endswith("S")


def _check_unsigned_32(img: object, bit_depth: int) -> None:
    """Refuse a 32-bit unsigned grey image whose values Pillow read as negative, by its true range (`unit_range`'s message),
    not by the wrapped one; smaller values read as they are."""
    values = np.asarray(img)
    if values.dtype == np.int32 and values.size and int(values.min()) < 0:
        unit_range(values.view(np.uint32).astype(np.float64), False, bit_depth, "32-bit unsigned grey image")


def deep_colour_to_array(rgb: np.ndarray, orientation: int, size: int, channels: int, decoding: int = DECODE_VERSION) -> np.ndarray:
    """A deep colour image (float (H, W, 3) in [0, 1], `common.data.tiff`) and its orientation tag as model input, channel by
    channel as mode-F images so that no sample is rounded to 8 bits: turned (`upright`), folded if a strip, letterboxed.
    Grey is ITU-R 601 luma, as Pillow's ``convert("L")``."""
    from PIL import Image

    planes = [rgb @ np.array([0.299, 0.587, 0.114])] if channels == 1 else [rgb[..., c] for c in range(3)]
    transpose = ORIENTATION_TRANSPOSE.get(orientation)
    out = []
    for plane in planes:
        img = Image.fromarray(np.ascontiguousarray(plane, dtype=np.float32), mode="F")
        img = img.transpose(transpose) if transpose is not None else img
        out.append(np.asarray(_fit(img, size, folds(decoding)), dtype=np.float32))
    return np.clip(np.stack(out), 0.0, 1.0)


def read_image(path: str | Path, size: int, channels: int = 1, bit_depth: int = DEFAULT_BIT_DEPTH) -> np.ndarray:
    """One image file as float32 (channels, size, size); raises `ImageError` naming the file."""
    return _decode(Path(path), size, channels, str(path), bit_depth)


def decode_image_bytes(data: bytes, size: int, channels: int = 1, max_bytes: int = 8 << 20, bit_depth: int = DEFAULT_BIT_DEPTH,
                       decoding: int = DECODE_VERSION) -> np.ndarray:
    """Encoded image bytes (an inspection request) -> float32 (channels, size, size), read as a model trained at
    ``decoding`` (its version's record) was trained: strips unfolded for a model from before `FOLDING_DECODE`, transparency
    left to Pillow's ``convert`` for one from before `FLATTENING_DECODE`."""
    if not data:
        raise ImageError("empty image")
    if len(data) > max_bytes:
        raise ImageError(f"image of {len(data)} bytes exceeds the {max_bytes} byte limit")
    return _decode(io.BytesIO(data), size, channels, "image", bit_depth, decoding, MAX_REQUEST_PIXELS)


COLOUR_CHROMA = 0.02  # median mean chroma above which images count as colour (grey images saved as RGB PNG or JPEG: 0)


def median_chroma(paths: Sequence[Path], sample: int = 32) -> float:
    """The median over up to ``sample`` of ``paths`` (a fixed choice: the first by the SHA-256 of the path) of each image's
    mean chroma (max - min over R, G, B at 32 px) in [0, 1]; unreadable images are skipped (loading names them)."""
    chosen = sorted(paths, key=lambda p: hashlib.sha256(Path(p).as_posix().encode()).hexdigest())[:sample]
    values = []
    for path in chosen:
        try:
            rgb = read_image(path, 32, channels=3)
        except ImageError:
            continue
        values.append(float((rgb.max(axis=0) - rgb.min(axis=0)).mean()))
    return float(np.median(values)) if values else 0.0


def grey_to_channels(images: np.ndarray, channels: int) -> np.ndarray:
    """Generated grey images (N, 1, H, W) as ``channels`` channels (replicated for RGB)."""
    _mode(channels)
    return images if channels == images.shape[1] else np.repeat(images[:, :1], channels, axis=1)
