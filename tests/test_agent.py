"""The edge agent over real gRPC on loopback."""

import logging
from collections import OrderedDict

import grpc
import numpy as np
import pytest
from google.protobuf import struct_pb2
from PIL import Image

from client.agent import GRPC_OPTIONS, serve
from client.config import AgentConfig
from common.models import build_model
from common.procs import free_port
from common.rpc.fedforge.v1 import edge_pb2, edge_pb2_grpc
from common.tensors import from_tensors, to_tensors


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    address = f"127.0.0.1:{free_port()}"  # its own state folder: the default, ./fedforge-factory, is the working directory's
    server = serve(AgentConfig(factory_id="plant-7", listen=address, train_size=64, state_dir=str(tmp_path_factory.mktemp("plant-7"))))
    channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
    yield edge_pb2_grpc.EdgeAgentStub(channel)
    channel.close()
    server.stop(grace=None)


def _global():
    return OrderedDict((k, v.numpy()) for k, v in build_model("cnn-small", 6, seed=1).state_dict().items())


def _config(**kw):
    s = struct_pb2.Struct()
    s.update({"architecture": "cnn-small", "local-epochs": 1, "batch-size": 16, **kw})
    return s


def test_health(agent):
    h = agent.Health(edge_pb2.HealthRequest())
    assert h.factory_id == "plant-7" and h.status == "serving" and h.num_examples > 0


def test_train_returns_a_changed_model_of_the_same_shape(agent):
    g = _global()
    reply = agent.Train(edge_pb2.TrainRequest(server_round=1, weights=to_tensors(g), config=_config()))
    new = from_tensors(reply.weights)
    assert reply.factory_id == "plant-7" and reply.num_examples > 0
    assert list(new) == list(g) and all(new[k].shape == g[k].shape for k in g)
    assert any(not np.allclose(new[k], g[k]) for k in g)
    assert np.isfinite(reply.metrics["train-loss"])


def test_evaluate(agent):
    reply = agent.Evaluate(edge_pb2.EvaluateRequest(weights=to_tensors(_global()), config=_config()))
    assert 0.0 <= reply.metrics["val-accuracy"] <= 1.0


def test_wrong_shape_model_is_refused_with_invalid_argument(agent):
    g = _global()
    first = next(iter(g))
    g[first] = np.zeros((1, 2), np.float32)
    with pytest.raises(grpc.RpcError) as err:
        agent.Train(edge_pb2.TrainRequest(server_round=1, weights=to_tensors(g), config=_config()))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and first in err.value.details()


def test_nan_model_and_bad_config_are_refused(agent):
    g = _global()
    first = next(iter(g))
    g[first] = g[first].copy()
    g[first].flat[0] = np.inf
    with pytest.raises(grpc.RpcError) as err:
        agent.Train(edge_pb2.TrainRequest(weights=to_tensors(g), config=_config()))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        agent.Train(edge_pb2.TrainRequest(weights=to_tensors(_global()), config=_config(optimizer="lbfgs")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "optimizer" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        agent.Train(edge_pb2.TrainRequest(weights=to_tensors(_global()), config=_config(architecture="resnet-9000")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "architecture" in err.value.details()


def test_every_command_has_help_and_the_agent_refuses_a_control_plane_on_the_network():
    """`fedforge <command> --help` for every installed command (`supernode` included); `fedforge agent` with a network-facing
    --agent-listen exits 2 naming it before anything starts."""
    import click
    from click.testing import CliRunner

    from common.cli import cli

    runner = CliRunner()
    names = cli.list_commands(click.Context(cli))
    assert {"agent", "client", "supernode", "server", "demo"} <= set(names)
    for name in names:
        result = runner.invoke(cli, [name, "--help"])
        assert result.exit_code == 0 and "Usage:" in result.output, (name, result.output)
    result = runner.invoke(cli, ["agent", "--factory-id", "plant-a", "--agent-listen", "0.0.0.0:50061"])
    assert result.exit_code == 2 and "--agent-listen 0.0.0.0:50061" in result.output and "must not face the network" in result.output


def _images(folder, count, start=0, value=0):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(start + value)
    for i in range(start, start + count):
        Image.fromarray((rng.random((20, 20)) * 60 + value).astype(np.uint8)).save(folder / f"{i:03d}.png")


def test_images_copied_into_the_folder_are_trained_on_from_the_next_run(tmp_path, caplog):
    """A factory keeps collecting images: a new run's first message indexes its folder again, so they are trained on without
    restarting the agent, by its DDP workers too, and images held out before stay held out. Within a run the images stay as
    they were. A folder that no longer indexes (a copy of a folder named for no class) is logged and the images indexed
    before are used; no round is lost."""
    from client.data import DataRequest

    caplog.set_level(logging.INFO)
    data = tmp_path / "line-1"
    _images(data / "ok", 30)
    _images(data / "dent", 20, value=150)
    address = f"127.0.0.1:{free_port()}"
    agent = serve(AgentConfig(factory_id="line-1", listen=address, data=str(data), classes="ok,dent", parallelism="ddp",
                              local_world_size=2, torch_threads=1, state_dir=str(tmp_path / "state")))
    channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
    stub = edge_pb2_grpc.EdgeAgentStub(channel)
    config = _config(classes="ok,dent", **{"image-size": 16})
    weights = to_tensors(OrderedDict((k, v.numpy()) for k, v in build_model("cnn-small", 2, seed=1).state_dict().items()))
    request = DataRequest(("ok", "dent"), 16, 1)

    def held_out_files():
        source, split = agent.trainer.data.source, agent.trainer.data.split(request)
        data_, report = source.load(request, 1 << 30)
        return {source.index.paths[i].name + source.index.names[i] for i in source.split(data_, report, 0.1, agent.trainer.cfg.data_seed)[1]}, split

    try:
        assert stub.Describe(edge_pb2.DescribeRequest(config=config, run_id="run-1")).fits
        first = stub.Train(edge_pb2.TrainRequest(run_id="run-1", server_round=1, weights=weights, config=config))
        held_before, split = held_out_files()
        assert stub.Health(edge_pb2.HealthRequest()).num_examples == 50 and first.num_examples == len(split.train)
        _images(data / "dent", 15, start=20, value=150)
        again = stub.Train(edge_pb2.TrainRequest(run_id="run-1", server_round=2, weights=weights, config=config))
        assert again.num_examples == first.num_examples  # the same run: the same images
        assert stub.Describe(edge_pb2.DescribeRequest(config=config, run_id="run-2")).fits
        assert stub.Health(edge_pb2.HealthRequest()).num_examples == 65
        assert "run run-2: factory line-1 trains on 65 image files" in caplog.text
        assert "the folder changed: 65 image files (were 50; dent 20 -> 35)" in caplog.text
        second = stub.Train(edge_pb2.TrainRequest(run_id="run-2", server_round=1, weights=weights, config=config))
        held_after, split = held_out_files()
        assert second.num_examples == len(split.train) > first.num_examples and held_before <= held_after
        _images(data / "scratches", 3, value=90)  # a folder named for no class in the list
        caplog.clear()
        assert stub.Describe(edge_pb2.DescribeRequest(config=config, run_id="run-3")).fits
        assert "cannot be indexed again, so the images indexed before are used" in caplog.text and "scratches" in caplog.text
        third = stub.Train(edge_pb2.TrainRequest(run_id="run-3", server_round=1, weights=weights, config=config))
        assert third.num_examples == second.num_examples and stub.Health(edge_pb2.HealthRequest()).num_examples == 65
    finally:
        channel.close()
        agent.stop()
