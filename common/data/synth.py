"""Synthetic industrial surface-defect images.

No industrial defect data set can be downloaded on the machines FedForge is built and tested on, so
`common` generates its own: textures are crops of real photographs shipped inside scikit-image
(brick, gravel, grass) or procedural surfaces (brushed metal, cast, woven fabric) made from
anisotropic 1/f^beta noise; defects are point clouds (scratch segments, branching cracks, inclusion
specks, pitting clusters, stain blobs) splatted and blurred in the FFT domain; then each factory's
optics add its own lighting gradient, vignette, defocus, gain and sensor noise.

Everything is deterministic in ``seed``: the same call returns the same bytes on any machine.
This is data, not cryptography, so numpy's PCG64 generator is the right tool here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

CLASSES: tuple[str, ...] = ("ok", "scratch", "crack", "inclusion", "stain", "pit")
TEXTURES: tuple[str, ...] = ("metal", "cast", "woven", "brick", "gravel", "grass")
DEFAULT_SIZE = 64


def rng_for(seed: int, *stream: int) -> np.random.Generator:
    """A generator for one named stream of a seed, independent of every other stream."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), *map(int, stream)]))


@dataclass(frozen=True)
class FactoryProfile:
    """What makes one factory's images look unlike another's (domain shift)."""

    texture_weights: tuple[float, ...]
    light_gradient: float
    vignette: float
    gain: float
    offset: float
    noise_sigma: float
    defocus_sigma: float
    texture_contrast: float


def factory_profile(seed: int, factory_index: int) -> FactoryProfile:
    """The material mix and optics of factory ``factory_index`` (deterministic in ``seed``)."""
    rng = rng_for(seed, 1, factory_index)
    weights = rng.dirichlet(np.full(len(TEXTURES), 0.6))
    return FactoryProfile(
        texture_weights=tuple(float(w) for w in weights),
        light_gradient=float(rng.uniform(0.0, 0.25)),
        vignette=float(rng.uniform(0.0, 0.3)),
        gain=float(rng.uniform(0.8, 1.2)),
        offset=float(rng.uniform(-0.08, 0.08)),
        noise_sigma=float(rng.uniform(0.01, 0.05)),
        defocus_sigma=float(rng.uniform(0.0, 0.9)),
        texture_contrast=float(rng.uniform(0.08, 0.16)),
    )


# ---------------------------------------------------------------------------------------------
# FFT helpers


@lru_cache(maxsize=8)
def _freq_grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    f = np.fft.fftfreq(size)
    return np.meshgrid(f, f, indexing="ij")


def _gaussian_blur(image: np.ndarray, sigma: float) -> np.ndarray:
    if sigma <= 0.05:
        return image
    fy, fx = _freq_grid(image.shape[0])
    kernel = np.exp(-2.0 * (np.pi * sigma) ** 2 * (fx**2 + fy**2))
    return np.real(np.fft.ifft2(np.fft.fft2(image) * kernel))


def _fractal_noise(
    rng: np.random.Generator, size: int, beta: float, anisotropy: float = 1.0, angle: float = 0.0
) -> np.ndarray:
    """Zero-mean, unit-variance 1/f^beta noise, stretched ``anisotropy`` times along ``angle``."""
    fy, fx = _freq_grid(size)
    c, s = np.cos(angle), np.sin(angle)
    u = c * fx + s * fy
    v = -s * fx + c * fy
    f = np.sqrt(u**2 + (anisotropy * v) ** 2)
    f[0, 0] = 1.0
    spectrum = np.fft.fft2(rng.standard_normal((size, size))) / f ** (beta / 2.0)
    spectrum[0, 0] = 0.0
    out = np.real(np.fft.ifft2(spectrum))
    return out / (out.std() + 1e-8)


# ---------------------------------------------------------------------------------------------
# Textures


@lru_cache(maxsize=1)
def _photos() -> dict[str, np.ndarray]:
    """Real CC0 texture photographs bundled with scikit-image (no download needed)."""
    from skimage import data

    photos = {}
    for name in ("brick", "gravel", "grass"):
        img = getattr(data, name)().astype(np.float32)
        photos[name] = (img - img.mean()) / (img.std() + 1e-6)
    return photos


def _texture(rng: np.random.Generator, kind: str, size: int) -> tuple[np.ndarray, float]:
    """A unit-variance texture and its dominant direction (the rolling direction of metal)."""
    angle = float(rng.uniform(0, np.pi))
    if kind == "metal":
        tex = _fractal_noise(rng, size, beta=2.2, anisotropy=float(rng.uniform(6, 14)), angle=angle)
    elif kind == "cast":
        tex = 0.8 * _fractal_noise(rng, size, beta=1.6) + 0.6 * rng.standard_normal((size, size))
        tex = _gaussian_blur(tex, 0.6)
    elif kind == "woven":
        period = float(rng.uniform(4.0, 8.0))
        yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
        c, s = np.cos(angle), np.sin(angle)
        a = (c * xx + s * yy) * 2 * np.pi / period
        b = (-s * xx + c * yy) * 2 * np.pi / period
        tex = np.sin(a) * np.sign(np.sin(b / 2)) + 0.4 * _fractal_noise(rng, size, beta=1.0)
    else:
        photo = _photos()[kind]
        scale = int(rng.integers(1, 3))  # crop 1x or 2x the output size, then subsample
        span = size * scale
        y, x = rng.integers(0, photo.shape[0] - span, size=2)
        tex = photo[y : y + span : scale, x : x + span : scale].astype(np.float64)
        tex = np.rot90(tex, int(rng.integers(0, 4)))
        if rng.random() < 0.5:
            tex = tex[:, ::-1]
    tex = tex - tex.mean()
    return tex / (tex.std() + 1e-8), angle


