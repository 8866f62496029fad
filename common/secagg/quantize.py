"""Fixed-point encoding of real vectors in Z_{2^64}, and L2 clipping before it.

A real value x is encoded as round(x * scale) mod 2^64 (two's complement for negatives); the sum
of encodings decodes to the sum of values as long as |sum| * scale < 2^63. Error per coordinate and
per input is at most 0.5 / scale.
"""

from __future__ import annotations

import numpy as np

DEFAULT_SCALE = float(2**24)


def clip_l2(vector: np.ndarray, bound: float) -> tuple[np.ndarray, float]:
    """Scale ``vector`` down to L2 norm ``bound`` if it is longer; return it and its original norm."""
    norm = float(np.linalg.norm(vector))
    if bound > 0 and norm > bound:
        return vector * (bound / norm), norm
    return vector, norm


def encode(vector: np.ndarray, scale: float = DEFAULT_SCALE) -> np.ndarray:
    scaled = np.rint(np.asarray(vector, dtype=np.float64) * scale)
    if not np.isfinite(scaled).all() or np.abs(scaled).max(initial=0) >= 2.0**62:
        raise OverflowError("value out of the fixed-point range; lower the scale or clip harder")
    return scaled.astype(np.int64).view(np.uint64)


def decode(encoded: np.ndarray, scale: float = DEFAULT_SCALE) -> np.ndarray:
    return encoded.view(np.int64).astype(np.float64) / scale


def error_bound(num_inputs: int, scale: float = DEFAULT_SCALE) -> float:
    """Max absolute quantization error of a decoded sum, per coordinate."""
    return num_inputs * 0.5 / scale
