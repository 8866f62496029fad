"""One reducer for what factories report, in plain and secure rounds alike.

Per-factory training metrics become example-weighted means (the secure sum computes the same thing
from sum(n * m) and sum(n)); privacy spend stays per factory (it is the factory's budget, not data);
a factory's own figures are kept only when it sent them (``--share-metrics``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from common.evaluation import figures
from common.secagg.layout import SUMMED_METRICS

PRIVACY_KEYS = ("epsilon-spent", "epsilon-remaining", "epsilon-max", "delta", "noise-multiplier", "dp-subspace-dims", "dp-noise-holders",
                "epsilon-alone", "dp-max-grad-norm")
SHARED_KEYS = ("held-out-accuracy-before", "held-out-loss-before", "held-out-accuracy-after", "held-out-examples",
               "held-out-accuracy", "held-out-loss")


def weighted_means(reports: Iterable[tuple[float, Mapping[str, float]]]) -> dict[str, float]:
    """``factory-<m>``: the example-weighted mean of each of SUMMED_METRICS over the factories that reported it."""
    out = {}
    reports = list(reports)
    for key in SUMMED_METRICS:
        pairs = [(w, m[key]) for w, m in reports if key in m and np.isfinite(m[key]) and w > 0]
        total = sum(w for w, _ in pairs)
        if total > 0:
            out[f"factory-{key}"] = float(sum(w * v for w, v in pairs) / total)
    return out


def secure_means(means: Mapping[str, float]) -> dict[str, float]:
    """The secure sum's example-weighted means under the same names as `weighted_means`."""
    return {f"factory-{k}": float(v) for k, v in means.items()}


def privacy_of(metrics: Mapping[str, float]) -> dict[str, float]:
    return {k: float(metrics[k]) for k in PRIVACY_KEYS if k in metrics}


def shared_of(metrics: Mapping[str, float]) -> dict[str, float]:
    return {k: float(metrics[k]) for k in SHARED_KEYS if k in metrics}


def evaluation_metrics(prefix: str, confusion: np.ndarray, classes: Sequence[str], good_class: str) -> dict[str, Any]:
    """Round metrics for a summed confusion matrix: ``<prefix>accuracy``, ``escape-rate``, ``false-reject-rate``, ``examples``."""
    f = figures(confusion, classes, good_class)
    out: dict[str, Any] = {f"{prefix}examples": float(f["examples"])}
    for key in ("accuracy", "escape-rate", "false-reject-rate"):
        if f[key] is not None:
            out[f"{prefix}{key}"] = f[key]
    return out
