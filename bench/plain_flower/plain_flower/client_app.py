"""Plain Flower ClientApp: trains in the ClientApp process, as Flower's examples do."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from common.data import datasets
from common.models import build_model
from common.training import TrainConfig, set_torch_threads
from common.training import train as train_loop

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    set_torch_threads(1)
    index = int(context.node_config["partition-id"])
    spec = datasets.SyntheticSpec(num_factories=int(context.run_config["num-factories"]))
    data = datasets.factory_dataset(spec, index)
    model = build_model(str(context.run_config["architecture"]), 6)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    result = train_loop(model, data, TrainConfig(epochs=int(context.run_config["local-epochs"]), batch_size=16))
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord({"num-examples": result.examples, "train-loss": result.loss})})
    return Message(content=content, reply_to=msg)
