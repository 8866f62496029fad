"""Flower SecAgg+ client: a NumPyClient behind `secaggplus_mod`, training as Flower's examples do."""

from flwr.client import NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp

from common.data import datasets
from common.models import build_model
from common.training import TrainConfig, set_torch_threads, train


class Factory(NumPyClient):
    def __init__(self, index: int, num_factories: int, architecture: str, epochs: int) -> None:
        self.data = datasets.factory_dataset(datasets.SyntheticSpec(num_factories=num_factories), index)
        self.model = build_model(architecture, 6)
        self.epochs = epochs

    def fit(self, parameters, config):  # type: ignore[no-untyped-def]
        import torch

        keys = list(self.model.state_dict())
        self.model.load_state_dict({k: torch.from_numpy(v) for k, v in zip(keys, parameters)})
        train(self.model, self.data, TrainConfig(epochs=self.epochs, batch_size=16))
        return [v.detach().numpy() for v in self.model.state_dict().values()], len(self.data), {}


def client_fn(context):  # type: ignore[no-untyped-def]
    set_torch_threads(1)
    rc = context.run_config
    return Factory(int(context.node_config["partition-id"]), int(rc["num-factories"]), str(rc["architecture"]), int(rc["local-epochs"])).to_client()


app = ClientApp(client_fn=client_fn, mods=[secaggplus_mod])
