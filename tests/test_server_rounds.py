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
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from client import app as client_app
from client.agent import serve
from client.config import AgentConfig
from client.data import DataRequest
from common.procs import free_port
from common.secagg.messages import RECORD, split_next, with_next
from common.training import TrainConfig
from common.wire import WEIGHTS_KEY, weights_of_record, weights_record
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
        info = ConfigRecord({"factory-id": name, "architecture": architecture, "data-source": "synthetic"})
        if msg.metadata.message_type == "query.describe":
            return Message(RecordDict({"info": info}), reply_to=msg)
        if msg.metadata.message_type == "query.proxy":
            return Message(RecordDict({"info": info, "proxy": ConfigRecord({"have": True})}), reply_to=msg)
        weights = weights_of_record(msg.content["arrays"], "the server's model")
        out = transform(weights) if msg.content["config"].get("send-weights", True) else OrderedDict()
        content = RecordDict({
            "arrays": weights_record(out),
            "metrics": MetricRecord({"num-examples": 100, "train-loss": 1.0}),
            "info": info,
        })
        if predictions is not None and "proxy-sha256" in msg.content["config"]:
            content["predictions"] = ArrayRecord(OrderedDict(probabilities=Array(predictions(int(msg.content["config"]["server-round"]))),
                                                             **{"class-counts": Array(np.full(6, 10.0))}))
        return Message(content, reply_to=msg)
    return handle


def agent_node(agent, recorded: dict[str, list], drops: Callable[[Message, str], bool] = lambda msg, factory_id: False) -> Handler:
    """What a SuperNode does with a message: run the FedForge ClientApp handler, pointed at a real edge agent.

    ``recorded["messages"]`` gets (round, message type, factory, carries next-session stage) for each
    message; ``recorded["server-saw"]`` every array the server received (a model's, one by one); ``drops`` silences replies.
    """
    factory_id = agent.trainer.cfg.factory_id
    context = Context(run_id=1, node_id=0, node_config={"agent-address": agent.trainer.cfg.listen, "factory-id": factory_id},
                      state=RecordDict(), run_config={"agent-timeout": 120.0})
    handlers = {"train": client_app.train, "evaluate": client_app.evaluate, "query.describe": client_app.describe, "query.proxy": client_app.proxy,
                **{f"query.secagg_{s}": client_app._secagg_stage(s) for s in ("advertise", "share", "unmask")}}

    def handle(msg: Message) -> Message | None:
        kind = msg.metadata.message_type
        rides = RECORD in msg.content and bool(split_next(dict(msg.content[RECORD]))[1])  # the next session's stage rides along
        recorded.setdefault("messages", []).append((int(msg.metadata.group_id), kind, factory_id, rides))
        if drops(msg, factory_id):
            return None
        reply = handlers[kind](msg, context)
        recorded.setdefault("records", []).append((kind, sorted(msg.content.keys()), sorted(reply.content.keys())))
        for record in reply.content.array_records.values():
            arrays = weights_of_record(record, factory_id) if WEIGHTS_KEY in record else {name: arr.numpy() for name, arr in record.items()}
            recorded.setdefault("server-saw", []).extend(arrays.items())
        return reply
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
    base = {"num_server_rounds": 1, "test_size": 60, "wait_for_factories": 5, "round_timeout": 2, "registry_dir": str(tmp_path),
            "secure_aggregation": False}
    return FederationConfig(**{**base, **kw})


def test_nan_and_wrong_shape_updates_are_excluded_by_name(tmp_path, caplog):
    grid = ScriptedGrid({1: factory("good", plus(0.01)), 2: factory("nan-factory", with_nan), 3: factory("shape-factory", wrong_shape)})
    cfg = _config(tmp_path, min_factories=1)
    fed = Federation(grid, cfg, flwr_run_id="7")
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
    step = cfg.server_lr_for(cfg.architecture)  # the server's step on the average (one round: momentum has nothing to add)
    assert all(np.allclose(w1[k], w0[k] + 0.01 * step) for k in w0)  # exactly the good factory's update
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


