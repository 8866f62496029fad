"""Embedded colour profiles applied to samples of more than 8 bits, in floating point.

Why not littlecms: Pillow's ImageCms transforms 8-bit images only, so a 16-bit colour TIFF exported in ProPhoto or
Adobe RGB (Lightroom's 16-bit TIFF export is ProPhoto by default) would have to be rounded to 8 bits first, or read with
its colours washed out, as `common.data.images.to_srgb` once found its 8-bit copies read. RGB profiles of cameras and
editors are matrix/TRC profiles: three tone curves (``rTRC``, ``gTRC``, ``bTRC``) to linear light and a 3 x 3 matrix
(``rXYZ``, ``gXYZ``, ``bXYZ``) to the D50 connection space. Converting one to sRGB is then exact arithmetic, done here
as littlecms does it for the relative colorimetric intent: decode by the source curves, through the source matrix and
the inverse of sRGB's (littlecms' own sRGB profile, the one `to_srgb` converts to), clip to the gamut, encode by sRGB's
curve. A profile of any other kind (lookup tables, another colour space) or one that does not parse gives None, and the
caller reads the samples as stored, as `to_srgb` does with a profile littlecms cannot use.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import numpy as np

HEADER = 128
CURVE_SAMPLES = 4096  # a tone curve's samples over [0, 1], interpolated linearly
INVERSE_SAMPLES = 65536  # its inverse's (encoding linear light to sRGB, steep near black)


@dataclass(frozen=True)
class MatrixShaper:
    """A matrix/TRC RGB profile: per-channel tone curves to linear light, then ``matrix`` (3 x 3, columns R, G, B) to XYZ."""

    curves: tuple[np.ndarray, np.ndarray, np.ndarray]  # each (CURVE_SAMPLES,): the curve at np.linspace(0, 1, CURVE_SAMPLES)
    matrix: np.ndarray

    def to_linear(self, planes: np.ndarray) -> np.ndarray:
        """Samples as planes (3, N) in [0, 1] -> linear light (3, N)."""
        return np.stack([_lookup(self.curves[c], planes[c]) for c in range(3)])

    @functools.cached_property
    def _inverses(self) -> tuple[np.ndarray, ...]:
        """Each curve's inverse at `INVERSE_SAMPLES` points of [0, 1] (a curve that rises, as every display curve does)."""
        grid, levels = np.linspace(0.0, 1.0, CURVE_SAMPLES), np.linspace(0.0, 1.0, INVERSE_SAMPLES)
        return tuple(np.interp(levels, curve, grid).astype(np.float32) for curve in self.curves)

    def from_linear(self, planes: np.ndarray) -> np.ndarray:
        """The inverse of `to_linear`."""
        return np.stack([_lookup(self._inverses[c], planes[c]) for c in range(3)])


