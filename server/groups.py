"""What the round loop keeps per architecture group, and what one round's aggregation produced."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Line:
    """One architecture's global model and the registry version it is (the head of its lineage)."""

    architecture: str
    weights: "OrderedDict[str, np.ndarray]"
    version: Any

    @property
    def num_parameters(self) -> int:
        return int(sum(v.size for v in self.weights.values()))


@dataclass
class RoundResult:
    """Per-group averaged models (only groups that received updates), the ensemble, and who took part."""

    group_weights: dict[str, "OrderedDict[str, np.ndarray]"] = field(default_factory=dict)
    group_examples: dict[str, float] = field(default_factory=dict)
    ensemble: np.ndarray | None = None  # mean of the factories' proxy-set probabilities, (N, classes)
    ensemble_size: int = 0
    participants: list[str] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    privacy: dict[str, Any] = field(default_factory=dict)