def test_secure_rounds_key_the_next_round_in_flight_and_survive_a_dropout_between_rounds(tmp_path):
    """Round 2 uses the session keyed during round 1 (two message phases, not four); factory-2 shares for
    round 2 and then drops out of its train phase, so its masks are removed from the sum; in round 3 it
    holds no shares of the prepared session, so keys are exchanged afresh and it takes part again."""
    agents = [serve(AgentConfig(factory_id=f"factory-{i}", listen=f"127.0.0.1:{free_port()}", factory_index=i, num_factories=3, train_size=48,
                                state_dir=str(tmp_path / "factories" / f"factory-{i}"))) for i in range(3)]
    recorded: dict[str, list] = {}
    drops = lambda msg, factory_id: factory_id == "factory-2" and msg.metadata.message_type == "train" and msg.metadata.group_id == "2"
    grid = ScriptedGrid({i + 1: agent_node(agent, recorded, drops) for i, agent in enumerate(agents)})
    cfg = _config(tmp_path, num_server_rounds=3, secure_aggregation=True, secagg_threshold=2, round_timeout=3, secagg_timeout=3,
                  federated_evaluation=False)
    try:
        Federation(grid, cfg, flwr_run_id="31").run()
        examples = [len(agent.trainer.data.split(DataRequest()).train) for agent in agents]
    finally:
        for agent in agents:
            agent.stop(0)

    rounds = Registry.at(tmp_path).rounds("run-31")
    assert [r.status for r in rounds] == ["completed"] * 3, [r.metrics for r in rounds]
    kinds = {r: sorted({k for rr, k, _, _ in recorded["messages"] if rr == r}) for r in (1, 2, 3)}
    keyed = ["query.secagg_advertise", "query.secagg_share", "query.secagg_unmask", "train"]
    assert kinds[1] == ["query.describe", "query.proxy", *keyed]  # the public proxy set, once (personal models learn from it)
    assert kinds[2] == ["query.secagg_unmask", "train"]
    assert kinds[3] == keyed
    assert [r.metrics["secagg-phases"] for r in rounds] == [4, 2, 4]
    # The next round's stages rode on train and unmask messages of rounds 1 and 2, never of the last round.
    assert all(ahead for r, k, _, ahead in recorded["messages"] if r in (1, 2) and k in ("train", "query.secagg_unmask"))
    assert not any(ahead for r, _, _, ahead in recorded["messages"] if r == 3)
    # ... inside records the messages have anyway: Flower moves every record as one more request per hop.
    assert {(k, tuple(sent), tuple(got)) for k, sent, got in recorded["records"] if k in ("train", "query.secagg_unmask")} == {
        ("train", ("arrays", "config", RECORD), ("arrays", "info", "metrics")), ("query.secagg_unmask", (RECORD,), ("info", RECORD))}
    assert rounds[1].participants == ["factory-0", "factory-1"] and "factory-2" in rounds[1].failures
    assert rounds[2].participants == ["factory-0", "factory-1", "factory-2"]
    # The securely summed example counts are exact only if every mask (factory-2's pairwise ones too) was removed.
    assert [r.metrics["total-examples"] for r in rounds] == [sum(examples), examples[0] + examples[1], sum(examples)]
    assert {name for name, _ in recorded["server-saw"]} == {"masked"} and all(a.dtype == np.uint64 for _, a in recorded["server-saw"])


@pytest.mark.parametrize("personal_public,plain_personalizes", [(True, True), (False, True), (True, False)],
                         ids=["personal-public", "dp-only", "plain-factory-without-personal-model"])
