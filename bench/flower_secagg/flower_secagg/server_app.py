"""Flower SecAgg+ server: legacy FedAvg under DefaultWorkflow(SecAggPlusWorkflow); stamps each round's evaluation."""

import json
import time

import torch
from flwr.common import ndarrays_to_parameters
from flwr.server import LegacyContext, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.serverapp import ServerApp

from common.data import datasets
from common.models import build_model
from common.training import evaluate, set_torch_threads

app = ServerApp()


@app.main()
def main(grid, context) -> None:  # type: ignore[no-untyped-def]
    set_torch_threads(1)
    rc = context.run_config
    n = int(rc["num-factories"])
    model = build_model(str(rc["architecture"]), 6, seed=0)
    test = datasets.test_dataset(datasets.SyntheticSpec(num_factories=n), 600)
    stamps = []

    def central(server_round, parameters, config):  # type: ignore[no-untyped-def]
        model.load_state_dict({k: torch.from_numpy(v) for k, v in zip(model.state_dict(), parameters)})
        result = evaluate(model, test)
        stamps.append({"round": server_round, "time": time.time(), "accuracy": result.accuracy})
        with open(str(rc["timings-file"]), "w") as f:
            json.dump(stamps, f)
        return result.loss, {"accuracy": result.accuracy}

    strategy = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=n, min_available_clients=n,
                      initial_parameters=ndarrays_to_parameters([v.numpy() for v in model.state_dict().values()]), evaluate_fn=central)
    legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=int(rc["num-server-rounds"])), strategy=strategy)
    DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(num_shares=n, reconstruction_threshold=max(2, n - 1)))(grid, legacy)
