"""Distillation rounds and architecture groups.

The scripted-grid tests stand in for the SuperLink so that a reply can be made malformed on purpose;
the secure test drives real edge agents (gRPC on loopback) through the real ClientApp handlers, and
the end-to-end test runs ``fedforge demo --distill`` over real SuperLink/SuperNode processes.
"""

from __future__ import annotations

import json
import logging
import subprocess
from collections import OrderedDict

import numpy as np
import pytest

from client.agent import serve
from client.config import AgentConfig
from common.distill import ProxyCache, ProxySet, ProxySetError, balanced_predictions, check_predictions, ensemble_of
from common.procs import free_port
from common.secagg import quantize
from common.secagg.layout import SUMMED_METRICS, Contribution, SecureLayout, apply_group_sum
from common.training import TrainConfig
from server.federation import Federation, FederationConfig
from server.local import fedforge_command
from server.registry.service import Registry
from server.secure_sum import SecureSum
from tests.test_server_rounds import ScriptedGrid, _task_identity, agent_node, factory, plus  # noqa: F401 - fixture re-used

PROXY, CLASSES = 32, 6


def _config(tmp_path, local_epochs=1, **kw):
    # cnn-small: the run's architecture sets the image size (128 px for the pretrained default, 64 for cnn-*), and the
    # agents here train CNNs, which read 128 px images four times slower and test nothing more
    base = {"architecture": "cnn-small", "num_server_rounds": 1, "test_size": 60, "validation_size": 60, "proxy_size": PROXY, "distill_epochs": 2, "wait_for_factories": 5,
                "round_timeout": 60, "secagg_timeout": 60, "registry_dir": str(tmp_path / "registry"), "min_factories": 2, "federated_evaluation": False}
    # no personal fine-tunes: these tests are about distillation, and an agent's stop waits for its fine-tune, which runs
    # at the lowest CPU priority (ten epochs of a from-scratch CNN per agent took minutes beside another test's federation)
    return FederationConfig(**{**base, **kw}, training=TrainConfig(epochs=local_epochs, personal_epochs=0))


def uniform(server_round: int) -> np.ndarray:
    return np.full((PROXY, CLASSES), 1.0 / CLASSES, dtype=np.float32)


# -- building blocks ---------------------------------------------------------------------------------
def test_proxy_set_travels_by_content_hash(tmp_path):
    images = np.random.default_rng(0).random((4, 1, 8, 8), dtype=np.float32)
    proxy = ProxySet(images)
    cache = ProxyCache(tmp_path)
    assert cache.get(proxy.sha256) is None
    with pytest.raises(ProxySetError, match="hashes to"):
        cache.put(proxy.sha256, images + 1e-3)  # not what was announced: refused, nothing stored
    assert cache.get(proxy.sha256) is None and not list(tmp_path.glob("*.npy"))
    cache.put(proxy.sha256, images)
    assert np.array_equal(ProxyCache(tmp_path).get(proxy.sha256).images, images)  # survives a restart
    with pytest.raises(ProxySetError, match="NaN"):
        ProxySet(np.full((2, 1, 4, 4), np.nan, dtype=np.float32))


