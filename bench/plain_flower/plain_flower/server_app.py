"""Plain Flower ServerApp: the stock FedAvg strategy; records when each round's central evaluation runs."""

import json
import time

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from common.data import datasets
from common.models import build_model
from common.training import evaluate, set_torch_threads

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    set_torch_threads(1)
    cfg = context.run_config
    n = int(cfg["num-factories"])
    model = build_model(str(cfg["architecture"]), 6, seed=0)
    test = datasets.test_dataset(datasets.SyntheticSpec(num_factories=n), 600)
    stamps = []

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        result = evaluate(model, test)
        stamps.append({"round": server_round, "time": time.time(), "accuracy": result.accuracy})
        with open(str(cfg["timings-file"]), "w") as f:
            json.dump(stamps, f)
        return MetricRecord({"accuracy": result.accuracy})

    strategy = FedAvg(fraction_evaluate=0.0, min_train_nodes=n, min_available_nodes=n)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=int(cfg["num-server-rounds"]), evaluate_fn=central)
