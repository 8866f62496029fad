"""Colour TIFFs of more than 8 bits per sample, read with tifffile (installed with scikit-image) instead of Pillow.

Why: Pillow has no colour mode of more than 8 bits per sample, and reads such TIFFs wrongly without saying so:

- an interleaved 16-bit RGB TIFF (``PlanarConfiguration`` 1) by each sample's high byte, so the factory's bit depth is
  ignored: a colour camera that writes 12 significant bits into 16-bit samples reads as 0..15 of 255, nearly black;
- a planar one (``PlanarConfiguration`` 2, each channel stored apart, as scientific and multi-spectral cameras write it)
  as 8-bit planes cut out of the 16-bit data: a red square reads as light grey;
- a float colour TIFF (``SampleFormat`` 3) not at all.

Here the samples are read as numbers and scaled as grey images of more bits are (`common.data.images`): unsigned
integers by ``2**bit_depth - 1``, floats taken as they are within [0, 1], anything else refused naming the file. An
alpha channel (``ExtraSamples`` 1 or 2) is composited onto white, as `common.data.images.flatten_alpha` does.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

TIFF_MAGIC = (b"II*\x00", b"MM\x00*")
RGB_PHOTOMETRIC = 2
SEPARATE_PLANES = 2
FLOAT_SAMPLES, UNSIGNED_SAMPLES = 3, 1
ALPHA_EXTRA_SAMPLES = {1: "associated", 2: "unassociated"}  # TIFF ExtraSamples: premultiplied, straight


class DeepColourError(ValueError):
    """A deep colour TIFF whose samples fit no known range, or that cannot be decoded; the message says why."""


def _is_tiff(source: Path | io.BytesIO) -> bool:
    if isinstance(source, io.BytesIO):
        head = source.getvalue()[:4]
    else:
        with open(source, "rb") as f:
            head = f.read(4)
    return head in TIFF_MAGIC


def read_deep_colour(source: Path | io.BytesIO, bit_depth: int, max_pixels: int) -> tuple[np.ndarray, int] | None:
    """``(rgb, orientation)`` for a colour TIFF of more than 8 bits per sample: float64 (H, W, 3) in [0, 1] as stored
    (transparency flattened onto white) and its ``Orientation`` tag (1-8); None for any other file, which Pillow reads.
    Raises `DeepColourError` for samples out of range or a file tifffile cannot decode."""
    if not _is_tiff(source):
        return None
    import tifffile

    if isinstance(source, io.BytesIO):
        source.seek(0)
    try:
        with tifffile.TiffFile(source) as tif:
            page = tif.pages[0]
            if not (page.photometric == RGB_PHOTOMETRIC and page.samplesperpixel >= 3 and page.bitspersample > 8):
                return None
            if page.imagelength * page.imagewidth > max_pixels:
                raise DeepColourError(f"{page.imagewidth}x{page.imagelength} pixels exceeds the {max_pixels} pixel limit")
            data = page.asarray()
            orientation_tag = page.tags.get("Orientation")
            orientation = int(orientation_tag.value) if orientation_tag is not None else 1
            extra = tuple(page.extrasamples)
            sample_format = int(page.sampleformat)
    except DeepColourError:
        raise
    except Exception:  # noqa: BLE001 - a TIFF tifffile cannot parse: Pillow reads it, or says why it cannot
        return None
    finally:
        if isinstance(source, io.BytesIO):
            source.seek(0)
    if page.planarconfig == SEPARATE_PLANES:
        data = np.moveaxis(data, 0, -1)
    values = _unit(np.asarray(data, dtype=np.float64), sample_format, data.dtype, bit_depth)
    rgb = values[..., :3]
    if extra and extra[0] in ALPHA_EXTRA_SAMPLES and values.shape[-1] > 3:
        rgb = _onto_white(rgb, values[..., 3], premultiplied=extra[0] == 1)
    return rgb, orientation


def _unit(values: np.ndarray, sample_format: int, dtype: np.dtype, bit_depth: int) -> np.ndarray:
    """Samples scaled into [0, 1] (the module doc), or `DeepColourError` saying which range they fit."""
    if not np.isfinite(values).all():
        raise DeepColourError("colour TIFF holds NaN or infinite samples")
    low, high = float(values.min()), float(values.max())
    if sample_format == FLOAT_SAMPLES:
        if low < 0.0 or high > 1.0:
            raise DeepColourError(f"float colour TIFF with sample values in [{low:g}, {high:g}]; expected [0, 1]")
        return values
    if sample_format != UNSIGNED_SAMPLES:
        raise DeepColourError(f"colour TIFF of signed {dtype} samples; expected unsigned integers or floats in [0, 1]")
    scale = float(2**bit_depth - 1)
    if high > scale:
        raise DeepColourError(f"colour TIFF with sample values up to {high:g}; expected {bit_depth}-bit (0..{scale:.0f})"
                              + ("; is it a camera's 16-bit image? then bit-depth is 16" if bit_depth < 16 and high <= 65535 else ""))
    return values / scale


def _onto_white(rgb: np.ndarray, alpha: np.ndarray, premultiplied: bool) -> np.ndarray:
    """``rgb`` composited onto white by ``alpha``; an alpha that hides every pixel is not meant as one (as
    `common.data.images.flatten_alpha`), so ``rgb`` is then returned as it is."""
    if not alpha.any():
        return rgb
    a = alpha[..., None]
    return (rgb if premultiplied else rgb * a) + (1.0 - a)
