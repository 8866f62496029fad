"""Federated evaluation: factories judge the model they receive on their own held-out images; the server learns sums.

Real edge agents (gRPC on loopback) driven through the real ClientApp handlers by a scripted grid
that stands in for the SuperLink (the end-to-end test runs the same over real processes).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from client.agent import serve
from client.config import AgentConfig
from common.evaluation import figures
from common.procs import free_port
from common.secagg import quantize
from common.secagg.layout import Contribution, SecureLayout
from common.training import TrainConfig
from server.config import FederationConfig
from server.federation import Federation
from server.registry.service import Registry
from tests.test_server_rounds import ScriptedGrid, _task_identity, agent_node, factory, plus  # noqa: F401 - fixture re-used

CLASSES = ("ok", "scratch", "crack", "inclusion", "stain", "pit")


def test_escape_and_false_reject_rates_from_counts():
    m = np.zeros((6, 6), np.int64)
    m[0, 0], m[0, 2] = 8, 2  # 10 good parts, 2 rejected
    m[1, 1], m[1, 0] = 3, 1  # 4 scratches, 1 passed as good
    m[5, 5], m[5, 0], m[5, 4] = 4, 1, 1  # 6 pits, 1 passed as good
    f = figures(m, CLASSES)
    assert f["false-reject-rate"] == pytest.approx(2 / 10) and f["escape-rate"] == pytest.approx(2 / 10)
    assert f["accuracy"] == pytest.approx(15 / 20) and f["recall"]["scratch"] == pytest.approx(0.75) and f["recall"]["crack"] is None
    assert figures(m, ("a", "b", "c", "d", "e", "f"))["escape-rate"] is None  # no good class in the list: undefined, not zero


def test_secure_sum_of_confusion_matrices_is_the_plain_sum_per_group():
    rng = np.random.default_rng(3)
    layout = SecureLayout.of({"cnn-small": 4}, classes=6, confusion=["cnn-medium", "cnn-small"], metrics=True)
    total, plain = np.zeros(layout.length, np.uint64), {"cnn-small": 0, "cnn-medium": 0}
    for group in ("cnn-small", "cnn-small", "cnn-medium", "cnn-medium", "cnn-medium"):
        m = rng.integers(0, 40, size=(6, 6))
        plain[group] = plain[group] + m
        like = OrderedDict(w=np.zeros(4, np.float32))
        contribution = Contribution(group if group == "cnn-small" else None, like, like, 30, confusion=m, confusion_group=group,
                                    metrics={"train-loss": 1.5})
        total += layout.encode(contribution, clip=10.0, scale=quantize.DEFAULT_SCALE, max_weight=1000)[0]
    sums = layout.decode(total, quantize.DEFAULT_SCALE)
    assert all(np.array_equal(sums.confusion[g], plain[g]) for g in plain)
    assert sums.metrics["train-loss"] == pytest.approx(1.5) and sums.metric_weight == pytest.approx(150)


@pytest.fixture
def agents(tmp_path):
    """Three real edge agents; no personal models (what is evaluated here is the global model)."""
    started = [serve(AgentConfig(factory_id=f"factory-{i}", listen=f"127.0.0.1:{free_port()}", factory_index=i, num_factories=3, train_size=60,
                                 alpha=0.5, personalize=False, state_dir=str(tmp_path / f"factory-{i}"))) for i in range(3)]
    yield started
    for agent in started:
        agent.stop(0)


def _config(tmp_path, **kw):
    base = {"num_server_rounds": 2, "test_size": 60, "wait_for_factories": 5, "round_timeout": 60, "secagg_timeout": 60, "registry_dir": str(tmp_path / "registry"),
                "min_factories": 2, "secagg_threshold": 2}
    return FederationConfig(**{**base, **kw}, training=TrainConfig(epochs=1))


@pytest.mark.parametrize("secure", [True, False])
def test_every_version_gets_the_factories_figures_and_the_server_sees_only_sums(tmp_path, agents, secure):
    measured: dict[tuple[str, int], np.ndarray] = {}  # (factory, round or 0 for the final phase) -> its own confusion matrix
    for agent in agents:
        train, evaluate, fid = agent.trainer.train, agent.trainer.evaluate, agent.trainer.cfg.factory_id

        def recording_train(weights, config, server_round, run_id="", public=None, noise_holders=1, _train=train, _id=fid):
            local = _train(weights, config, server_round, run_id, public=public, noise_holders=noise_holders)
            measured[(_id, server_round)] = local.received.confusion
            return local

        def recording_evaluate(weights, config, _evaluate=evaluate, _id=fid):
            result = _evaluate(weights, config)
            measured[(_id, 0)] = result.confusion
            return result
        agent.trainer.train, agent.trainer.evaluate = recording_train, recording_evaluate
    recorded: dict[str, list] = {"server-saw": []}
    grid = ScriptedGrid({i + 1: agent_node(agent, recorded) for i, agent in enumerate(agents)})
    Federation(grid, _config(tmp_path, secure_aggregation=secure), flwr_run_id="41").run()

    registry = Registry.at(tmp_path / "registry")
    assert registry.get_run("run-41").status == "finished"
    versions = registry.versions("run-41")
    evaluations = registry.evaluations(run_id="run-41")
    assert [(e.version_id, e.server_round, e.phase) for e in evaluations] == [
        (versions[0].id, 1, "round"), (versions[1].id, 2, "round"), (versions[2].id, 2, "final")]
    for e, key in zip(evaluations, (1, 2, 0)):
        expected = sum(measured[(f"factory-{i}", key)] for i in range(3))
        assert np.array_equal(e.confusion, expected) and e.factories == 3
        assert e.figures["accuracy"] == pytest.approx(np.trace(expected) / expected.sum())
        assert e.examples == sum(len(a.trainer.data.split(a.trainer.data._current.request).held_out) for a in agents)
    rounds = registry.rounds("run-41")
    assert rounds[1].metrics["federated-accuracy"] == pytest.approx(evaluations[1].figures["accuracy"])
    kinds = {kind for _, kind, _, _ in recorded["messages"]}
    assert "evaluate" in kinds  # the evaluate-only phase after the last round
    if secure:  # nothing per factory ever reached the server: masked vectors only
        assert {name for name, _ in recorded["server-saw"]} == {"masked"}
        assert all(a.dtype == np.uint64 for _, a in recorded["server-saw"])
        assert not any(e.shared for e in evaluations)


def test_secure_and_plain_rounds_produce_the_same_model(tmp_path):
    """Same factories, same seeds: the securely aggregated model equals the plain FedAvg one up to fixed-point rounding (2^-24)."""
    finals = {}
    for secure in (True, False):
        started = [serve(AgentConfig(factory_id=f"factory-{i}", listen=f"127.0.0.1:{free_port()}", factory_index=i, num_factories=3,
                                     train_size=60, personalize=False, state_dir=str(tmp_path / f"{secure}-{i}"))) for i in range(3)]
        try:
            grid = ScriptedGrid({i + 1: agent_node(agent, {}) for i, agent in enumerate(started)})
            cfg = _config(tmp_path / str(secure), secure_aggregation=secure, federated_evaluation=False)
            Federation(grid, cfg, flwr_run_id="44").run()
        finally:
            for agent in started:
                agent.stop(0)
        registry = Registry.at(tmp_path / str(secure) / "registry")
        rounds = registry.rounds("run-44")  # the models compare only if every factory took part in every round of both runs
        assert [len(r.participants) for r in rounds] == [3, 3], [(r.participants, r.failures) for r in rounds]
        finals[secure] = registry.load_weights(registry.versions("run-44")[-1].id)
    for name, plain in finals[False].items():
        np.testing.assert_allclose(finals[True][name], plain, atol=1e-5, err_msg=name)


def test_a_run_whose_every_round_aborts_ends_failed_with_the_reason(tmp_path):
    grid = ScriptedGrid({1: factory("only", plus(0.01)), 2: lambda m: None})
    Federation(grid, _config(tmp_path, secure_aggregation=False, num_server_rounds=2, round_timeout=1, secagg_timeout=1), flwr_run_id="42").run()
    registry = Registry.at(tmp_path / "registry")
    run = registry.get_run("run-42")
    assert run.status == "failed" and "all 2 rounds aborted" in run.error and "1 good updates, 2 required" in run.error
    assert [r.status for r in registry.rounds("run-42")] == ["aborted", "aborted"]

    # a secure run that asks for more factories than are connected: every round aborts before a key is exchanged
    grid = ScriptedGrid({i: factory(f"f{i}", plus(0.01)) for i in (1, 2, 3)})
    Federation(grid, _config(tmp_path, secure_aggregation=True, min_factories=4, expected_factories=3, num_server_rounds=1),
               flwr_run_id="44").run()
    run = registry.get_run("run-44")
    assert run.status == "failed" and "aborted" in run.error and "3 factories connected, secure aggregation needs 4" in run.error


def test_the_central_test_set_is_a_folder_or_generated_only_for_generated_factories(tmp_path):
    """A server whose factories hold their own images never scores versions on generated images of other optics and
    classes: without test-data it has no central test set, and the factories' federated figures are the measure."""
    from PIL import Image

    from server.central import CentralData

    assert CentralData(_config(tmp_path), tmp_path).test is None
    generated = CentralData(_config(tmp_path), tmp_path)
    generated.choose_test_set(factories_generated=True)
    assert generated.test is not None and len(generated.test) == 60
    own = CentralData(_config(tmp_path), tmp_path)
    own.choose_test_set(factories_generated=False)
    assert own.test is None
    for grey, name in ((99, "ok"), (199, "crack")):  # two different images: one image under two classes is left out
        (tmp_path / "test" / name).mkdir(parents=True)
        Image.fromarray(np.full((20, 20), grey, np.uint8)).save(tmp_path / "test" / name / "0.png")
    folder = CentralData(_config(tmp_path, test_data=str(tmp_path / "test")), tmp_path)
    folder.choose_test_set(factories_generated=False)
    assert folder.test is not None and len(folder.test) == 2


def test_a_factory_whose_classes_do_not_fit_is_left_out_with_the_reason(tmp_path, caplog):
    def misfit(msg: Message) -> Message:
        info = ConfigRecord({"factory-id": "misfit", "fits": False, "reason": "data folder /x holds classes ['dent'] that are not in the run's list"})
        return Message(RecordDict({"info": info}), reply_to=msg)
    grid = ScriptedGrid({1: factory("a", plus(0.01)), 2: factory("b", plus(0.03)), 3: misfit})
    with caplog.at_level(logging.WARNING, logger="fedforge"):
        Federation(grid, _config(tmp_path, secure_aggregation=False, num_server_rounds=2, federated_evaluation=False), flwr_run_id="43").run()
    rounds = Registry.at(tmp_path / "registry").rounds("run-43")
    assert [r.participants for r in rounds] == [["a", "b"], ["a", "b"]]
    assert all("left out" in r.failures["misfit"] and "'dent'" in r.failures["misfit"] for r in rounds)
    assert "factory misfit is left out of this run" in caplog.text
