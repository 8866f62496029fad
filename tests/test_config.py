"""The run configuration: pyproject's table, the server's and the trainer's config types agree key for key."""

import itertools
import logging
import tomllib
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from common.simulation import RUN_CONFIG_DEFAULTS as SIMULATION_DEFAULTS
from common.training import TrainConfig
from server.config import FederationConfig
from server.optimizers import ServerOptimizer

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_pyproject_lists_exactly_the_server_trainer_and_simulation_keys_with_their_defaults():
    table = tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    expected = {**FederationConfig.server_keys(), **TrainConfig.run_config_defaults(), **SIMULATION_DEFAULTS}
    assert not set(FederationConfig.server_keys()) & set(TrainConfig.run_config_defaults()), "a key may belong to one config type only"
    assert set(table) == set(expected), (sorted(set(table) - set(expected)), sorted(set(expected) - set(table)))
    assert {k: table[k] for k in expected} == expected


def test_every_training_option_is_reachable_from_the_run_config():
    run = {"local-epochs": 3, "augment": True, "weight-decay": 0.01, "grad-clip": 1.5, "bf16": True, "activation-checkpointing": True,
           "proximal-mu": 0.1, "lr": 0.01}
    cfg = FederationConfig.from_run_config({**run, "num-server-rounds": 5})
    assert cfg.num_server_rounds == 5
    assert {k: cfg.training.to_run_config()[k] for k in run} == run
    sent = cfg.train_config(1, "cnn-small")
    assert {k: sent[k] for k in run} == run and sent["classes"] == cfg.classes
    # the image size, unless set: the pretrained backbone's input (128 px, the default architecture's), 64 px for a CNN
    assert sent["image-size"] == 128 and FederationConfig.from_run_config({"architecture": "cnn-small"}).image_size == 64
    assert FederationConfig.from_run_config({"image-size": 96}).image_size == 96
    # lr-schedule = cosine (the default): round 1 trains at lr, the last round at lr / 10, smoothly in between
    lrs = [cfg.train_config(r, "cnn-small")["lr"] for r in range(1, cfg.num_server_rounds + 1)]
    assert lrs[0] == 0.01 and lrs[-1] == pytest.approx(0.001) and all(a > b for a, b in itertools.pairwise(lrs))
    # so does the learning rate of a head trained with DP-SGD (its own base rate, the same decay)
    private = [cfg.train_config(r, "effnet-lite0")["private-head-lr"] for r in range(1, cfg.num_server_rounds + 1)]
    assert private[0] == cfg.training.private_head_lr and private[-1] == pytest.approx(cfg.training.private_head_lr / 10)
    assert private == pytest.approx([lr / 0.01 * cfg.training.private_head_lr for lr in lrs])
    # and the step of a factory that shares the secure sum's noise (--dp-secure-sum)
    shared = [cfg.train_config(r, "effnet-lite0")["secure-sum-lr"] for r in range(1, cfg.num_server_rounds + 1)]
    assert shared == pytest.approx([lr / 0.01 * cfg.training.secure_sum_lr for lr in lrs])
    constant = FederationConfig.from_run_config({**run, "lr-schedule": "constant"})
    assert {constant.train_config(r)["lr"] for r in (1, 5, 10)} == {0.01}
    assert {constant.train_config(r)["private-head-lr"] for r in (1, 5, 10)} == {cfg.training.private_head_lr}


def test_unknown_keys_are_logged_and_bad_values_name_their_key(caplog):
    with caplog.at_level(logging.WARNING, logger="fedforge.server"):
        FederationConfig.from_run_config({"learning-rate": 0.1})
    assert "learning-rate" in caplog.text
    with pytest.raises(ValueError, match="'local-epochs'"):
        FederationConfig.from_run_config({"local-epochs": "many"})
    with pytest.raises(ValueError, match="server-optimizer"):
        FederationConfig.from_run_config({"server-optimizer": "sgd"})
    with pytest.raises(ValueError, match="more than once"):
        FederationConfig.from_run_config({"classes": "ok,crack,ok"})
    with pytest.raises(ValueError, match="run-config key feature-device 'tpu'"):
        FederationConfig.from_run_config({"feature-device": "tpu"})


def test_the_pretrained_heads_line_steps_with_head_server_lr_and_a_cnn_line_with_server_lr():
    """The head's server step is 2 by default (docs/benchmarks.md, "A thirteenth data set"); its DP steps are halved with it,
    so the secure-sum step moves the global head exactly as before: FedAvgM is linear in the average's delta."""
    cfg = FederationConfig()
    assert (cfg.server_lr_for("effnet-lite0"), cfg.server_lr_for("cnn-small")) == (2.0, 1.0)
    assert (cfg.training.secure_sum_lr, cfg.training.private_head_lr) == (1.5, 0.3)
    run = FederationConfig.from_run_config({"head-server-lr": 3.0, "server-lr": 0.5})
    assert (run.server_lr_for("effnet-lite0"), run.server_lr_for("cnn-medium")) == (3.0, 0.5)
    with pytest.raises(ValueError, match="head-server-lr"):
        FederationConfig.from_run_config({"head-server-lr": 0.0})
    w = OrderedDict(a=np.array([1.0, -2.0]))
    step = np.array([0.3, -0.6])  # one round's full-batch step at secure-sum-lr 3 ...
    before, now = ServerOptimizer("fedavgm", 1.0, 0.7), ServerOptimizer("fedavgm", 2.0, 0.7)
    for _ in range(3):
        old, new = before.step(w, OrderedDict(a=w["a"] + step)), now.step(w, OrderedDict(a=w["a"] + step / 2))  # ... and at 1.5
        np.testing.assert_allclose(old["a"], new["a"], rtol=1e-12)
        w = old


def test_every_line_of_a_round_is_sent_the_same_terms_but_its_architecture():
    """Factories of every line add into one secure sum, whose masks cancel only between factories that received the same
    round terms (`common.secagg.terms`): a training option that depended on the line (a step scaled by the line's server
    step, say) would make a mixed run's secure sum never unmask."""
    from common.secagg.layout import SecureLayout
    from common.secagg.terms import PER_FACTORY_KEYS, round_terms

    layout = SecureLayout.of({"effnet-lite0": 6, "cnn-small": 8}, classes=2)
    for cfg in (FederationConfig(), FederationConfig.from_run_config({"head-server-lr": 3.0, "server-lr": 0.5})):
        for r in (1, cfg.num_server_rounds):
            lines = [cfg.train_config(r, arch) for arch in ("effnet-lite0", "cnn-small", "cnn-medium")]
            assert all({k: v for k, v in c.items() if k not in PER_FACTORY_KEYS} == {k: v for k, v in lines[0].items() if k not in PER_FACTORY_KEYS}
                       for c in lines)
            assert len({round_terms(c, 10.0, 1e6, 1000, layout) for c in lines}) == 1