def test_operator_proxy_folder_skips_unreadable_images_by_name(tmp_path):
    from PIL import Image

    from common.data.folder import DatasetError, load_unlabelled_folder
    from server.distillation import load_proxy

    (tmp_path / "line-3").mkdir()
    for i in range(3):
        Image.fromarray(np.full((80, 80), 40 * i, np.uint8)).save(tmp_path / "line-3" / f"part-{i}.png")
    good = (tmp_path / "line-3" / "part-0.png").read_bytes()
    (tmp_path / "truncated.png").write_bytes(good[: len(good) // 2])
    images, report = load_unlabelled_folder(tmp_path)
    assert images.shape == (3, 1, 64, 64) and images.dtype == np.float32
    assert [p for p, _ in report.skipped] == [str(tmp_path / "truncated.png")]
    proxy = load_proxy(FederationConfig(proxy_data=str(tmp_path), proxy_size=0, image_size=64))  # the folder wins over the generator
    assert len(proxy) == 3 and proxy.sha256 == ProxySet(images).sha256
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no readable images"):
        load_unlabelled_folder(tmp_path / "empty")


def test_predictions_are_checked_by_shape_and_value():
    good = np.full((3, 6), 1 / 6)
    assert check_predictions(good, 3, 6, "factory a").shape == (3, 6)
    with pytest.raises(ValueError, match="factory b: predictions of shape"):
        check_predictions(good[:, :5], 3, 6, "factory b")
    bad = good.copy()
    bad[0, 0] = np.inf
    with pytest.raises(ValueError, match="factory c: predictions contain NaN or Inf"):
        check_predictions(bad, 3, 6, "factory c")
    with pytest.raises(ValueError, match="not probability distributions"):
        check_predictions(good * 2, 3, 6, "factory d")


def test_secure_layout_sums_each_group_and_the_ensemble():
    rng = np.random.default_rng(1)
    like = {"small": OrderedDict(w=np.zeros((2, 3), np.float32)), "medium": OrderedDict(w=np.zeros(5, np.float32))}
    layout = SecureLayout.of({"small": 6, "medium": 5}, predictions=4 * 6, classes=6)
    factories = [("small", 10), ("small", 30), ("medium", 20), (None, 0)]  # the last sends predictions only
    total = np.zeros(layout.length, np.uint64)
    deltas, qs, counts = {}, [], []
    for arch, n in factories:
        c = rng.integers(0, 50, size=6).astype(np.float64)
        q = balanced_predictions(rng.dirichlet(np.ones(6), size=4), c)
        qs.append(q)
        counts.append(c)
        new = None
        if arch is not None:
            new = OrderedDict(w=(like[arch]["w"] + rng.normal(0, 0.1, like[arch]["w"].shape)).astype(np.float32))
            deltas.setdefault(arch, []).append((new["w"].astype(np.float64), n))
        encoded, _ = layout.encode(Contribution(arch, like.get(arch), new, n, (q, c)), clip=100.0, scale=quantize.DEFAULT_SCALE, max_weight=1000)
        total += encoded
    sums = layout.decode(total, quantize.DEFAULT_SCALE)
    groups, (weighted_sum, count_sum) = sums.groups, sums.ensemble
    assert np.allclose(count_sum, np.sum(counts, axis=0))
    assert np.allclose(weighted_sum, sum(c[None, :] * q for q, c in zip(qs, counts)), atol=1e-5)
    teacher = ensemble_of(weighted_sum, count_sum)
    assert teacher.shape == (4, 6) and np.allclose(teacher.sum(axis=1), 1.0)
    for arch, updates in deltas.items():
        expected = sum(d * n for d, n in updates) / sum(n for _, n in updates)
        assert groups[arch][1] == pytest.approx(sum(n for _, n in updates))
        assert np.allclose(apply_group_sum(like[arch], *groups[arch])["w"], expected, atol=1e-5)
    with pytest.raises(ValueError, match="not one of the round's groups"):
        layout.encode(Contribution("large", like["small"], like["small"], 1, (qs[0], counts[0])), 100.0, quantize.DEFAULT_SCALE, 1000)


def test_balanced_ensemble_lets_each_factory_speak_for_its_own_classes():
    """Two one-class factories each call everything their class; divided by their priors, the ensemble follows the images."""
    # factory a has seen classes 0 and 1 (90/10), factory b classes 1 and 2 (10/90)
    counts_a, counts_b = np.array([90.0, 10, 0, 0, 0, 0]), np.array([0.0, 10, 90, 0, 0, 0])
    # an image of class 1: both factories still lean to their majority class, but less than their prior says
    p_a = np.array([[0.7, 0.3, 0, 0, 0, 0]])
    p_b = np.array([[0, 0.3, 0.7, 0, 0, 0]])
    mean = (p_a + p_b) / 2
    q_a, q_b = balanced_predictions(p_a, counts_a), balanced_predictions(p_b, counts_b)
    teacher = ensemble_of(counts_a * q_a + counts_b * q_b, counts_a + counts_b)
    assert mean.argmax() != 1 and teacher.argmax() == 1
    assert teacher[0, 3:].sum() == 0  # nobody has seen classes 3-5: no opinion


def test_a_model_trained_on_logit_adjusted_loss_has_its_prior_divided_out_once():
    """A head trained on logits + tau log prior (the pretrained family's default, tau 1) predicts with tau log prior already
    taken out: `balanced_predictions` divides out only prior ** (1 - tau). Dividing the whole prior out again, as it once
    did, made the 90/10 factory vote for its rare class on an image its own balanced model calls its majority class."""
    counts = np.array([90.0, 10, 0, 0, 0, 0])
    balanced = np.array([[0.6, 0.4, 0, 0, 0, 0]])  # what a tau = 1 model says: class 0, prior already out
    assert np.allclose(balanced_predictions(balanced, counts, trained_adjustment=1.0), balanced)
    assert balanced_predictions(balanced, counts).argmax() == 1  # the prior divided out twice: the rare class wins
    pseudo = 0.5 * counts.sum() / 6
    prior = (counts + pseudo) / (counts.sum() + 6 * pseudo)
    for tau in (0.0, 0.5, 1.5):
        expected = np.where(counts > 0, balanced[0] / prior ** (1 - tau), 0.0)
        assert np.allclose(balanced_predictions(balanced, counts, trained_adjustment=tau)[0], expected / expected.sum())
    with pytest.raises(ValueError, match="trained_adjustment"):
        balanced_predictions(balanced, counts, trained_adjustment=-0.5)


def test_a_factory_divides_out_what_its_models_did_not_train_away(tmp_path):
    """`FactoryTrainer.predict` tells `balanced_predictions` the tau its model trained with: the head's logit adjustment
    without DP, the private head's under DP, a CNN's own, and none for a CNN under DP."""
    from client.config import AgentConfig
    from client.trainer import FactoryTrainer

    config = {"head-logit-adjustment": 0.7, "private-head-logit-adjustment": 0.4, "logit-adjustment": 0.2}
    plain = FactoryTrainer(AgentConfig(factory_id="f", train_size=20, state_dir=str(tmp_path / "plain")))
    private = FactoryTrainer(AgentConfig(factory_id="f", train_size=20, dp=True, dp_epsilon=8.0, state_dir=str(tmp_path / "dp")))
    assert plain._trained_adjustment("effnet-lite0", config) == 0.7
    assert private._trained_adjustment("effnet-lite0", config) == 0.4
    assert plain._trained_adjustment("cnn-small", config) == 0.2
    assert private._trained_adjustment("cnn-small", config) == 0.0


# -- the round loop, scripted ------------------------------------------------------------------------
def test_bad_predictions_are_excluded_by_name_and_groups_get_their_own_lines(tmp_path, caplog):
    def wrong_shape(r):
        return np.full((PROXY, CLASSES - 1), 1 / 5, np.float32)

    def nan(r):
        p = uniform(r)
        p[0, 0] = np.nan
        return p

    grid = ScriptedGrid({
        1: factory("small-a", plus(0.01), "cnn-small", uniform), 2: factory("small-b", plus(0.01), "cnn-small", uniform),
        3: factory("small-shape", plus(0.01), "cnn-small", wrong_shape),
        4: factory("medium-a", plus(0.01), "cnn-medium", uniform), 5: factory("medium-nan", plus(0.01), "cnn-medium", nan),
    })
    fed = Federation(grid, _config(tmp_path, secure_aggregation=False, distill="after"), flwr_run_id="21")
    with caplog.at_level(logging.WARNING, logger="fedforge"):
        fed.run()
    registry = Registry.at(tmp_path / "registry")
    (round1,) = registry.rounds("run-21")
    assert round1.status == "completed"
    assert set(round1.failures) == {"small-shape", "medium-nan"}
    assert "predictions of shape" in round1.failures["small-shape"] and "NaN" in round1.failures["medium-nan"]
    assert "factory small-shape failed and is left out" in caplog.text and "factory medium-nan failed" in caplog.text
    assert sorted(round1.participants) == ["medium-a", "small-a", "small-b"]
    versions = registry.versions("run-21")
    for arch in ("cnn-small", "cnn-medium"):
        line = [v for v in versions if v.architecture == arch]
        assert next(v.kind for v in line) == "initial" and line[1].kind in ("fedavg", "distilled")
        assert line[1].parent_id == line[0].id  # each architecture is its own lineage
        assert f"{arch}/distill-kept" in round1.metrics
        assert (line[1].kind == "distilled") == bool(round1.metrics[f"{arch}/distill-kept"])


def test_distillation_only_rounds_send_no_weights(tmp_path):
    seen = []

    def spy(w):
        seen.append(len(w))
        return w

    grid = ScriptedGrid({i: factory(f"f{i}", spy, "", uniform) for i in (1, 2)})
    fed = Federation(grid, _config(tmp_path, secure_aggregation=False, distill="only"), flwr_run_id="22")
    fed.run()
    assert seen == []  # send-weights=false: the factories answered with predictions only
    (round1,) = Registry.at(tmp_path / "registry").rounds("run-22")
    assert round1.status == "completed" and round1.metrics["uplink-bytes-per-factory"] == PROXY * CLASSES * 4 + CLASSES * 8


# -- secure distillation with real agents -----------------------------------------------------------------
@pytest.fixture
def agents(tmp_path):
    """Four real edge agents on loopback: three train cnn-small, one cnn-medium (a group of one)."""
    started = []
    for i, arch in enumerate(["cnn-small", "cnn-small", "cnn-small", "cnn-medium"]):
        cfg = AgentConfig(factory_id=f"factory-{i}", listen=f"127.0.0.1:{free_port()}", factory_index=i, num_factories=4, train_size=48,
                          architecture=arch, state_dir=str(tmp_path / f"factory-{i}"))
        started.append(serve(cfg))
    yield started
    for agent in started:
        agent.stop(0)


def test_secure_distillation_server_sees_only_sums_and_survives_a_dropout(tmp_path, agents, monkeypatch):
    predictions: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # factory -> (balanced predictions, class counts)
    for agent in agents:
        original = agent.trainer.predict

        def recording(weights, config, proxy, temperature, *where, _orig=original, _id=agent.trainer.cfg.factory_id):
            out = _orig(weights, config, proxy, temperature, *where)
            predictions[_id] = out
            return out
        agent.trainer.predict = recording
    unmasked = []
    original_result = SecureSum.result
    monkeypatch.setattr(SecureSum, "result", lambda self, answers, terms: unmasked.append(original_result(self, answers, terms)) or unmasked[-1])

    recorded: dict[str, list] = {"server-saw": []}
    drops = lambda msg, factory_id: msg.metadata.message_type == "train" and factory_id == "factory-2"  # out of the prediction phase
    grid = ScriptedGrid({i + 1: agent_node(agent, recorded, drops) for i, agent in enumerate(agents)})
    fed = Federation(grid, _config(tmp_path, distill="after", secagg_threshold=3, local_epochs=1, round_timeout=20), flwr_run_id="23")
    fed.run()

    registry = Registry.at(tmp_path / "registry")
    (round1,) = registry.rounds("run-23")
    assert round1.status == "completed", round1.metrics
    assert "factory-2" in round1.failures  # dropped out of the prediction phase; the round went on
    assert sorted(round1.participants) == ["factory-0", "factory-1", "factory-3"]
    # Everything the server received from the train phase was masked uint64; the proxy went out once, as images.
    assert {name for name, _ in recorded["server-saw"]} == {"masked"}
    masked = [a for name, a in recorded["server-saw"] if name == "masked"]
    assert all(a.dtype == np.uint64 for a in masked)
    # The only vector unmasked is the sum; its prediction part is the mean of the survivors' predictions.
    assert len(unmasked) == 1
    survivors = [predictions[f] for f in ("factory-0", "factory-1", "factory-3")]
    width, metrics_slot = PROXY * CLASSES + CLASSES, 1 + len(SUMMED_METRICS)  # the layout ends with the predictions, then the metrics
    decoded = quantize.decode(unmasked[0], fed.cfg.secagg_scale)[-(width + metrics_slot) : -metrics_slot]
    assert np.allclose(decoded[-CLASSES:], sum(c for _, c in survivors))
    assert np.allclose(decoded[:-CLASSES].reshape(PROXY, CLASSES), sum(c[None, :] * q for q, c in survivors), atol=1e-4)
    for q, c in survivors:  # no masked input decodes to a factory's own contribution
        for m in masked:
            assert not np.allclose(quantize.decode(m, fed.cfg.secagg_scale)[-CLASSES:], c, atol=1e-3)
    # cnn-medium is a group of one: it contributed predictions only, so its line changed only by distillation.
    medium = [v for v in registry.versions("run-23") if v.architecture == "cnn-medium"]
    assert [v.kind for v in medium] in (["initial"], ["initial", "distilled"])
    small = [v for v in registry.versions("run-23") if v.architecture == "cnn-small"]
    assert next(v.kind for v in small) == "initial" and small[1].kind in ("fedavg", "distilled")


def test_secure_distillation_only_rounds_send_predictions_and_no_weights(tmp_path, agents):
    recorded: dict[str, list] = {"server-saw": []}
    grid = ScriptedGrid({i + 1: agent_node(agent, recorded) for i, agent in enumerate(agents)})
    fed = Federation(grid, _config(tmp_path, distill="only", secagg_threshold=3, local_epochs=1, round_timeout=60), flwr_run_id="24")
    fed.run()
    (round1,) = Registry.at(tmp_path / "registry").rounds("run-24")
    assert round1.status in ("completed", "aborted") and not round1.failures, round1.failures  # aborted: both distillations dropped
    masked = [a for name, a in recorded["server-saw"] if name == "masked"]
    assert len(masked) == 4 and all(len(m) == PROXY * CLASSES + CLASSES + 1 + len(SUMMED_METRICS) for m in masked)  # no weight slots at all
    versions = Registry.at(tmp_path / "registry").versions("run-24")
    assert {v.architecture for v in versions} == {"cnn-small", "cnn-medium"}
    assert all(v.kind in ("initial", "distilled") for v in versions)  # only distillation changes a model here
    for arch in ("cnn-small", "cnn-medium"):
        assert f"{arch}/distill-kept" in round1.metrics  # distilled (kept or not) into every group


def test_distillation_into_the_pretrained_head_over_cached_proxy_features(tmp_path, monkeypatch):
    """Two real agents on the frozen backbone: they predict on the proxy set through their cached features, and the server
    distils the ensemble into the head over the proxy set's features (it never runs the backbone per epoch)."""
    monkeypatch.delenv("FEDFORGE_FEATURE_CACHE")  # each process's own cache: the server must compute the proxy features itself
    started = [serve(AgentConfig(factory_id=f"factory-{i}", listen=f"127.0.0.1:{free_port()}", factory_index=i, num_factories=2, train_size=48,
                                 architecture="effnet-lite0", state_dir=str(tmp_path / f"factory-{i}"))) for i in range(2)]
    try:
        recorded: dict[str, list] = {"server-saw": []}
        grid = ScriptedGrid({i + 1: agent_node(agent, recorded) for i, agent in enumerate(started)})
        fed = Federation(grid, _config(tmp_path, architecture="effnet-lite0", secure_aggregation=False, distill="after", round_timeout=120),
                         flwr_run_id="25")
        fed.run()
        cache_hits = [agent.trainer.features.hits for agent in started]
    finally:
        for agent in started:
            agent.stop(0)
    (round1,) = Registry.at(tmp_path / "registry").rounds("run-25")
    assert round1.status == "completed" and "effnet-lite0/distill-kept" in round1.metrics
    assert len(recorded["server-saw"]) and {n for n, _ in recorded["server-saw"]} >= {"weight", "bias", "probabilities"}  # head + predictions
    assert fed.central.features.misses >= PROXY  # the proxy set's features, computed once at the server
    assert all(h >= 0 for h in cache_hits)


# -- end to end ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.usefixtures("no_leftover_processes")
def test_demo_distills_across_two_architectures(tmp_path):
    """`fedforge demo --distill --architectures cnn-small,effnet-lite0` over real processes; each group improves.

    Two factories, one per architecture, in plain rounds (a group of one sends predictions only under
    secure aggregation, see the test above): each group's line gets a version per round, and the
    ensemble of both is distilled into each.
    """
    summary_path = tmp_path / "summary.json"
    proc = subprocess.run(fedforge_command() + [
        "demo", "--factories", "2", "--rounds", "2", "--local-epochs", "3", "--train-size", "300", "--distill", "--no-secure",
        "--architectures", "cnn-small,effnet-lite0", "--min-factories", "2", "--set", "proxy-size=120", "--set", "distill-epochs=5",
        "--set", "personal-epochs=0", "--set", "server-optimizer=fedavg", "--set", "lr-schedule=constant",  # from-scratch CNNs, 2 rounds
        "--workdir", str(tmp_path / "demo"), "--json", str(summary_path),
    ], capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "finished" and [r["status"] for r in summary["rounds"]] == ["completed", "completed"]
    groups = summary["architectures"]
    assert set(groups) == {"cnn-small", "effnet-lite0"}
    for arch, g in groups.items():
        assert g["versions"] == 3, (arch, g)
        assert g["final_accuracy"] > g["initial_accuracy"] + 0.05, (arch, g)
    lines = {arch: [v for v in summary["versions"] if v["architecture"] == arch] for arch in groups}
    for line in lines.values():  # each architecture is its own lineage
        assert [v["parent"] for v in line] == [None, line[0]["id"], line[1]["id"]]
    assert "effnet-lite0" in proc.stderr
    # The dashboard's run page shows each architecture's accuracy and the distillation decision per round.
    from fastapi.testclient import TestClient

    from server.dashboard.app import DashboardSettings, create_app

    with TestClient(create_app(DashboardSettings(tmp_path / "demo" / "central" / "registry", "admin-token", ""))) as client:
        page = client.get(f"/runs/{summary['run_id']}")
    assert page.status_code == 200
    groups_cells = page.text.count('<td class="groups">')
    assert groups_cells == 2 and page.text.count("effnet-lite0 0.") == 2 and page.text.count("cnn-small 0.") == 2
    assert "distilled" in page.text and ("kept" in page.text or "dropped" in page.text)
