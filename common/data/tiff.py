"""Colour TIFFs of more than 8 bits per sample, read with tifffile (installed with scikit-image) instead of Pillow.

Why: Pillow has no colour mode of more than 8 bits per sample, and reads such TIFFs wrongly without saying so:

- an interleaved 16-bit RGB TIFF (``PlanarConfiguration`` 1) by each sample's high byte, so the factory's bit depth is
  ignored: a colour camera that writes 12 significant bits into 16-bit samples reads as 0..15 of 255, nearly black;
- a planar one (``PlanarConfiguration`` 2, each channel stored apart, as scientific and multi-spectral cameras write it)
  as 8-bit planes cut out of the 16-bit data: a red square reads as light grey;
- a float colour TIFF (``SampleFormat`` 3) not at all;
- and of grey TIFFs, those of half- or double-precision floats (a 16- or 64-bit ``SampleFormat`` 3: HDR and scientific
  exports) and those of more than 8 bits with an alpha channel, not at all ("cannot identify image file"). Grey TIFFs
  Pillow reads (8, 16 and 32 bits, 32-bit floats) stay with Pillow, so their decoding does not change.

tifffile decompresses such a file itself only when stored uncompressed or by Deflate, PackBits or LZMA; LZW (the most
common: camera SDKs, ImageJ, Photoshop), JPEG and the rest it decodes with imagecodecs, a FedForge dependency. A deep page
it cannot decode is refused naming why, never handed to Pillow, which would misread it (`DeepColourError`).

Here the samples are read as numbers and scaled as grey images of more bits are (`common.data.images`): unsigned
integers by ``2**bit_depth - 1``, floats taken as they are within [0, 1], anything else refused naming the file. An
alpha channel (``ExtraSamples`` 1 or 2) is composited onto white, as `common.data.images.flatten_alpha` does, after the
colours are converted to sRGB by an embedded profile (`common.data.icc`).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TIFF_MAGIC = (b"II*\x00", b"MM\x00*")
MIN_IS_BLACK, RGB_PHOTOMETRIC = 1, 2
SEPARATE_PLANES = 2
FLOAT_SAMPLES, UNSIGNED_SAMPLES = 3, 1
ASSOCIATED_ALPHA, UNASSOCIATED_ALPHA = 1, 2  # TIFF ExtraSamples: premultiplied, straight
KINDS = {3: "colour", 1: "grey"}  # a page's kind by its colour samples, as messages name it
# Compression tags tifffile decodes without imagecodecs: none, Adobe Deflate, Deflate, PackBits, LZMA. A model recorded with
# a decoding from before every codec was read (`common.data.images.TIFF_CODECS_DECODE`) was fed Pillow's reading of the rest.
BUILTIN_COMPRESSIONS = frozenset({1, 8, 32946, 32773, 34925})


class DeepColourError(ValueError):
    """A deep colour TIFF that is too large or holds samples of no supported kind; the message says why."""


@dataclass(frozen=True)
class DeepColour:
    """A deep colour TIFF's first page as stored: its samples as numbers, not yet scaled (the caller scales them by the
    factory's bit depth, `common.data.images.unit_range`)."""

    samples: np.ndarray  # float64 (H, W, S): R, G, B (or one grey sample) and any extra samples
    floating: bool  # float samples (taken as they are within [0, 1]), else unsigned integers
    alpha: int  # ASSOCIATED_ALPHA, UNASSOCIATED_ALPHA, or 0: no alpha channel
    orientation: int  # the Orientation tag (1-8; 1 when absent)
    colours: int = 3  # 3: R, G, B; 1: grey
    icc: bytes = b""  # an RGB page's embedded colour profile (InterColorProfile), b"" when it has none

    @property
    def kind(self) -> str:
        return KINDS[self.colours]

    def flattened(self, unit: np.ndarray) -> np.ndarray:
        """The scaled samples ``unit`` (H, W, S) in [0, 1] as RGB (grey as three equal channels), an alpha channel
        composited onto white; an alpha that hides every pixel is not meant as one (as `common.data.images.flatten_alpha`),
        so such an image reads as its colours."""
        rgb = np.repeat(unit[..., :1], 3, axis=-1) if self.colours == 1 else unit[..., :3]
        if not self.alpha or not unit[..., self.colours].any():
            return rgb
        a = unit[..., self.colours:self.colours + 1]
        return (rgb if self.alpha == ASSOCIATED_ALPHA else rgb * a) + (1.0 - a)


def _is_tiff(source: Path | io.BytesIO) -> bool:
    if isinstance(source, io.BytesIO):
        head = bytes(source.getbuffer()[:4])  # not getvalue(): that copies the whole request
    else:
        with open(source, "rb") as f:
            head = f.read(4)
    return head in TIFF_MAGIC