def _lookup(table: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``table`` (samples of a function at uniform points of [0, 1]) at ``x`` in [0, 1], linearly interpolated: what
    ``np.interp`` gives on a uniform grid, several times faster on a frame of millions of samples."""
    n = len(table) - 1
    scaled = x * np.float32(n)
    i = np.minimum(scaled.astype(np.int32), n - 1)
    frac = scaled - i
    low = table[i]
    return low + (table[i + 1] - low) * frac


def _s15(raw: bytes) -> float:
    return struct.unpack(">i", raw)[0] / 65536.0


def _tags(data: bytes) -> dict[bytes, bytes]:
    (count,) = struct.unpack(">I", data[HEADER:HEADER + 4])
    tags = {}
    for i in range(count):
        signature, offset, size = struct.unpack(">4sII", data[HEADER + 4 + 12 * i:HEADER + 16 + 12 * i])
        if offset + size > len(data):
            raise ValueError(f"tag {signature!r} runs past the profile's end")
        tags[signature] = data[offset:offset + size]
    return tags


def _curve(tag: bytes) -> np.ndarray:
    """A ``curv`` or ``para`` tag sampled at `CURVE_SAMPLES` points of [0, 1] (ICC.1:2010, 10.6 and 10.18)."""
    x = np.linspace(0.0, 1.0, CURVE_SAMPLES)
    if tag[:4] == b"curv":
        (count,) = struct.unpack(">I", tag[8:12])
        if count == 0:
            return x
        if count == 1:
            return x ** (struct.unpack(">H", tag[12:14])[0] / 256.0)
        table = np.frombuffer(tag[12:12 + 2 * count], dtype=">u2").astype(np.float64) / 65535.0
        if len(table) != count:
            raise ValueError("curv table cut short")
        return np.interp(x, np.linspace(0.0, 1.0, count), table)
    if tag[:4] == b"para":
        (kind,) = struct.unpack(">H", tag[8:10])
        n = {0: 1, 1: 3, 2: 4, 3: 5, 4: 7}[kind]
        p = [_s15(tag[12 + 4 * i:16 + 4 * i]) for i in range(n)] + [0.0] * (7 - n)
        g, a, b, c, d, e, f = p
        if kind == 0:
            return x ** g
        if kind in (1, 2):
            base = a * x + b
            return np.where(x >= -b / a, np.maximum(base, 0.0) ** g, 0.0) + (c if kind == 2 else 0.0)
        shift = (e, f) if kind == 4 else (0.0, 0.0)
        return np.where(x >= d, np.maximum(a * x + b, 0.0) ** g + shift[0], c * x + shift[1])
    raise ValueError(f"tone curve of type {tag[:4]!r}")


def parse_matrix_shaper(data: bytes) -> MatrixShaper | None:
    """The matrix/TRC model of an RGB profile over the XYZ connection space; None for any other profile or bytes that do
    not parse (the module doc)."""
    try:
        if len(data) < HEADER + 4 or data[36:40] != b"acsp" or data[16:20] != b"RGB " or data[20:24] != b"XYZ ":
            return None
        tags = _tags(data)
        columns = []
        for name in (b"rXYZ", b"gXYZ", b"bXYZ"):
            tag = tags[name]
            if tag[:4] != b"XYZ ":
                return None
            columns.append([_s15(tag[8 + 4 * i:12 + 4 * i]) for i in range(3)])
        curves = tuple(np.clip(_curve(tags[name]), 0.0, None).astype(np.float32) for name in (b"rTRC", b"gTRC", b"bTRC"))
    except (KeyError, ValueError, struct.error, ZeroDivisionError):
        return None
    matrix = np.array(columns, dtype=np.float64).T
    if not np.isfinite(matrix).all() or abs(np.linalg.det(matrix)) < 1e-6 or any(not np.all(np.diff(c) >= 0) for c in curves):
        return None
    return MatrixShaper(curves, matrix)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=1)
def srgb_profile() -> object:
    """littlecms' own sRGB profile: what every embedded profile is converted to, by littlecms (8-bit images,
    `common.data.images.to_srgb`) and here."""
    from PIL import ImageCms

    return ImageCms.createProfile("sRGB")


@functools.lru_cache(maxsize=1)
def _srgb() -> MatrixShaper:
    """`srgb_profile` as a matrix/TRC model."""
    from PIL import ImageCms

    model = parse_matrix_shaper(ImageCms.ImageCmsProfile(srgb_profile()).tobytes())
    assert model is not None, "littlecms' sRGB profile is a matrix/TRC profile"
    return model


@functools.lru_cache(maxsize=16)
def _conversion(icc: bytes) -> tuple[MatrixShaper, np.ndarray] | None:
    """The source model and its matrix to sRGB's linear light, once per profile (a camera writes one into every file)."""
    source = parse_matrix_shaper(icc)
    if source is None:
        return None
    return source, np.linalg.solve(_srgb().matrix, source.matrix)


def matrix_shaper_to_srgb(rgb: np.ndarray, icc: bytes) -> np.ndarray | None:
    """Samples (float (..., 3) in [0, 1]) of the profile ``icc`` as sRGB, relative colorimetric, clipped to the gamut;
    None when ``icc`` is not a matrix/TRC RGB profile."""
    conversion = _conversion(icc)
    if conversion is None:
        return None
    source, to_srgb_linear = conversion
    planes = np.clip(np.moveaxis(rgb, -1, 0).reshape(3, -1), 0.0, 1.0).astype(np.float32)  # contiguous planes: fast lookups
    linear = np.clip(to_srgb_linear.astype(np.float32) @ source.to_linear(planes), 0.0, 1.0)
    return np.moveaxis(_srgb().from_linear(linear).reshape(3, *rgb.shape[:-1]), 0, -1).astype(rgb.dtype)