def test_factories_training_with_dp_get_the_public_proxy_set_once_and_train_their_head_within_its_subspace(tmp_path, personal_public,
                                                                                                           plain_personalizes):
    """Factories that declare DP in describe receive the run's proxy set (public images) once; every train message names it;
    the DP factories report the subspace they trained in with their privacy spend. The plain factory gets it too only for
    its personal model (personal-public-confidence > 0), whose record names the set it learnt from; started with
    --no-personalize, it says so in describe and is not sent the images it would not use."""
    dp = {"factory-0": True, "factory-1": True, "factory-2": False}
    agents = [serve(AgentConfig(factory_id=name, listen=f"127.0.0.1:{free_port()}", factory_index=i, num_factories=3, train_size=48,
                                dp=private, dp_epsilon=8.0, dp_planned_rounds=2, state_dir=str(tmp_path / "factories" / name),
                                personalize=private or plain_personalizes))
              for i, (name, private) in enumerate(dp.items())]
    recorded: dict[str, list] = {}
    seen: list[tuple[int, str, str, dict]] = []

    def watching(agent) -> Handler:
        inner = agent_node(agent, recorded)

        def handle(msg: Message) -> Message | None:
            content = {k: dict(msg.content[k]) for k in ("config", "proxy") if k in msg.content}
            seen.append((int(msg.metadata.group_id), msg.metadata.message_type, agent.trainer.cfg.factory_id,
                         {**content, "images": "images" in msg.content}))
            return inner(msg)
        return handle

    grid = ScriptedGrid({i + 1: watching(agent) for i, agent in enumerate(agents)})
    cfg = _config(tmp_path, num_server_rounds=2, secure_aggregation=True, secagg_threshold=2, round_timeout=60, secagg_timeout=60,
                  federated_evaluation=False, proxy_size=40, training=TrainConfig(personal_public_confidence=0.8 if personal_public else 0.0))
    try:
        fed = Federation(grid, cfg, flwr_run_id="41")
        fed.run()
        for agent in agents:
            agent.trainer.wait_personal()
        personal_sets = {agent.trainer.cfg.factory_id: agent.trainer.personal.get(cfg.architecture)[1]
                         .settings.get("public-proxy-sha256") if agent.trainer.personal else None for agent in agents}
    finally:
        for agent in agents:
            agent.stop(0)

    registry = Registry.at(tmp_path)
    assert [r.status for r in registry.rounds("run-41")] == ["completed"] * 2
    proxy_messages = [(r, name, m["images"]) for r, kind, name, m in seen if kind == "query.proxy"]
    takers = ["factory-0", "factory-1", "factory-2"] if personal_public and plain_personalizes else ["factory-0", "factory-1"]
    assert {name for _, name, _ in proxy_messages} == set(takers)  # to the plain factory only for its personal model
    assert sorted((name, r) for r, name, images in proxy_messages if images) == [(name, 1) for name in takers]  # the images once
    sha = fed.proxy.sha256
    assert personal_sets == {name: sha if name in takers else None for name in dp}
    assert all(m["config"]["public-proxy-sha256"] == sha for _, kind, _, m in seen if kind == "train")
    privacy = registry.versions("run-41")[-1].privacy
    assert set(privacy) == {"factory-0", "factory-1"}
    assert all(p["dp-subspace-dims"] == 39 for p in privacy.values())  # 40 public images span 39 directions about their mean


def test_dp_factories_with_their_own_images_get_no_generated_proxy_set_and_the_operator_is_told(tmp_path, caplog):
    """The generator's proxy images are public for generated factories only: with real folders and no proxy-data folder the
    server sends none (DP factories then train the whole head) and says what to set."""
    kinds: list[str] = []

    def folder_factory(msg: Message) -> Message:
        kinds.append(msg.metadata.message_type)
        if msg.metadata.message_type == "query.describe":
            return Message(RecordDict({"info": ConfigRecord({"factory-id": "plant", "architecture": "", "data-source": "folder", "dp": True})}),
                           reply_to=msg)
        assert "public-proxy-sha256" not in msg.content["config"]
        return factory("plant", plus(0.01))(msg)

    with caplog.at_level(logging.WARNING, logger="fedforge"):
        Federation(ScriptedGrid({1: folder_factory}), _config(tmp_path, min_factories=1), flwr_run_id="42").run()
    assert "query.proxy" not in kinds and "train" in kinds
    assert "set proxy-data to a folder of unlabelled public images" in caplog.text


