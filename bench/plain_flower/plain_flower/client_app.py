"""Plain Flower ClientApp: trains in the ClientApp process, as Flower's examples do."""

from functools import cache

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from common.data import datasets
from common.models import build_model
from common.training import TrainConfig, set_torch_threads
from common.training import train as train_loop

app = ClientApp()


@cache
def partition(index: int, num_factories: int, train_size: int):  # type: ignore[no-untyped-def]
    """A partition is generated once per process (a simulation worker serves many virtual nodes, many rounds)."""
    return datasets.factory_dataset(datasets.SyntheticSpec(num_factories=num_factories, train_size=train_size), index)


@app.train()
def train(msg: Message, context: Context) -> Message:
    set_torch_threads(1)
    index = int(context.node_config["partition-id"])
    data = partition(index, int(context.run_config["num-factories"]), int(context.run_config["train-size"]))
    model = build_model(str(context.run_config["architecture"]), 6)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    result = train_loop(model, data, TrainConfig(epochs=int(context.run_config["local-epochs"]), batch_size=16))
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord({"num-examples": result.examples, "train-loss": result.loss})})
    return Message(content=content, reply_to=msg)
