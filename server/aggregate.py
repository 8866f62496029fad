"""FedAvg: the example-weighted mean of the factories' models, after each one is validated."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from common.tensors import UpdateError, check_like


@dataclass
class FactoryUpdate:
    factory_id: str
    node_id: int
    weights: OrderedDict[str, np.ndarray]
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)


def validate_update(global_weights: Mapping[str, np.ndarray], update: FactoryUpdate) -> None:
    """Raise `UpdateError` naming the factory if its update cannot be averaged in."""
    source = f"factory {update.factory_id} (node {update.node_id})"
    if update.num_examples <= 0:
        raise UpdateError(f"{source}: reported {update.num_examples} training examples")
    check_like(global_weights, update.weights, source)


def fedavg(updates: Sequence[FactoryUpdate], like: Mapping[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
    """Weighted mean (by example count), accumulated in float64, returned in ``like``'s dtypes."""
    if not updates:
        raise ValueError("fedavg needs at least one update")
    total = float(sum(u.num_examples for u in updates))
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    for name, ref in like.items():
        acc = np.zeros(ref.shape, dtype=np.float64)
        for u in updates:
            acc += u.weights[name].astype(np.float64) * (u.num_examples / total)
        out[name] = acc.astype(ref.dtype) if np.issubdtype(ref.dtype, np.floating) else np.rint(acc).astype(ref.dtype)
    return out
