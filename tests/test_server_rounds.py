"""The round loop against a scripted Grid: malformed replies are rejected by factory id and never reach the model.

The Grid here stands in for a SuperLink so that a reply can be made malformed on purpose; the
end-to-end tests run the same loop over real SuperLink/SuperNode processes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from server.federation import Federation, FederationConfig
from server.registry.service import Registry

Handler = Callable[[Message], Message | None]


class ScriptedGrid(Grid):
    """Answers each pushed message with its destination node's handler (None: never answers)."""

    def __init__(self, handlers: dict[int, Handler]) -> None:
        self.handlers, self.pending = handlers, {}

    def create_message(self, *a, **k):  # pragma: no cover - unused by FedForge
        raise NotImplementedError

    def set_run(self, run) -> None:  # pragma: no cover
        self._run = run

    @property
    def run(self):  # pragma: no cover
        return self._run

    def get_node_ids(self) -> Iterable[int]:
        return list(self.handlers)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for m in messages:
            mid = f"msg-{m.metadata.dst_node_id}-{len(self.pending)}-{len(ids)}"
            m.metadata.__dict__["_message_id"] = mid  # what the SuperLink assigns on push
            reply = self.handlers[m.metadata.dst_node_id](m)
            if reply is not None:
                self.pending[mid] = reply
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self.pending.pop(i) for i in list(message_ids) if i in self.pending]

    def send_and_receive(self, messages, *, timeout=None):  # pragma: no cover - unused by FedForge
        raise NotImplementedError


def factory(name: str, transform: Callable[[OrderedDict], OrderedDict], architecture: str = "",
            predictions: Callable[[int], np.ndarray] | None = None) -> Handler:
    """A scripted factory: describes itself, holds any proxy set, and answers train with ``transform(weights)``."""
    def handle(msg: Message) -> Message:
        info = ConfigRecord({"factory-id": name, "architecture": architecture})
        if msg.metadata.message_type == "query.describe":
            return Message(RecordDict({"info": info}), reply_to=msg)
        if msg.metadata.message_type == "query.proxy":
            return Message(RecordDict({"info": info, "proxy": ConfigRecord({"have": True})}), reply_to=msg)
        weights = OrderedDict((k, a.numpy()) for k, a in msg.content["arrays"].items())
        out = transform(weights) if msg.content["config"].get("send-weights", True) else OrderedDict()
        content = RecordDict({
            "arrays": ArrayRecord(OrderedDict((k, Array(v)) for k, v in out.items())),
            "metrics": MetricRecord({"num-examples": 100, "train-loss": 1.0}),
            "info": info,
        })
        if predictions is not None and "proxy-sha256" in msg.content["config"]:
            content["predictions"] = ArrayRecord(OrderedDict(probabilities=Array(predictions(int(msg.content["config"]["server-round"]))),
                                                             **{"class-counts": Array(np.full(6, 10.0))}))
        return Message(content, reply_to=msg)
    return handle


def plus(delta: float):
    return lambda w: OrderedDict((k, v + np.asarray(delta, v.dtype)) for k, v in w.items())


def with_nan(w):
    w = OrderedDict(w)
    first = next(iter(w))
    w[first] = w[first].copy()
    w[first].flat[0] = np.nan
    return w


def wrong_shape(w):
    w = OrderedDict(w)
    first = next(iter(w))
    w[first] = np.zeros((3, 3), np.float32)
    return w


@pytest.fixture(autouse=True)
def _task_identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = None


def _config(tmp_path, **kw):
    return FederationConfig(num_server_rounds=1, test_size=60, wait_for_factories=5, round_timeout=2, registry_dir=str(tmp_path),
                            secure_aggregation=False, **kw)


def test_nan_and_wrong_shape_updates_are_excluded_by_name(tmp_path, caplog):
    grid = ScriptedGrid({1: factory("good", plus(0.01)), 2: factory("nan-factory", with_nan), 3: factory("shape-factory", wrong_shape)})
    fed = Federation(grid, _config(tmp_path, min_factories=1), flwr_run_id="7")
    with caplog.at_level(logging.WARNING, logger="fedforge"):
        fed.run()
    registry = Registry.at(tmp_path)
    (round1,) = registry.rounds("run-7")
    assert round1.status == "completed" and round1.participants == ["good"]
    assert set(round1.failures) == {"nan-factory", "shape-factory"}
    assert "NaN or Inf" in round1.failures["nan-factory"] and "shape" in round1.failures["shape-factory"]
    assert "factory nan-factory" in caplog.text and "factory shape-factory" in caplog.text
    initial, new = registry.versions("run-7")
    w0, w1 = registry.load_weights(initial.id), registry.load_weights(new.id)
    assert all(np.allclose(w1[k], w0[k] + 0.01) for k in w0)  # exactly the good factory's model
    assert new.parent_id == initial.id and new.participants == ["good"]


def test_round_below_minimum_is_aborted_and_model_untouched(tmp_path, caplog):
    grid = ScriptedGrid({1: factory("good", plus(0.01)), 2: factory("nan-factory", with_nan), 3: lambda m: None})
    fed = Federation(grid, _config(tmp_path, min_factories=2), flwr_run_id="8")
    with caplog.at_level(logging.WARNING, logger="fedforge"):
        fed.run()
    registry = Registry.at(tmp_path)
    (round1,) = registry.rounds("run-8")
    assert round1.status == "aborted" and round1.version_id is None
    assert "no reply" in round1.failures["node-3"]
    assert [v.kind for v in registry.versions("run-8")] == ["initial"]
    assert "round 1 aborted" in caplog.text


def test_config_from_run_config_ignores_unknown_keys():
    cfg = FederationConfig.from_run_config({"num-server-rounds": 5, "lr": 0.01, "unknown-key": 1})
    assert cfg.num_server_rounds == 5 and cfg.lr == 0.01
