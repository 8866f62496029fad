"""The figures an inspection line is judged by, from a confusion matrix.

Federated evaluation sums confusion matrices (securely when secure aggregation is on), so every
figure here is computed from counts, never from one factory's predictions:

- accuracy: correct / all;
- recall per class: correct of a class / images of that class (None for a class nobody holds);
- **escape rate**: defects predicted as the good class / all defects (a bad part shipped);
- **false-reject rate**: good parts predicted as any defect / all good parts (a good part scrapped).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

DEFAULT_GOOD_CLASS = "ok"


def check_confusion(confusion: Any, classes: int, source: str) -> np.ndarray:
    """A (classes, classes) matrix of non-negative whole counts, or ValueError naming ``source``."""
    matrix = np.asarray(confusion, dtype=np.float64)
    if matrix.shape != (classes, classes):
        raise ValueError(f"{source}: confusion matrix of shape {matrix.shape}, expected ({classes}, {classes})")
    if not np.isfinite(matrix).all() or (matrix < -0.5).any():
        raise ValueError(f"{source}: confusion matrix holds negative or non-finite counts")
    return np.rint(np.maximum(matrix, 0)).astype(np.int64)


def figures(confusion: np.ndarray, classes: Sequence[str], good_class: str = DEFAULT_GOOD_CLASS) -> dict[str, Any]:
    """Accuracy, recall per class, escape and false-reject rates (None where undefined) of a confusion matrix."""
    m = np.asarray(confusion, dtype=np.int64)
    total = int(m.sum())
    per_class = m.sum(axis=1)
    recall = {c: (float(m[i, i] / per_class[i]) if per_class[i] else None) for i, c in enumerate(classes)}
    out: dict[str, Any] = {
        "examples": total,
        "accuracy": float(np.trace(m) / total) if total else None,
        "recall": recall,
        "escape-rate": None,
        "false-reject-rate": None,
    }
    if good_class in classes:
        g = list(classes).index(good_class)
        defects = total - int(per_class[g])
        if defects:
            out["escape-rate"] = float((m[:, g].sum() - m[g, g]) / defects)
        if per_class[g]:
            out["false-reject-rate"] = float((per_class[g] - m[g, g]) / per_class[g])
    return out
