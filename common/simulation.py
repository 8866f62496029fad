"""What both sides of a simulation agree on: which virtual factory drops out where.

``fedforge simulate --dropout P`` makes ``round(P * n)`` virtual factories fail at each chosen SecAgg
stage of each round. Which ones is a pure function of the run's seed, the round, the stage and the
factory, so the ClientApps (which fail), the command (which validates the stages) and a bench (which
names the survivors) compute the same set without talking to each other.
"""

from __future__ import annotations

import hashlib
from typing import Any

DROPOUT_STAGES = ("advertise", "share", "train", "unmask")  # train: the masked input

# The virtual factories' own settings under `fedforge simulate` (run-config keys, read only by client.simulation; the
# server ignores them): pyproject's [tool.flwr.app.config] lists exactly these beside the server's and the trainer's keys.
RUN_CONFIG_DEFAULTS: dict[str, Any] = {
    "simulation-dir": "",  # where each virtual factory keeps its state (factories/factory-<i>)
    "simulation-train-size": 120,  # generated images per virtual factory
    "simulation-dropout": 0.0,  # fraction of factories that drop out at each of the stages below
    "simulation-dropout-stages": "unmask",
    "simulation-audit-dir": "",  # where virtual factories write their encoded contributions (checking the sums)
}


def parse_stages(raw: str) -> tuple[str, ...]:
    """``"train,unmask"`` -> ("train", "unmask"); raises naming unknown stages."""
    stages = tuple(s.strip() for s in raw.split(",") if s.strip())
    if unknown := sorted(set(stages) - set(DROPOUT_STAGES)):
        raise ValueError(f"dropout stages {unknown} are not among {list(DROPOUT_STAGES)}")
    return stages


def dropped(fraction: float, stages: tuple[str, ...], seed: int, num_factories: int, server_round: int, stage: str) -> set[int]:
    """The partitions that drop at ``stage`` of ``server_round``: the ``round(fraction * n)`` lowest-ranked ones.

    The rank is SHA-256 of (seed, round, stage, partition): a deterministic shuffle, not a secret (it
    chooses which simulated factories fail; it never touches masks or keys).
    """
    if fraction <= 0 or stage not in stages:
        return set()

    def rank(partition: int) -> bytes:
        return hashlib.sha256(f"{seed}/{server_round}/{stage}/{partition}".encode()).digest()

    return set(sorted(range(num_factories), key=rank)[: round(fraction * num_factories)])


def dropped_in_run(run_config: dict[str, Any], num_factories: int, server_round: int, stage: str) -> set[int]:
    """``dropped`` with the fraction, stages and seed of a run config's ``simulation-*`` keys."""
    return dropped(float(run_config.get("simulation-dropout", 0.0)), parse_stages(str(run_config.get("simulation-dropout-stages", "unmask"))),
                   int(run_config.get("seed", 0)), num_factories, server_round, stage)
