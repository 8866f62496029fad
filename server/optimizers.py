"""Server optimisers on the averaged update (Reddi et al. 2021, "Adaptive Federated Optimization").

The server only ever learns the average of the factories' updates, Δ = mean_k(w_k) - w (through the
secure sum when it is on); a server optimiser treats -Δ as a pseudo-gradient:

- ``fedavg``:  w ← w + η Δ  (η = 1 is plain FedAvg);
- ``fedavgm``: v ← β v + Δ;  w ← w + η v  (server momentum, Hsu et al. 2019);
- ``fedadam``: m ← β1 m + (1 - β1) Δ;  v ← β2 v + (1 - β2) Δ²;  w ← w + η m / (√v + τ)
  (Reddi et al.'s Algorithm 2: no bias correction, τ controls adaptivity).

The state (v, or m and v) is per architecture group and is saved with each version's round record,
so a federation resumed after a crash continues with it (`state_arrays` / `from_state`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

Weights = OrderedDict[str, np.ndarray]


@dataclass
class ServerOptimizer:
    kind: str = "fedavg"
    lr: float = 1.0
    beta1: float = 0.0  # FedAvgM's momentum, FedAdam's first-moment decay
    beta2: float = 0.99
    tau: float = 1e-3
    m: dict[str, np.ndarray] = field(default_factory=dict)  # momentum / first moment, float64
    v: dict[str, np.ndarray] = field(default_factory=dict)  # FedAdam's second moment, float64

    def __post_init__(self) -> None:
        if self.kind not in ("fedavg", "fedavgm", "fedadam"):
            raise ValueError(f"unknown server optimiser {self.kind!r}; choose fedavg, fedavgm or fedadam")

    def step(self, current: Mapping[str, np.ndarray], averaged: Mapping[str, np.ndarray]) -> Weights:
        """The next global model from the current one and the factories' average (same names, shapes, dtypes)."""
        out: Weights = OrderedDict()
        for name, w in current.items():
            w64 = w.astype(np.float64)
            delta = averaged[name].astype(np.float64) - w64
            if not np.issubdtype(w.dtype, np.floating):  # counters and other integer buffers: take the average as is
                out[name] = averaged[name].copy()
                continue
            if self.kind == "fedavg":
                new = w64 + self.lr * delta
            elif self.kind == "fedavgm":
                self.m[name] = self.beta1 * self.m.get(name, np.zeros_like(w64)) + delta
                new = w64 + self.lr * self.m[name]
            else:
                self.m[name] = self.beta1 * self.m.get(name, np.zeros_like(w64)) + (1 - self.beta1) * delta
                self.v[name] = self.beta2 * self.v.get(name, np.zeros_like(w64)) + (1 - self.beta2) * delta**2
                new = w64 + self.lr * self.m[name] / (np.sqrt(self.v[name]) + self.tau)
            out[name] = new.astype(w.dtype)
        return out

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The optimiser's state as named arrays (saved beside the version it produced)."""
        return {**{f"m/{k}": v for k, v in self.m.items()}, **{f"v/{k}": v for k, v in self.v.items()}}

    def load_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.m = {k[2:]: np.asarray(v, dtype=np.float64) for k, v in arrays.items() if k.startswith("m/")}
        self.v = {k[2:]: np.asarray(v, dtype=np.float64) for k, v in arrays.items() if k.startswith("v/")}
