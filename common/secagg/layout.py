"""One secure-sum vector for a round with architecture groups and distillation.

A factory's masked input is laid out as

    [group 1: n * clipped delta, n] ... [group G: n * clipped delta, n] [n(y) * q(y|x) for every x, y; n(y) for every y]

with one slot per architecture group (sorted by name) and, in distillation rounds, the proxy-set
predictions at the end: the factory's balanced predictions q weighted by its class counts n(y), and
those counts (see `common.distill.ensemble_of`). A factory fills its own group's slot (or none, when
it only sends predictions) and zeros elsewhere, so one SecAgg+ session yields every group's weighted
update sum and example count and the ensemble's sums, and nothing per factory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from common.secagg import quantize
from common.secagg.update import flatten, unflatten


@dataclass(frozen=True)
class SecureLayout:
    groups: tuple[tuple[str, int], ...]  # (architecture, number of parameters), sorted by architecture
    predictions: int = 0  # proxy images x classes; 0 when the round has no predictions
    classes: int = 0

    @classmethod
    def of(cls, group_sizes: Mapping[str, int], predictions: int = 0, classes: int = 0) -> SecureLayout:
        if predictions and (classes <= 0 or predictions % classes):
            raise ValueError(f"{predictions} prediction values do not split into {classes} classes")
        return cls(tuple(sorted((str(a), int(n)) for a, n in group_sizes.items())), int(predictions), int(classes) if predictions else 0)

    def offsets(self) -> dict[str, int]:
        out, offset = {}, 0
        for arch, size in self.groups:
            out[arch] = offset
            offset += size + 1
        return out

    @property
    def prediction_offset(self) -> int:
        return sum(size + 1 for _, size in self.groups)

    @property
    def length(self) -> int:
        return self.prediction_offset + (self.predictions + self.classes if self.predictions else 0)

    def encode(self, architecture: str | None, global_weights: Mapping[str, np.ndarray] | None, new_weights: Mapping[str, np.ndarray] | None,
               num_examples: int, predictions: tuple[np.ndarray, np.ndarray] | None, clip: float, scale: float,
               max_weight: int) -> tuple[np.ndarray, float]:
        """The fixed-point vector a factory masks, and its update's L2 norm before clipping (0 without weights)."""
        vector = np.zeros(self.length, dtype=np.float64)
        norm = 0.0
        if architecture is not None:
            sizes = dict(self.groups)
            if architecture not in sizes:
                raise ValueError(f"architecture {architecture!r} is not one of the round's groups {sorted(sizes)}")
            assert global_weights is not None and new_weights is not None
            delta, norm = quantize.clip_l2(flatten(new_weights) - flatten(global_weights), clip)
            if len(delta) != sizes[architecture]:
                raise ValueError(f"a {architecture} model of {len(delta)} parameters, the round expects {sizes[architecture]}")
            weight = float(min(num_examples, max_weight))
            start = self.offsets()[architecture]
            vector[start : start + len(delta)] = delta * weight
            vector[start + len(delta)] = weight
        if self.predictions:
            if predictions is None:
                raise ValueError("this round needs predictions on the proxy set")
            q, counts = (np.asarray(x, dtype=np.float64) for x in predictions)
            if q.size != self.predictions or counts.shape != (self.classes,):
                raise ValueError(f"this round needs {self.predictions} prediction values and {self.classes} class counts, got {q.size} and {counts.size}")
            q = np.clip(q.reshape(-1, self.classes), 0.0, 1.0)
            counts = np.clip(counts, 0.0, float(max_weight))
            start = self.prediction_offset
            vector[start : start + self.predictions] = (q * counts[None, :]).ravel()
            vector[start + self.predictions :] = counts
        return quantize.encode(vector, scale), norm

    def decode(self, total: np.ndarray, scale: float) -> tuple[dict[str, tuple[np.ndarray, float]], tuple[np.ndarray, np.ndarray] | None]:
        """({architecture: (sum of n * delta, sum of n)}, (sum of n(y) q(y|x) as (N, C), sum of n(y)) or None)."""
        if len(total) != self.length:
            raise ValueError(f"secure sum of {len(total)} values, the round's layout has {self.length}")
        values = quantize.decode(total, scale)
        groups = {}
        for arch, size in self.groups:
            start = self.offsets()[arch]
            groups[arch] = (values[start : start + size], float(values[start + size]))
        ensemble = None
        if self.predictions:
            start = self.prediction_offset
            ensemble = (values[start : start + self.predictions].reshape(-1, self.classes), values[start + self.predictions :])
        return groups, ensemble


def apply_group_sum(global_weights: Mapping[str, np.ndarray], weighted_delta_sum: np.ndarray, total_weight: float) -> "OrderedDict[str, np.ndarray]":
    """The group's new global model: global + sum(n * delta) / sum(n)."""
    if total_weight <= 0:
        raise ValueError(f"secure sum decoded a total weight of {total_weight}")
    return unflatten(flatten(global_weights) + weighted_delta_sum / total_weight, global_weights)
