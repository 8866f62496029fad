#!/usr/bin/env python3
"""FedAvg vs FedAvg + ensemble distillation vs centralized training under strong label skew.

The algorithms run in one process over the factories' real partitions with the production code
(`server.aggregate.fedavg`, `common.distill`), not the transport (the end-to-end tests cover that).
Distillation follows the ServerApp: each factory predicts on the proxy set with its locally trained
model, the server averages the predictions (the secure sum gives it exactly that), distils the
ensemble into the averaged model, and keeps the result only if it does not do worse on the
server's labelled validation set. Uplink bytes are those of a secure round (8-byte fixed point).

    python bench/distill.py --factories 5 --alpha 0.1 --rounds 5 --local-epochs 2 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from common.data import datasets
from common.distill import DistillConfig, ProxySet, balanced_predictions, distill, ensemble_of, predict_proxy
from common.models import build_model, load_weights, weights_of
from common.training import TrainConfig, evaluate, set_torch_threads, train
from server.aggregate import FactoryUpdate, fedavg


def federated(parts, test, val, proxy, a, seed: int, with_distill: bool) -> dict:
    model = build_model(a.architecture, 6, seed=seed)
    weights = weights_of(model)
    accuracies, accepted = [], 0
    for r in range(a.rounds):
        updates, weighted_sum, count_sum = [], 0.0, 0.0
        for i, part in enumerate(parts):
            load_weights(model, weights)
            train(model, part, TrainConfig(epochs=a.local_epochs, batch_size=16, seed=seed * 1000 + r * 10 + i))
            updates.append(FactoryUpdate(f"f{i}", i, weights_of(model), len(part)))
            if with_distill:  # what each factory puts into the secure sum
                counts = np.bincount(part.labels, minlength=6).astype(np.float64)
                weighted_sum = weighted_sum + counts * balanced_predictions(predict_proxy(model, proxy, a.temperature), counts)
                count_sum = count_sum + counts
        weights = fedavg(updates, like=weights)
        if with_distill:
            before = evaluate(load_weights(model, weights), val).accuracy
            teacher = ensemble_of(weighted_sum, count_sum)
            distilled, _ = distill(model, proxy, teacher, DistillConfig(temperature=a.temperature, epochs=a.distill_epochs, seed=seed * 100 + r))
            after = evaluate(load_weights(model, distilled), val).accuracy
            if after >= before:
                weights, accepted = distilled, accepted + 1
        accuracies.append(evaluate(load_weights(model, weights), test).accuracy)
    return {"accuracy": accuracies[-1], "per_round": accuracies, "distillations_kept": accepted}


def run(seed: int, a: argparse.Namespace) -> dict:
    spec = datasets.SyntheticSpec(seed=seed, num_factories=a.factories, alpha=a.alpha, train_size=a.train_size)
    parts = [datasets.factory_dataset(spec, i) for i in range(a.factories)]
    test, val = datasets.test_dataset(spec, 1200), datasets.validation_dataset(spec, 600)
    proxy = ProxySet(datasets.proxy_images(spec, a.proxy_size))
    union = datasets.ImageDataset(np.concatenate([p.images for p in parts]), np.concatenate([p.labels for p in parts]))

    t0 = time.perf_counter()
    central = build_model(a.architecture, 6, seed=seed)
    train(central, union, TrainConfig(epochs=a.rounds * a.local_epochs, batch_size=16, seed=seed))
    t_central = time.perf_counter() - t0
    t0 = time.perf_counter()
    plain = federated(parts, test, val, proxy, a, seed, with_distill=False)
    t_fedavg = time.perf_counter() - t0
    t0 = time.perf_counter()
    distilled = federated(parts, test, val, proxy, a, seed, with_distill=True)
    t_distill = time.perf_counter() - t0
    labels = [np.bincount(p.labels, minlength=6).tolist() for p in parts]
    return {"seed": seed, "centralized": evaluate(central, test).accuracy, "fedavg": plain, "fedavg+distill": distilled,
            "seconds": {"centralized": t_central, "fedavg": t_fedavg, "fedavg+distill": t_distill}, "label_counts": labels}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--factories", type=int, default=5)
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--architecture", default="cnn-small")
    p.add_argument("--train-size", type=int, default=600)
    p.add_argument("--proxy-size", type=int, default=500)
    p.add_argument("--temperature", type=float, default=2.0)
    p.add_argument("--distill-epochs", type=int, default=30)
    p.add_argument("--seeds", default="0,1,2", help="comma-separated")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    set_torch_threads(a.threads)
    runs = [run(int(s), a) for s in a.seeds.split(",")]
    print(json.dumps({"args": vars(a), "runs": runs}))
    c = statistics.mean(r["centralized"] for r in runs)
    f = statistics.mean(r["fedavg"]["accuracy"] for r in runs)
    d = statistics.mean(r["fedavg+distill"]["accuracy"] for r in runs)
    params = sum(v.size for v in weights_of(build_model(a.architecture, 6)).values())
    weight_up, pred_up = (params + 1) * 8, (a.proxy_size * 6 + 6) * 8
    def row(name: str, values: list[float]) -> str:
        return f"| {name} | " + " | ".join(f"{v:.3f}" for v in values) + f" | **{statistics.mean(values):.3f}** |"

    print("| | " + " | ".join("seed " + s for s in a.seeds.split(",")) + " | mean |")
    print("| --- |" + " --- |" * (len(runs) + 1))
    print(row(f"centralized ({a.rounds * a.local_epochs} epochs)", [r["centralized"] for r in runs]))
    print(row(f"FedAvg ({a.rounds} rounds x {a.local_epochs} epochs)", [r["fedavg"]["accuracy"] for r in runs]))
    print(row("FedAvg + distillation", [r["fedavg+distill"]["accuracy"] for r in runs]))
    gap = c - f
    print(f"gap closed by distillation: {(d - f) / gap:.2f} of the FedAvg-to-centralized gap ({gap:.3f})" if gap > 0 else "no gap")
    print(f"uplink per factory per round (secure, 8-byte fixed point): weights {weight_up / 1e6:.2f} MB, "
          f"predictions {pred_up / 1e6:.3f} MB, weights+predictions {(weight_up + pred_up) / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