def test_a_resumed_run_waits_for_factories_to_report_since_it_started(tmp_path):
    """After a SuperLink restart its database still lists every factory as online until their last heartbeats run out:
    a resumed run waits until each has reported since the run started (a fresh run does not wait for that)."""
    import time

    from flwr.proto.node_pb2 import NodeInfo

    class RestartedLink(ScriptedGrid):
        def __init__(self) -> None:
            super().__init__({1: factory("a", plus(0.0)), 2: factory("b", plus(0.0))})
            self.reconnect_at = time.time() + 3.0  # factory b reports again 3 s after the run starts

        def get_nodes(self):
            now = time.time()
            stale = now - 4.0 + 20.0  # its last heartbeat 4 s ago (10 s interval, patience 2): still listed as online
            return [NodeInfo(node_id=1, heartbeat_interval=10.0, online_until=now + 20.0),
                    NodeInfo(node_id=2, heartbeat_interval=10.0, online_until=now + 20.0 if now >= self.reconnect_at else stale)]

    link = RestartedLink()
    Federation(link, _config(tmp_path, expected_factories=2), flwr_run_id="50")._wait_for_factories()
    assert time.time() < link.reconnect_at  # both listed: a fresh run goes ahead
    link = RestartedLink()
    resumed = Federation(link, _config(tmp_path, expected_factories=2, resume_from="v-any"), flwr_run_id="51")
    assert resumed.messenger.heard_since(time.time()) == [1]
    resumed._wait_for_factories()
    assert time.time() >= link.reconnect_at and resumed.messenger.heard_since(time.time() - 0.5) == [1, 2]


def test_a_refused_next_round_stage_never_fails_the_message_it_rides_on(tmp_path, caplog):
    """The agent refuses a share stage for a session it never started: the factory is just not in that session."""
    agent = serve(AgentConfig(factory_id="factory-0", listen=f"127.0.0.1:{free_port()}", train_size=48, state_dir=str(tmp_path / "factory-0")))
    try:
        context = Context(run_id=1, node_id=0, node_config={"agent-address": agent.trainer.cfg.listen}, state=RecordDict(), run_config={})
        share = {"stage": "share", "session": "run-9|2|keyed-ahead", "neighbors": [2], "enc-pks": [b"k" * 32], "mask-pks": [b"m" * 32]}
        msg = Message(RecordDict({RECORD: ConfigRecord(with_next({}, share))}), dst_node_id=1, message_type="query.secagg_unmask")
        with caplog.at_level(logging.WARNING, logger="fedforge.client"):
            assert client_app._next_session_stage(msg, context) == {}
        assert "unknown or expired secure-aggregation session" in caplog.text
        bogus = Message(RecordDict({RECORD: ConfigRecord(with_next({}, {"stage": "unmask"}))}), dst_node_id=1, message_type="train")
        assert client_app._next_session_stage(bogus, context) == {}  # only key stages may ride ahead
    finally:
        agent.stop(0)


def test_sparse_secagg_graph_survives_a_dropout_and_factories_answer_only_for_neighbours(tmp_path):
    """SecAgg+ on a 4-regular graph of 7 factories: factory-6 shares keys, then drops before its masked input. Each
    survivor is asked to unmask only its own neighbourhood (factories that are not factory-6's neighbours are never
    told about it), the threshold is two thirds of a neighbourhood, and the sum of the survivors comes out exact."""
    agents = [serve(AgentConfig(factory_id=f"factory-{i}", listen=f"127.0.0.1:{free_port()}", factory_index=i, num_factories=7, train_size=40,
                                architecture="cnn-small", personalize=False, state_dir=str(tmp_path / "factories" / f"factory-{i}"))) for i in range(7)]
    recorded: dict[str, list] = {}
    unmask_requests: dict[str, dict] = {}
    drops = lambda msg, factory_id: factory_id == "factory-6" and msg.metadata.message_type == "train"

    def watching(node):
        def handle(msg):
            if msg.metadata.message_type == "query.secagg_unmask":
                unmask_requests[node.__name__] = dict(msg.content["secagg"])
            return node(msg)
        return handle

    nodes = {}
    for i, agent in enumerate(agents):
        handler = agent_node(agent, recorded, drops)
        handler.__name__ = f"factory-{i}"
        nodes[i + 1] = watching(handler)
    cfg = _config(tmp_path, num_server_rounds=1, secure_aggregation=True, secagg_degree=4, round_timeout=5, secagg_timeout=5,
                  federated_evaluation=False, architecture="cnn-small", min_factories=4, expected_factories=7)
    try:
        Federation(ScriptedGrid(nodes), cfg, flwr_run_id="47").run()
        examples = {a.trainer.cfg.factory_id: len(a.trainer.data.split(DataRequest()).train) for a in agents}
    finally:
        for agent in agents:
            agent.stop(0)
    (round_,) = Registry.at(tmp_path).rounds("run-47")
    assert round_.status == "completed", round_.metrics
    assert "factory-6" in round_.failures and len(round_.participants) == 6
    assert round_.metrics["total-examples"] == sum(n for name, n in examples.items() if name != "factory-6")  # every mask removed
    told_dropped = {name for name, request in unmask_requests.items() if request["dropped"]}
    assert len(unmask_requests) == 6 and len(told_dropped) == 4  # only factory-6's four neighbours hear of it
    assert all(len(request["survivors"]) <= 5 for request in unmask_requests.values())  # a neighbourhood, not the round


