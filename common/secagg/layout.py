"""One secure-sum vector for a round: model updates per architecture group, predictions, figures.

A factory's masked input is laid out as

    [group 1: n * clipped delta, n] ... [group G: n * clipped delta, n]
    [n(y) * q(y|x) for every proxy image x and class y; n(y) for every y]      (distillation rounds)
    [confusion-matrix counts, C x C] for each evaluated group                (federated evaluation)
    [n; n * m for every metric m of SUMMED_METRICS]                          (the factories' own metrics)

with one slot per architecture group (sorted by name). A factory fills its own group's slot (or none,
when it only sends predictions) and zeros elsewhere, so one SecAgg+ session yields every group's
weighted update sum and example count, the ensemble's sums, each group's confusion matrix of the
model its factories received, and example-weighted sums of their training metrics: nothing per
factory. (A group of one gets no slots: its slot would be its member's own figures.)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from common.secagg import quantize
from common.secagg.update import flatten, unflatten

# What a factory reports about its round, summed securely weighted by its training examples (the
# server divides by the summed weight: an example-weighted mean, the same reducer as plain rounds).
SUMMED_METRICS = ("train-loss", "train-accuracy", "steps", "train-seconds", "eval-seconds", "update-norm")


class SumNotValid(ValueError):
    """An unmasked secure sum whose count slots hold no counts: its inputs were made under different terms, or corrupted."""


@dataclass
class Contribution:
    """What one factory puts into the secure sum (any part may be absent)."""

    architecture: str | None = None  # its group, when it sends weights
    global_weights: Mapping[str, np.ndarray] | None = None
    new_weights: Mapping[str, np.ndarray] | None = None
    num_examples: int = 0
    predictions: tuple[np.ndarray, np.ndarray] | None = None  # (balanced q (N, C), class counts (C,))
    confusion: np.ndarray | None = None  # (C, C) counts of the received model on its held-out split
    confusion_group: str | None = None  # the group whose model that was (its slot)
    metrics: Mapping[str, float] | None = field(default_factory=dict)  # None: nothing in the metrics slot (not even a weight)


@dataclass
class Sums:
    """What the server learns from the sum: nothing about any one factory."""

    groups: dict[str, tuple[np.ndarray, float]]  # architecture -> (sum of n * delta, sum of n)
    ensemble: tuple[np.ndarray, np.ndarray] | None  # (sum of n(y) q(y|x) as (N, C), sum of n(y))
    confusion: dict[str, np.ndarray]  # group -> (C, C) summed counts
    metrics: dict[str, float]  # example-weighted means of SUMMED_METRICS ({} without a metrics slot)
    metric_weight: float = 0.0  # the summed weight (training examples) behind ``metrics``


@dataclass(frozen=True)
class SecureLayout:
    groups: tuple[tuple[str, int], ...]  # (architecture, number of parameters), sorted by architecture
    predictions: int = 0  # proxy images x classes; 0 when the round has no predictions
    classes: int = 0  # the run's number of classes (predictions and confusion)
    confusion: tuple[str, ...] = ()  # groups with a confusion slot, sorted
    metrics: bool = False

    @classmethod
    def of(cls, group_sizes: Mapping[str, int], predictions: int = 0, classes: int = 0, confusion: tuple[str, ...] | list[str] = (),
           metrics: bool = False) -> SecureLayout:
        if (predictions or confusion) and classes <= 0:
            raise ValueError("predictions and confusion matrices need the number of classes")
        if predictions and predictions % classes:
            raise ValueError(f"{predictions} prediction values do not split into {classes} classes")
        return cls(tuple(sorted((str(a), int(n)) for a, n in group_sizes.items())), int(predictions),
                   int(classes) if (predictions or confusion) else 0, tuple(sorted(set(confusion))), bool(metrics))

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
    def confusion_offset(self) -> int:
        return self.prediction_offset + (self.predictions + self.classes if self.predictions else 0)

    @property
    def metrics_offset(self) -> int:
        return self.confusion_offset + self.classes * self.classes * len(self.confusion)

    @property
    def length(self) -> int:
        return self.metrics_offset + (1 + len(SUMMED_METRICS) if self.metrics else 0)

    def encode(self, c: Contribution, clip: float, scale: float, max_weight: int) -> tuple[np.ndarray, float]:
        """The fixed-point vector a factory masks, and its update's L2 norm before clipping (0 without weights)."""
        vector = np.zeros(self.length, dtype=np.float64)
        norm = 0.0
        weight = float(min(max(c.num_examples, 0), max_weight))
        if c.architecture is not None:
            sizes = dict(self.groups)
            if c.architecture not in sizes:
                raise ValueError(f"architecture {c.architecture!r} is not one of the round's groups {sorted(sizes)}")
            if c.global_weights is None or c.new_weights is None:
                raise ValueError("a weight contribution needs the global and the new weights")
            delta, norm = quantize.clip_l2(flatten(c.new_weights) - flatten(c.global_weights), clip)
            if len(delta) != sizes[c.architecture]:
                raise ValueError(f"a {c.architecture} model of {len(delta)} parameters, the round expects {sizes[c.architecture]}")
            start = self.offsets()[c.architecture]
            vector[start : start + len(delta)] = delta * weight
            vector[start + len(delta)] = weight
        if self.predictions:
            if c.predictions is None:
                raise ValueError("this round needs predictions on the proxy set")
            q, counts = (np.asarray(x, dtype=np.float64) for x in c.predictions)
            if q.size != self.predictions or counts.shape != (self.classes,):
                raise ValueError(f"this round needs {self.predictions} prediction values and {self.classes} class counts, got {q.size} and {counts.size}")
            q = np.clip(q.reshape(-1, self.classes), 0.0, 1.0)
            counts = np.clip(counts, 0.0, float(max_weight))
            start = self.prediction_offset
            vector[start : start + self.predictions] = (q * counts[None, :]).ravel()
            vector[start + self.predictions : start + self.predictions + self.classes] = counts
        if c.confusion_group is not None and c.confusion_group in self.confusion and c.confusion is not None:
            m = np.asarray(c.confusion, dtype=np.float64)
            if m.shape != (self.classes, self.classes):
                raise ValueError(f"confusion matrix of shape {m.shape}, the round expects ({self.classes}, {self.classes})")
            start = self.confusion_offset + self.confusion.index(c.confusion_group) * self.classes * self.classes
            vector[start : start + self.classes * self.classes] = np.clip(np.rint(m), 0.0, float(max_weight)).ravel()
        if self.metrics and c.metrics is not None:
            values = np.array([float(c.metrics.get(k, 0.0)) for k in SUMMED_METRICS])
            values = np.where(np.isfinite(values), np.clip(values, -1e6, 1e6), 0.0)
            vector[self.metrics_offset] = weight
            vector[self.metrics_offset + 1 :] = weight * values
        return quantize.encode(vector, scale), norm

    def decode(self, total: np.ndarray, scale: float) -> Sums:
        """The sums, by slot. Raises `SumNotValid` if a slot that holds counts (examples, class counts, confusion counts) does
        not: what a sum of inputs made under different round terms unmasks to (`common.secagg.terms`), or a corrupted one."""
        if len(total) != self.length:
            raise ValueError(f"secure sum of {len(total)} values, the round's layout has {self.length}")
        values = quantize.decode(total, scale)
        counts = self.count_slots()
        if len(counts) and not (np.all(values[counts] > -0.5) and np.all(np.abs(values[counts] - np.rint(values[counts])) < 1e-3)):
            raise SumNotValid("the secure sum did not unmask to a valid sum (its example counts are not counts): the factories' inputs "
                              "were made under different round terms, or one was corrupted; nothing of it is used")
        groups = {}
        for arch, size in self.groups:
            start = self.offsets()[arch]
            groups[arch] = (values[start : start + size], float(values[start + size]))
        ensemble = None
        if self.predictions:
            start = self.prediction_offset
            ensemble = (values[start : start + self.predictions].reshape(-1, self.classes),
                        values[start + self.predictions : start + self.predictions + self.classes])
        confusion = {}
        for i, group in enumerate(self.confusion):
            start = self.confusion_offset + i * self.classes * self.classes
            confusion[group] = np.rint(values[start : start + self.classes * self.classes]).reshape(self.classes, self.classes).astype(np.int64)
        metrics, weight = {}, 0.0
        if self.metrics:
            weight = float(values[self.metrics_offset])
            if weight > 0:
                metrics = {k: float(v / weight) for k, v in zip(SUMMED_METRICS, values[self.metrics_offset + 1 :])}
        return Sums(groups, ensemble, confusion, metrics, weight)

    def count_slots(self) -> np.ndarray:
        """Positions of the values that are sums of non-negative integers: each group's example count, the ensemble's class
        counts, the confusion counts and the metrics' weight."""
        slots = [self.offsets()[arch] + size for arch, size in self.groups]
        if self.predictions:
            slots += range(self.prediction_offset + self.predictions, self.prediction_offset + self.predictions + self.classes)
        slots += range(self.confusion_offset, self.confusion_offset + len(self.confusion) * self.classes * self.classes)
        if self.metrics:
            slots.append(self.metrics_offset)
        return np.asarray(slots, dtype=np.int64)

    def fields(self) -> dict[str, object]:
        """The layout as secure-aggregation request fields (what the factory rebuilds it from)."""
        return {"groups": [a.encode() for a, _ in self.groups], "group-sizes": [size for _, size in self.groups], "predictions": self.predictions,
                "classes": self.classes, "confusion": [a.encode() for a in self.confusion], "metrics": int(self.metrics)}

    @classmethod
    def from_fields(cls, f: Mapping[str, object]) -> SecureLayout:
        def names(values: object) -> list[str]:
            return [v.decode() if isinstance(v, bytes) else str(v) for v in (values or [])]  # type: ignore[attr-defined]

        groups = dict(zip(names(f.get("groups")), f.get("group-sizes", [])))  # type: ignore[arg-type]
        return cls.of(groups, int(f.get("predictions", 0)), int(f.get("classes", 0)), names(f.get("confusion")), bool(f.get("metrics", 0)))  # type: ignore[arg-type]


def apply_group_sum(global_weights: Mapping[str, np.ndarray], weighted_delta_sum: np.ndarray, total_weight: float) -> OrderedDict[str, np.ndarray]:
    """The group's averaged model: global + sum(n * delta) / sum(n)."""
    if total_weight <= 0:
        raise ValueError(f"secure sum decoded a total weight of {total_weight}")
    return unflatten(flatten(global_weights) + weighted_delta_sum / total_weight, global_weights)
