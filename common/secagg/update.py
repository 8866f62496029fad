"""A model as one flat vector and back: what a group's slot of the secure sum holds (see layout.py)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import numpy as np


def flatten(weights: Mapping[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in weights.values()]) if weights else np.zeros(0)


def unflatten(vector: np.ndarray, like: Mapping[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    offset = 0
    for name, ref in like.items():
        out[name] = vector[offset : offset + ref.size].reshape(ref.shape).astype(ref.dtype)
        offset += ref.size
    if offset != len(vector):
        raise ValueError(f"vector of {len(vector)} values does not match a model of {offset} parameters")
    return out