def test_an_odd_secagg_degree_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="secagg-degree must be 0 .* or an even number"):
        FederationConfig(secagg_degree=3)


def test_the_automatic_degree_keeps_every_neighbourhood_above_its_threshold_and_grows_with_log_n():
    from server.secure_sum import AUTO_DESIGN_DROPOUT, AUTO_FAILURE, _short_of_threshold, auto_degree

    assert [auto_degree(n) for n in (3, 10, 50, 100, 150)] == [0] * 5  # complete graph: a sparse one would not halve the cost
    degrees = {n: auto_degree(n) for n in (200, 1000, 10_000)}
    for n, k in degrees.items():
        assert k % 2 == 0 and 0 < 2 * k <= n - 1
        assert n * _short_of_threshold(k + 1, AUTO_DESIGN_DROPOUT) <= AUTO_FAILURE  # the bound it was chosen by
        assert n * _short_of_threshold(k - 1, AUTO_DESIGN_DROPOUT) > AUTO_FAILURE  # and the smallest such degree
    assert degrees[200] < degrees[1000] < degrees[10_000] < 2 * degrees[200]  # 50x the factories, under 2x the neighbours


@pytest.fixture(scope="module")
def seven_agents(tmp_path_factory):
    """Seven real edge agents (cnn-small, 40 images each, no personal models), shared by the sparse-graph dropout cases."""
    root = tmp_path_factory.mktemp("sparse")
    agents = [serve(AgentConfig(factory_id=f"factory-{i}", listen=f"127.0.0.1:{free_port()}", factory_index=i, num_factories=7, train_size=40,
                                architecture="cnn-small", personalize=False, state_dir=str(root / f"factory-{i}"))) for i in range(7)]
    yield agents
    for agent in agents:
        agent.stop(0)


SPARSE_DROPOUTS = [  # (message type at which factories drop, which, round completes, their inputs in the sum)
    ("query.secagg_advertise", {"factory-6"}, True, False),
    ("query.secagg_share", {"factory-6"}, True, False),
    ("train", {"factory-6"}, True, False),
    ("query.secagg_unmask", {"factory-6"}, True, True),
    ("query.secagg_unmask", {"factory-3", "factory-4", "factory-5", "factory-6"}, False, True),  # 3 answer: no neighbourhood keeps 4
]


@pytest.mark.parametrize(("stage", "dropping", "completes", "included"), SPARSE_DROPOUTS,
                         ids=["advertise", "share", "masked-input", "unmask", "unmask-too-many"])
