#!/usr/bin/env python3
"""Centralized training vs FedAvg on the default data, after the same number of epochs over the data.

FedAvg here runs the production aggregation (`server.aggregate.fedavg`) over the factories' real
partitions in one process (the algorithm, not the transport: the end-to-end tests cover that).
Centralized training sees the union of the factories' data for rounds x local-epochs epochs.

    python bench/accuracy.py --factories 3 --rounds 5 --local-epochs 2 --alpha 1.0 --seeds 0
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from common.data import datasets
from common.models import build_model, load_weights, weights_of
from common.training import TrainConfig, evaluate, set_torch_threads, train
from server.aggregate import FactoryUpdate, fedavg


def run(seed: int, factories: int, rounds: int, local_epochs: int, alpha: float, arch: str, train_size: int) -> dict[str, float]:
    spec = datasets.SyntheticSpec(seed=seed, num_factories=factories, alpha=alpha, train_size=train_size)
    parts = [datasets.factory_dataset(spec, i) for i in range(factories)]
    test = datasets.test_dataset(spec, 1200)
    union = datasets.ImageDataset(np.concatenate([p.images for p in parts]), np.concatenate([p.labels for p in parts]))

    central = build_model(arch, 6, seed=seed)
    train(central, union, TrainConfig(epochs=rounds * local_epochs, batch_size=16, seed=seed))
    central_acc = evaluate(central, test).accuracy

    model = build_model(arch, 6, seed=seed)
    weights = weights_of(model)
    per_round = []
    for r in range(rounds):
        updates = []
        for i, part in enumerate(parts):
            load_weights(model, weights)
            train(model, part, TrainConfig(epochs=local_epochs, batch_size=16, seed=seed * 1000 + r * 10 + i))
            updates.append(FactoryUpdate(f"f{i}", i, weights_of(model), len(part)))
        weights = fedavg(updates, like=weights)
        load_weights(model, weights)
        per_round.append(evaluate(model, test).accuracy)
    return {"centralized": central_acc, "fedavg": per_round[-1], "fedavg_per_round": per_round}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--factories", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--architecture", default="cnn-small")
    p.add_argument("--train-size", type=int, default=600)
    p.add_argument("--seeds", default="0", help="comma-separated")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    set_torch_threads(a.threads)
    runs = [run(int(s), a.factories, a.rounds, a.local_epochs, a.alpha, a.architecture, a.train_size) for s in a.seeds.split(",")]
    c, f = statistics.mean(r["centralized"] for r in runs), statistics.mean(r["fedavg"] for r in runs)
    print(json.dumps({"args": vars(a), "runs": runs}))
    print(f"chance 0.167 | centralized {c:.3f} | FedAvg {f:.3f} after {a.rounds} rounds x {a.local_epochs} local epochs "
          f"(= {a.rounds * a.local_epochs} centralized epochs) | FedAvg/centralized {f / c:.2f}")


if __name__ == "__main__":
    main()