def _read_here(photometric: int, samples: int, bits: int, sample_format: int) -> bool:
    """Whether a TIFF page is read here rather than by Pillow (the module doc): colour of more than 8 bits per sample, or a
    grey kind Pillow cannot open."""
    if photometric == RGB_PHOTOMETRIC:
        return samples >= 3 and bits > 8
    if photometric == MIN_IS_BLACK:
        return (sample_format == FLOAT_SAMPLES and (bits != 32 or samples > 1)) or (bits > 8 and samples > 1)
    return False


def _decoded(page: object, kind: str) -> np.ndarray:
    """A deep page's samples; raises `DeepColourError` naming its compression when tifffile cannot decode them (a codec
    missing, a damaged file): handing the file to Pillow would read it wrongly, or not at all."""
    try:
        return page.asarray()  # type: ignore[attr-defined]
    except Exception as exc:  # tifffile and its codecs raise many kinds; each means this file cannot be read
        how = getattr(page.compression, "name", str(page.compression))  # type: ignore[attr-defined]
        advice = "; install imagecodecs (pip install imagecodecs)" if "imagecodecs" in str(exc) else ""
        raise DeepColourError(f"{kind} TIFF of {page.bitspersample}-bit samples compressed by {how} cannot be decoded: "  # type: ignore[attr-defined]
                              f"{exc}{advice}") from exc


def _profile(page: object) -> bytes:
    """A page's embedded colour profile (the InterColorProfile tag, UNDEFINED as the TIFF spec says, or BYTE as some writers
    store it), b"" when it has none or one of no byte type."""
    tag = page.tags.get("InterColorProfile")  # type: ignore[attr-defined]
    value = tag.value if tag is not None else None
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, (tuple, np.ndarray)) and np.asarray(value).dtype.kind in "ui":
        return np.asarray(value).astype(np.uint8).tobytes()
    return b""


def read_deep_colour(source: Path | io.BytesIO, too_large: Callable[[int, int], str | None],
                     every_codec: bool = True) -> DeepColour | None:
    """The first page of a colour TIFF of more than 8 bits per sample, or of a grey TIFF Pillow cannot open (the module
    doc); None for any other file, which Pillow reads, and (``every_codec`` false: for a model recorded before) for a page
    compressed other than by `BUILTIN_COMPRESSIONS`.
    Raises `DeepColourError` with ``too_large(width, height)``'s message (the pixel limit every reader shares,
    `common.data.images.pixel_limit_error`) before decoding, or for samples that are neither unsigned nor float."""
    if not _is_tiff(source):
        return None
    import tifffile

    if isinstance(source, io.BytesIO):
        source.seek(0)
    try:
        with tifffile.TiffFile(source) as tif:
            page = tif.pages[0]
            if not _read_here(int(page.photometric), page.samplesperpixel, page.bitspersample, int(page.sampleformat)):
                return None
            colours = 3 if page.photometric == RGB_PHOTOMETRIC else 1
            kind = KINDS[colours]
            compression = int(page.compression)
            if not every_codec and compression not in BUILTIN_COMPRESSIONS:
                return None
            error = too_large(page.imagewidth, page.imagelength)
            if error:
                raise DeepColourError(error)
            data = _decoded(page, kind)
            icc = _profile(page) if colours == 3 else b""
            orientation_tag = page.tags.get("Orientation")
            orientation = int(orientation_tag.value) if orientation_tag is not None else 1
            extra = tuple(page.extrasamples)
            sample_format = int(page.sampleformat)
            planar = page.planarconfig == SEPARATE_PLANES
    except DeepColourError:
        raise
    except Exception:  # noqa: BLE001 - a TIFF tifffile cannot parse: Pillow reads it, or says why it cannot
        return None
    finally:
        if isinstance(source, io.BytesIO):
            source.seek(0)
    if sample_format not in (FLOAT_SAMPLES, UNSIGNED_SAMPLES):
        raise DeepColourError(f"{kind} TIFF of signed {data.dtype} samples; expected unsigned integers or floats in [0, 1]")
    if planar and data.ndim == 3:
        data = np.moveaxis(data, 0, -1)
    if data.ndim == 2:
        data = data[..., None]
    if data.ndim != 3:
        raise DeepColourError(f"{kind} TIFF page of shape {data.shape}; expected height x width x samples")
    alpha = extra[0] if extra and extra[0] in (ASSOCIATED_ALPHA, UNASSOCIATED_ALPHA) and data.shape[-1] > colours else 0
    return DeepColour(np.asarray(data, dtype=np.float64), sample_format == FLOAT_SAMPLES, alpha, orientation, colours, icc)
