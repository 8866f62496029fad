"""A model update as one vector for the secure sum: [weight * clipped delta, weight] in fixed point.

Summing these over factories gives sum(n_u * delta_u) and sum(n_u): the server learns the weighted
average update and the total example count, never one factory's update or count.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import numpy as np

from common.secagg import quantize


def flatten(weights: Mapping[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in weights.values()]) if weights else np.zeros(0)


def unflatten(vector: np.ndarray, like: Mapping[str, np.ndarray]) -> "OrderedDict[str, np.ndarray]":
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    offset = 0
    for name, ref in like.items():
        out[name] = vector[offset : offset + ref.size].reshape(ref.shape).astype(ref.dtype)
        offset += ref.size
    if offset != len(vector):
        raise ValueError(f"vector of {len(vector)} values does not match a model of {offset} parameters")
    return out


def encode_update(global_weights: Mapping[str, np.ndarray], new_weights: Mapping[str, np.ndarray], num_examples: int,
                  clip: float, scale: float, max_weight: int) -> tuple[np.ndarray, float]:
    """The fixed-point vector a factory masks; also returns the update's L2 norm before clipping."""
    delta, norm = quantize.clip_l2(flatten(new_weights) - flatten(global_weights), clip)
    weight = float(min(num_examples, max_weight))
    return quantize.encode(np.append(delta * weight, weight), scale), norm


def decode_sum(total: np.ndarray, global_weights: Mapping[str, np.ndarray], scale: float) -> tuple["OrderedDict[str, np.ndarray]", float]:
    """The new global model from the unmasked sum, and the total weight (example count)."""
    decoded = quantize.decode(total, scale)
    weight = float(decoded[-1])
    if weight <= 0:
        raise ValueError(f"secure sum decoded a total weight of {weight}")
    return unflatten(flatten(global_weights) + decoded[:-1] / weight, global_weights), weight
