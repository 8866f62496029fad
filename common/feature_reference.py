"""A public centre for a frozen backbone's features: the mean over photographs that ship with scikit-image.

Why: after the per-image layer norm, ~80% of a feature vector's energy is a component every image
shares (measured on generated factory images: the mean has norm 71 of 78.6). It tells classes
apart no better than the head's bias does, yet it dominates each example's gradient. Under DP-SGD
every per-example gradient is clipped to the same norm, so that shared part crowds out the part that
separates defects, and the noise is calibrated to the whole. Subtracting it is the feature
normalisation DP linear probes need (Tramèr & Boneh 2021); it costs nothing without DP.

Why a *public* centre: the mean of a factory's own images would be a statistic of private data that
no DP mechanism accounts for, and a DP estimate of a 6,176-d mean is far too noisy at the sizes of a
factory's data set. The mean over crops of scikit-image's bundled photographs (natural and
scientific images, no defect data, none of the textures FedForge's generator uses) is public,
deterministic and the same at every factory and at the central site; it points within a few degrees
of the mean over generated factory images.

The vector is computed once by ``python -m common.feature_reference --write`` into
`common.feature_reference_data` (a generated module, like the protobuf code, so that it travels in
the FAB with the rest of `common`), pinned by its sha256 in the backbone's feature identity, and
checked by a test that recomputes it.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
from pathlib import Path

import numpy as np

# Bundled with scikit-image (no download); brick, gravel and grass are left out because FedForge's
# own data generator draws textures from them.
REFERENCE_PHOTOS: tuple[str, ...] = (
    "astronaut", "camera", "chelsea", "clock", "coffee", "coins", "horse", "moon", "page", "rocket", "text", "logo",
    "immunohistochemistry", "hubble_deep_field", "retina", "microaneurysms", "shepp_logan_phantom", "checkerboard",
)
REFERENCE_CROPS = 256
REFERENCE_SIZE = 64
DATA_MODULE = Path(__file__).with_name("feature_reference_data.py")


class ReferenceError(RuntimeError):
    """The shipped reference vector is missing, altered or for another backbone."""


def reference_crops(count: int = REFERENCE_CROPS, size: int = REFERENCE_SIZE, seed: int = 0) -> np.ndarray:
    """``count`` grey crops (N, 1, size, size) in [0, 1] of the reference photographs, at random positions and scales.

    numpy's generator is right here: this is a fixed, public sample, not a secret.
    """
    from skimage import data
    from skimage.color import rgb2gray
    from skimage.transform import resize

    photos = []
    for name in REFERENCE_PHOTOS:
        image = np.asarray(getattr(data, name)(), dtype=np.float32)
        if image.ndim == 3:
            image = rgb2gray(image[..., :3])
        photos.append((image - image.min()) / max(float(image.max() - image.min()), 1e-9))
    rng = np.random.default_rng(seed)
    crops = []
    for k in range(count):
        image = photos[k % len(photos)]
        h, w = image.shape
        side = int(rng.integers(min(size, h, w), min(h, w) + 1))
        y, x = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
        crops.append(resize(image[y:y + side, x:x + side], (size, size), anti_aliasing=True))
    return np.stack(crops).astype(np.float32)[:, None]


def compute_centre(raw_features, batch: int = 64) -> np.ndarray:
    """The mean of ``raw_features`` (a backbone's uncentred feature function) over the reference crops."""
    import torch

    crops = reference_crops()
    with torch.no_grad():
        feats = [raw_features(torch.from_numpy(crops[i:i + batch])) for i in range(0, len(crops), batch)]
    return torch.cat(feats).mean(0).numpy().astype(np.float32)


def encode(vector: np.ndarray) -> tuple[str, str]:
    """(base64 of the little-endian float32 bytes, their sha256)."""
    raw = np.asarray(vector, dtype="<f4").tobytes()
    return base64.b64encode(raw).decode("ascii"), hashlib.sha256(raw).hexdigest()


def decode(b64: str, sha256: str, dim: int, what: str) -> np.ndarray:
    raw = base64.b64decode(b64)
    if hashlib.sha256(raw).hexdigest() != sha256 or len(raw) != 4 * dim:
        raise ReferenceError(f"the feature centre for {what} does not match its pinned sha256 {sha256[:16]} or its size {dim}; "
                             "regenerate it with `python -m common.feature_reference --write`")
    return np.frombuffer(raw, dtype="<f4").astype(np.float32)


def shipped(backbone_key: str) -> dict[str, object]:
    """The shipped entry for one backbone (``name@sha16/size/blocks``): its sha256, dimension and base64 vector."""
    from common import feature_reference_data

    entry = feature_reference_data.CENTRES.get(backbone_key)
    if entry is None:
        raise ReferenceError(f"no feature centre ships for backbone {backbone_key}; run `python -m common.feature_reference --write`")
    return entry


def render_module(centres: dict[str, np.ndarray]) -> str:
    lines = ['"""Generated by `python -m common.feature_reference --write`: do not edit (a test recomputes it).',
             "",
             f"Mean backbone features over {REFERENCE_CROPS} crops ({REFERENCE_SIZE} px, grey) of scikit-image's photographs",
             f"{', '.join(REFERENCE_PHOTOS)}; little-endian float32, base64.",
             '"""', "", "CENTRES = {"]
    for key, vector in centres.items():
        b64, digest = encode(vector)
        lines.append(f"    {key!r}: {{")
        lines.append(f"        \"sha256\": {digest!r},")
        lines.append(f"        \"dim\": {len(vector)},")
        lines.append("        \"float32_b64\": (")
        lines += [f"            {b64[i:i + 100]!r}" for i in range(0, len(b64), 100)]
        lines.append("        ),")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines) + "\n"


def compute_all() -> dict[str, np.ndarray]:
    """Every pretrained architecture's centre, from its raw (uncentred) features."""
    from common.backbones import FrozenBackbone
    from common.models import PRETRAINED_ARCHITECTURES

    centres = {}
    for spec in PRETRAINED_ARCHITECTURES.values():
        backbone = FrozenBackbone(spec, centred=False)
        centres[spec.backbone_key] = compute_centre(backbone.raw_features)
    return centres


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Compute the public feature centre of every pretrained backbone.")
    p.add_argument("--write", action="store_true", help=f"write {DATA_MODULE.name} (otherwise print the sha256 of each)")
    a = p.parse_args(argv)
    centres = compute_all()
    if a.write:
        DATA_MODULE.write_text(render_module(centres))
    for key, vector in centres.items():
        print(key, encode(vector)[1], f"norm {np.linalg.norm(vector):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