def test_sparse_graph_dropouts_at_each_stage_complete_or_abort_cleanly(tmp_path, seven_agents, stage, dropping, completes, included):
    """SecAgg+ on a 4-regular graph of 7 (threshold 4 of each neighbourhood of 5): a dropout at any stage leaves an exact sum
    of the right factories, every unmask request stays within one neighbourhood, and too few survivors abort the round
    with the model untouched."""
    unmask_requests: list[dict] = []
    drops = lambda msg, factory_id: factory_id in dropping and msg.metadata.message_type == stage

    def watching(node):
        def handle(msg):
            if msg.metadata.message_type == "query.secagg_unmask":
                unmask_requests.append(dict(msg.content["secagg"]))
            return node(msg)
        return handle

    nodes = {i + 1: watching(agent_node(agent, {}, drops)) for i, agent in enumerate(seven_agents)}
    cfg = _config(tmp_path, num_server_rounds=1, secure_aggregation=True, secagg_degree=4, round_timeout=5, secagg_timeout=5,
                  federated_evaluation=False, architecture="cnn-small", min_factories=3, expected_factories=7,
                  training=TrainConfig(epochs=1, personal_epochs=0))
    run = f"5{len(dropping)}{SPARSE_DROPOUTS.index((stage, dropping, completes, included))}"  # the agents refuse a replayed session
    Federation(ScriptedGrid(nodes), cfg, flwr_run_id=run).run()
    registry = Registry.at(tmp_path)
    (round_,) = registry.rounds(f"run-{run}")
    assert all(len(set(r["survivors"]) | set(r["dropped"])) <= 5 for r in unmask_requests)  # a neighbourhood, never the round
    if not completes:
        assert round_.status == "aborted" and "threshold" in round_.metrics["reason"]
        assert len(registry.versions(f"run-{run}")) == 1  # only the initial model: nothing was half-applied
        return
    examples = {a.trainer.cfg.factory_id: len(a.trainer.data.split(DataRequest()).train) for a in seven_agents}
    counted = set(examples) if included else set(examples) - dropping
    assert round_.status == "completed", round_.metrics
    assert set(round_.participants) == counted and dropping <= set(round_.failures)
    assert round_.metrics["total-examples"] == sum(examples[name] for name in counted)  # every mask removed, nobody else's input


def test_a_reply_whose_sender_died_mid_upload_does_not_hold_back_the_others():
    """A factory killed while uploading its reply leaves a reply the SuperLink lists but whose objects never come.

    Flower's own object pull (`pull_objects`, with its 2 h default deadline) waits on it; the phase must still collect
    the replies that arrived meanwhile, and report the broken one as that factory's error, within its own deadline.
    """
    import threading
    import time
    from types import SimpleNamespace

    from flwr.supercore.inflatable.inflatable_utils import ObjectPullError, ObjectUnavailableError, pull_objects

    from server.messaging import push_and_collect

    class HalfUploadedGrid:
        """Node 3's reply is listed first and its object never arrives; nodes 1 and 2 answer a moment later."""

        def __init__(self) -> None:
            self.pushed_at = 0.0

        def push_messages(self, messages):
            self.pushed_at = time.monotonic()
            return [f"m{m.metadata.dst_node_id}" for m in messages]

        def pull_messages(self, ids):
            out = []
            for mid in ids:
                if mid == "m3":
                    def never(object_id: str):
                        raise ObjectUnavailableError(object_id)
                    try:
                        pull_objects(["object-of-m3"], pull_object_fn=never)  # Flower's pull, Flower's defaults
                    except ObjectPullError as exc:
                        out.append(SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=mid), error=str(exc)))
                elif time.monotonic() - self.pushed_at > 0.3:
                    out.append(SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=mid), error=None))
            return out

    messages = [Message(RecordDict(), dst_node_id=n, message_type="train") for n in (1, 2, 3)]
    result: dict[str, object] = {}
    worker = threading.Thread(target=lambda: result.update(out=push_and_collect(HalfUploadedGrid(), messages, timeout=3.0)), daemon=True)
    worker.start()
    worker.join(120)  # liveness: without a bound, Flower would wait on the dead upload for 2 hours
    assert not worker.is_alive(), "the phase waited on a reply whose sender died mid-upload"
    replies, timed_out = result["out"]
    assert sorted(replies) == [1, 2, 3] and timed_out == []
    assert replies[1].error is None and replies[2].error is None
    assert "object-of-m3" in replies[3].error  # the dead factory's reply is an error reply, dropped by name as usual