# ---------------------------------------------------------------------------------------------
# Defects: point clouds splatted onto a canvas and blurred


def _splat(points: np.ndarray, size: int, sigma: float, weights: np.ndarray | None = None) -> np.ndarray:
    canvas = np.zeros((size, size))
    pts = np.round(points).astype(int)
    keep = (pts[:, 0] >= 0) & (pts[:, 0] < size) & (pts[:, 1] >= 0) & (pts[:, 1] < size)
    w = np.ones(len(pts)) if weights is None else weights
    np.add.at(canvas, (pts[keep, 0], pts[keep, 1]), w[keep])
    canvas = _gaussian_blur(canvas, sigma)
    peak = canvas.max()
    return canvas / peak if peak > 0 else canvas


def _segment(p0: np.ndarray, p1: np.ndarray, density: float = 2.0) -> np.ndarray:
    n = max(2, int(np.linalg.norm(p1 - p0) * density))
    t = np.linspace(0.0, 1.0, n)[:, None]
    return p0 + t * (p1 - p0)


def _defect(rng: np.random.Generator, label: str, size: int, angle: float) -> tuple[np.ndarray, float]:
    """A defect intensity map in [0, 1] and its sign (+1 bright, -1 dark)."""
    margin = size * 0.15
    centre = rng.uniform(margin, size - margin, size=2)
    if label == "scratch":
        theta = rng.uniform(0, np.pi)
        half = rng.uniform(0.2, 0.45) * size
        d = np.array([np.sin(theta), np.cos(theta)]) * half
        pts = _segment(centre - d, centre + d) + rng.normal(0, 0.25, size=(1, 2))
        return _splat(pts, size, sigma=float(rng.uniform(0.5, 0.9))), float(rng.choice([-1.0, 1.0]))
    if label == "crack":
        pts, heads = [], [(centre.copy(), rng.uniform(0, 2 * np.pi))]
        steps = int(rng.integers(int(size * 0.4), int(size * 0.8)))
        for _ in range(steps):
            new_heads = []
            for pos, heading in heads:
                heading += rng.normal(0, 0.45)
                pos = pos + np.array([np.sin(heading), np.cos(heading)])
                pts.append(pos)
                new_heads.append((pos, heading))
                if rng.random() < 0.03 and len(heads) < 4:
                    new_heads.append((pos.copy(), heading + rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 1.2)))
            heads = new_heads
        return _splat(np.array(pts), size, sigma=float(rng.uniform(0.5, 0.8))), -1.0
    if label == "inclusion":
        n = int(rng.integers(3, 9))
        d = np.array([np.sin(angle), np.cos(angle)])
        along = rng.uniform(-0.3, 0.3, size=n) * size
        pts = centre + along[:, None] * d + rng.normal(0, 0.8, size=(n, 2))
        return _splat(pts, size, sigma=float(rng.uniform(0.6, 1.1))), -1.0
    if label == "pit":
        n = int(rng.integers(5, 16))
        pts = centre + rng.normal(0, rng.uniform(2.0, 5.0), size=(n, 2))
        return _splat(pts, size, sigma=float(rng.uniform(0.7, 1.2))), -1.0
    if label == "stain":
        n = int(rng.integers(2, 5))
        pts = centre + rng.normal(0, size * 0.06, size=(n, 2))
        return _splat(pts, size, sigma=float(rng.uniform(size * 0.08, size * 0.16))), float(rng.choice([-1.0, 1.0]))
    raise ValueError(f"unknown defect class {label!r}; expected one of {CLASSES}")


# ---------------------------------------------------------------------------------------------
# Rendering


_VISIBILITY = {  # defect amplitude range, in units of the texture's standard deviation
    "scratch": (4.0, 10.0),
    "crack": (4.0, 10.0),
    "inclusion": (4.0, 10.0),
    "pit": (4.0, 9.0),
    "stain": (3.0, 6.0),
}


def render(rng: np.random.Generator, label: int, profile: FactoryProfile, size: int = DEFAULT_SIZE) -> np.ndarray:
    """One grey-scale image (float32, values in [0, 1]) of class ``CLASSES[label]``."""
    kind = TEXTURES[int(rng.choice(len(TEXTURES), p=profile.texture_weights))]
    tex, angle = _texture(rng, kind, size)
    contrast = profile.texture_contrast * float(rng.uniform(0.7, 1.3))
    image = 0.5 + contrast * tex
    name = CLASSES[label]
    if name != "ok":
        lo, hi = _VISIBILITY[name]
        mask, sign = _defect(rng, name, size, angle)
        image = image + sign * float(rng.uniform(lo, hi)) * contrast * mask

    yy, xx = np.mgrid[0:size, 0:size] / (size - 1) - 0.5
    phi = rng.uniform(0, 2 * np.pi)
    image = image + profile.light_gradient * (np.cos(phi) * xx + np.sin(phi) * yy)
    image = image - profile.vignette * (xx**2 + yy**2)
    image = _gaussian_blur(image, profile.defocus_sigma)
    image = profile.gain * image + profile.offset
    image = image + rng.normal(0.0, profile.noise_sigma, size=image.shape)
    return np.clip(image, 0.0, 1.0).astype(np.float32)


def render_many(
    rng: np.random.Generator, labels: np.ndarray, profiles: list[FactoryProfile], size: int = DEFAULT_SIZE
) -> np.ndarray:
    """Images for ``labels``; image i uses ``profiles[i % len(profiles)]``. Shape (n, 1, size, size)."""
    out = np.empty((len(labels), 1, size, size), dtype=np.float32)
    for i, label in enumerate(labels):
        out[i, 0] = render(rng, int(label), profiles[i % len(profiles)], size)
    return out
