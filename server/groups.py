"""What the round loop keeps per architecture group, what a round sends, and what it produced."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ConfigRecord

from common.distill import ProxySet
from server.optimizers import ServerOptimizer


@dataclass
class Line:
    """One architecture's global model, the registry version it is (the head of its lineage), and its server optimiser."""

    architecture: str
    weights: OrderedDict[str, np.ndarray]
    version: Any  # None until the initial model is recorded (after round 1's key exchange has started)
    optimizer: ServerOptimizer = field(default_factory=ServerOptimizer)

    @property
    def num_parameters(self) -> int:
        return int(sum(v.size for v in self.weights.values()))


@dataclass
class RoundPlan:
    """Who takes part in a round and what each is sent."""

    server_round: int
    nodes: list[int]
    architecture_of: dict[int, str]  # node -> its group
    lines: dict[str, Line]
    distilling: bool
    proxy: ProxySet | None
    num_classes: int
    message_config: Callable[[str, bool], ConfigRecord]  # (architecture, sends weights) -> the train message's config

    def members(self) -> dict[str, list[int]]:
        return {arch: [n for n in self.nodes if self.architecture_of[n] == arch] for arch in self.lines}


@dataclass
class RoundResult:
    """Per-group averaged models (only groups that received updates), the ensemble, the federated figures, who took part."""

    group_weights: dict[str, OrderedDict[str, np.ndarray]] = field(default_factory=dict)
    group_examples: dict[str, float] = field(default_factory=dict)
    ensemble: np.ndarray | None = None  # mean of the factories' proxy-set probabilities, (N, classes)
    ensemble_size: int = 0
    confusion: dict[str, np.ndarray] = field(default_factory=dict)  # group -> summed confusion of the model it was sent
    participants: list[str] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    privacy: dict[str, Any] = field(default_factory=dict)
    shared: dict[str, dict[str, float]] = field(default_factory=dict)  # figures of factories that chose --share-metrics
