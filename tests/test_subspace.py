"""DP-SGD within a public subspace (client.subspace): what is trained, what leaves, and what the subspace may depend on."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis.gdp import eps_from_mu
from torch import nn

from client.config import AgentConfig
from client.dp import DPPlan, noisy_gradient_step, sample_rate, train_private
from client.subspace import SubspaceError, SubspaceHead, fit_subspace
from client.trainer import FactoryTrainer
from common.data import datasets
from common.distill import ProxySet
from common.models import build_model, weights_of
from common.training import TrainConfig, prior_adjustment

ARCH = "effnet-lite0"
CONFIG = {"architecture": ARCH, "local-epochs": 1, "public-subspace": 12}


def _public(count: int = 40, seed: int = 5) -> ProxySet:
    return ProxySet(datasets.proxy_images(datasets.SyntheticSpec(seed=seed), count))


def _trainer(tmp_path, name: str, dp: bool = True, index: int = 0) -> FactoryTrainer:
    return FactoryTrainer(AgentConfig(factory_id=name, factory_index=index, num_factories=2, train_size=60, dp=dp, dp_epsilon=8.0,
                                      dp_planned_rounds=3, state_dir=str(tmp_path / name)))


def test_the_subspace_is_the_top_principal_directions_scaled_and_the_same_every_time():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 30)) * 2.0 ** -np.arange(30)  # variance halves from one axis to the next
    sub = fit_subspace(x, 4, whitening=0.25)
    again = fit_subspace(x.copy(), 4, whitening=0.25)
    assert sub.dims == 4 and sub.digest() == again.digest()
    norms = np.linalg.norm(sub.basis, axis=0)
    directions = sub.basis / norms
    np.testing.assert_allclose(directions.T @ directions, np.eye(4), atol=1e-5)  # orthonormal directions
    s = np.linalg.svd(x - x.mean(0), compute_uv=False)[:4]
    np.testing.assert_allclose(norms, (s / s[0]) ** -0.25, rtol=1e-5)  # each scaled by (s_j / s_1)^-w
    assert np.abs(directions).argmax(axis=0).tolist() == [0, 1, 2, 3]  # the axes of largest variance, in order
    assert fit_subspace(x[:, :3], 10, 0.0).dims == 3  # never more directions than the public images span


def test_with_fewer_public_images_than_features_the_subspace_is_the_svds_and_spans_no_more_than_the_images():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(60, 500)) * 1.5 ** -np.arange(500)  # the usual case: a few hundred images, thousands of features
    sub = fit_subspace(x, 8, whitening=0.5)
    _, s, vt = np.linalg.svd(x - x.mean(0), full_matrices=False)
    directions = vt[:8] * np.sign(vt[np.arange(8), np.abs(vt[:8]).argmax(axis=1)])[:, None]
    np.testing.assert_allclose(sub.basis, (directions.T * (s[:8] / s[0]) ** -0.5).astype(np.float32), atol=1e-5)
    assert fit_subspace(np.repeat(x[:20], 3, axis=0), 40, 0.5).dims == 19  # 20 distinct images, centred: 19 directions


def test_the_public_feature_norm_is_the_median_norm_of_the_public_coordinates_with_the_bias_input():
    """What an example's gradient norm in the subspace head scales with, from the public images alone (--dp-max-grad-norm public)."""
    x = np.random.default_rng(3).normal(size=(101, 20)) * 4.0
    sub = fit_subspace(x, 6, whitening=0.5)
    z = (x - sub.mean.astype(np.float64)) @ sub.basis.astype(np.float64)
    assert sub.feature_norm == pytest.approx(np.median(np.sqrt((z**2).sum(axis=1) + 1.0)), rel=1e-6)
    assert fit_subspace(x * 10, 6, whitening=0.5).feature_norm == pytest.approx(10 * sub.feature_norm, rel=0.01)  # scales with the features


@pytest.mark.parametrize("bad, match", [(np.zeros((8, 5)), "at least 16"), (np.full((20, 5), np.nan), "finite"), (np.ones((20, 5)), "do not vary")])
def test_public_images_that_cannot_give_a_subspace_are_refused_with_the_reason(bad, match):
    with pytest.raises(SubspaceError, match=match):
        fit_subspace(bad, 4, 0.25)


def test_the_subspace_head_starts_as_the_received_head_and_folds_into_an_ordinary_head_computing_the_same():
    torch.manual_seed(0)
    head = nn.Linear(30, 6)
    sub = fit_subspace(np.random.default_rng(1).normal(size=(50, 30)), 5, 0.25)
    module = SubspaceHead(head, sub)
    x = torch.randn(16, 30)
    torch.testing.assert_close(module(x), head(x))  # delta starts at zero
    assert [name for name, p in module.named_parameters()] == ["delta.weight", "delta.bias"] and module.delta.weight.shape == (6, 5)
    with torch.no_grad():
        module.delta.weight.normal_()
        module.delta.bias.normal_()
    folded = nn.Linear(30, 6)
    folded.load_state_dict({k: torch.from_numpy(v) for k, v in module.fold().items()})
    torch.testing.assert_close(folded(x), module(x), atol=1e-4, rtol=1e-4)
    with pytest.raises(SubspaceError, match="over 30 features, the head over 7"):
        SubspaceHead(nn.Linear(7, 6), sub)


def test_dp_training_moves_the_head_only_within_the_public_subspace_and_is_accounted_at_the_private_batch(tmp_path):
    trainer = _trainer(tmp_path, "dp-sub")
    public = _public()
    weights = weights_of(build_model(ARCH, 6, seed=1))
    local = trainer.train(weights, CONFIG, 1, run_id="r", public=public)
    assert local.privacy["dp-subspace-dims"] == 12 and list(local.weights) == ["weight", "bias"]
    sub = next(iter(trainer._subspaces.values()))
    q, _ = np.linalg.qr(sub.basis.astype(np.float64))
    update = local.weights["weight"].astype(np.float64) - weights["weight"]
    assert np.linalg.norm(update) > 0
    assert np.linalg.norm(update - (update @ q) @ q.T) < 1e-4 * np.linalg.norm(update)  # no component outside the subspace
    n = local.examples  # the total of the released class counts, which the schedule is planned from
    release, (noise, rate, steps) = trainer.ledger.history()  # the class counts' one release, then the round
    assert rate == sample_rate(n, 256) == 1.0 and steps == 1  # the private-head batch (256, more than n), one epoch
    # two full-batch Gaussian releases: exactly (sqrt(1 / 4^2 + 1 / noise^2))-GDP, Opacus' dual gives epsilon; RDP is looser
    exact = eps_from_mu(mu=math.sqrt(1 / release[0] ** 2 + 1 / noise**2), delta=1e-5)
    assert local.privacy["epsilon-spent"] == pytest.approx(exact, rel=1e-6)
    accountant = RDPAccountant()
    accountant.history = [release, (noise, rate, steps)]
    assert local.privacy["epsilon-spent"] < accountant.get_epsilon(delta=1e-5)
    trainer.close()


def test_the_subspace_depends_on_the_public_images_only(tmp_path):
    """Two factories with different private images fit the same subspace from the same public set: nothing of their own data enters it."""
    public = _public()
    weights = weights_of(build_model(ARCH, 6, seed=1))
    digests = []
    for i in (0, 1):
        trainer = _trainer(tmp_path, f"factory-{i}", index=i)
        trainer.train(weights, CONFIG, 1, run_id="r", public=public)
        (sub,) = trainer._subspaces.values()
        digests.append(sub.digest())
        trainer.close()
    assert digests[0] == digests[1]


def test_without_usable_public_images_dp_trains_the_whole_head_and_says_why(tmp_path, caplog):
    weights = weights_of(build_model(ARCH, 6, seed=1))
    trainer = _trainer(tmp_path, "dp-whole")
    with caplog.at_level(logging.INFO, logger="client.trainer"):
        none_sent = trainer.train(weights, CONFIG, 1, run_id="r")
        too_few = trainer.train(weights, CONFIG, 2, run_id="r", public=_public(count=8))  # what a hostile server might send
    assert none_sent.privacy["dp-subspace-dims"] == 0 and too_few.privacy["dp-subspace-dims"] == 0
    assert "sent no public proxy set" in caplog.text and "at least 16" in caplog.text
    assert not np.allclose(too_few.weights["weight"], weights["weight"])
    trainer.close()


def test_without_dp_the_public_set_changes_nothing(tmp_path):
    weights = weights_of(build_model(ARCH, 6, seed=1))
    runs = []
    for name, public in (("plain-a", None), ("plain-b", _public())):
        trainer = _trainer(tmp_path, name, dp=False)
        local = trainer.train(weights, CONFIG, 1, run_id="r", public=public)
        runs.append(local.weights)
        assert local.privacy == {}
        trainer.close()
    assert all(np.array_equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_dp_head_settings_are_checked_by_name():
    with pytest.raises(ValueError, match="private-head-optimizer"):
        TrainConfig.from_run_config({"private-head-optimizer": "lion"})
    with pytest.raises(ValueError, match="public-subspace-whitening"):
        TrainConfig.from_run_config({"public-subspace-whitening": 2.0})
    with pytest.raises(ValueError, match="private-head-logit-adjustment"):
        TrainConfig.from_run_config({"private-head-logit-adjustment": -1.0})
    assert TrainConfig().private_head() == TrainConfig(optimizer="sgd", lr=0.3, batch_size=256)


def test_a_dp_head_trains_on_logits_adjusted_by_the_prior_of_its_released_counts_never_its_exact_ones(tmp_path, monkeypatch):
    import client.trainer as trainer_module

    shifts = []

    def spy(model, data, cfg, plan, logit_shift=None):
        shifts.append(logit_shift)
        return train_private(model, data, cfg, plan, logit_shift=logit_shift)

    monkeypatch.setattr(trainer_module, "train_private", spy)
    weights = weights_of(build_model(ARCH, 6, seed=1))
    trainer = _trainer(tmp_path, "dp-adjusted")
    local = trainer.train(weights, CONFIG, 1, run_id="r", public=_public())
    prep = trainer.prepare(weights, CONFIG)
    released = trainer.class_counts(prep, "r", 1)  # the one noisy release, the same every time it is asked for
    exact = np.bincount(np.asarray(prep.train_set.labels), minlength=6)
    assert shifts[0] is not None and torch.allclose(shifts[0], prior_adjustment(released, 1.0))
    assert not np.array_equal(released, exact) and local.examples == max(1, int(released.sum()))
    trainer.train(weights, {**CONFIG, "private-head-logit-adjustment": 0.0}, 2, run_id="r", public=_public())
    assert shifts[1] is None
    trainer.close()

    # a factory that shares the secure sum's noise takes one full-batch step, on the same adjusted logits
    steps = []

    def step_spy(*args, logit_shift=None, **kwargs):
        steps.append(logit_shift)
        return noisy_gradient_step(*args, logit_shift=logit_shift, **kwargs)

    monkeypatch.setattr(trainer_module, "noisy_gradient_step", step_spy)
    shared = FactoryTrainer(AgentConfig(factory_id="dp-shared", num_factories=2, train_size=60, dp=True, dp_epsilon=8.0, dp_planned_rounds=3,
                                        dp_secure_sum=True, state_dir=str(tmp_path / "dp-shared")))
    shared.train(weights, CONFIG, 1, run_id="r", public=_public(), noise_holders=2)
    released = shared.class_counts(shared.prepare(weights, CONFIG), "r", 1)
    assert steps[0] is not None and torch.allclose(steps[0], prior_adjustment(released, 1.0))
    shared.close()


def test_without_dp_the_head_trains_with_the_head_keys_and_a_cnn_with_the_general_ones(tmp_path, monkeypatch):
    """The trainer's choice of tau and of FedProx's mu: the pretrained head without DP takes head-logit-adjustment (default 1)
    and head-proximal-mu, a cnn-* model logit-adjustment (default 0) and proximal-mu (default 0)."""
    import client.trainer as trainer_module
    from common.training import TrainConfig, train

    taus, mus = [], []

    def spy(model, data, cfg, *args, **kwargs):
        taus.append(cfg.logit_adjustment)
        mus.append(cfg.proximal_mu)
        return train(model, data, cfg, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "train", spy)
    trainer = _trainer(tmp_path, "plain", dp=False)
    head = weights_of(build_model(ARCH, 6, seed=1))
    trainer.train(head, {**CONFIG, "personal-epochs": 0}, 1, run_id="r")
    trainer.train(head, {**CONFIG, "personal-epochs": 0, "head-logit-adjustment": 0.5, "logit-adjustment": 2.0,
                         "head-proximal-mu": 0.25, "proximal-mu": 3.0}, 2, run_id="r")
    cnn = {"architecture": "cnn-small", "local-epochs": 1, "personal-epochs": 0}
    trainer.train(weights_of(build_model("cnn-small", 6, seed=1)), cnn, 3, run_id="r")
    trainer.train(weights_of(build_model("cnn-small", 6, seed=1)), {**cnn, "logit-adjustment": 2.0, "proximal-mu": 3.0}, 4, run_id="r")
    assert taus == [1.0, 0.5, 0.0, 2.0]
    assert mus == [TrainConfig().head_proximal_mu, 0.25, 0.0, 3.0]
    assert TrainConfig().personal().proximal_mu == 0.0  # the personal fine-tune stays unanchored
    with pytest.raises(ValueError, match="head-proximal-mu"):
        TrainConfig.from_run_config({"head-proximal-mu": -0.1})
    taus.clear()
    mus.clear()
    trainer.train(head, {**CONFIG, "personal-epochs": 1, "local-only-epochs": 1}, 5, run_id="r")
    trainer.wait_personal()
    assert taus[0] == 1.0 and taus[1:] and set(taus[1:]) == {0.0}, taus  # the round, then the personal model's trainings
    assert mus[0] == TrainConfig().head_proximal_mu and set(mus[1:]) == {0.0}, mus  # ...which are not anchored to the global head
    trainer.close()


def test_logit_adjusted_dp_sgd_leans_less_to_the_majority_class():
    """On features where one class holds 90% of the images, DP-SGD on logits + log(prior) predicts the rare classes more often
    on a balanced test set than DP-SGD on the plain logits; the module it returns computes plain logits."""
    from tests.conftest import majority_class_features, rare_class_recall

    train, test = majority_class_features(seed=0, spread=1.0)
    plan = DPPlan(noise_multiplier=0.3, max_grad_norm=1.0, sample_rate=sample_rate(len(train), 64))
    cfg = TrainConfig(epochs=8, lr=0.5, optimizer="sgd", batch_size=64)
    recall = {}
    for name, shift in (("plain", None), ("adjusted", prior_adjustment(np.bincount(train.labels, minlength=3), 1.0))):
        torch.manual_seed(0)
        head = nn.Linear(8, 3)
        train_private(head, train, cfg, plan, logit_shift=shift)
        assert isinstance(head, nn.Linear)  # trained in place; no shift is left in it
        recall[name] = rare_class_recall(head, test)  # rare-class images not called the majority class
    assert recall["adjusted"] > recall["plain"] + 0.05, recall  # 0.12-0.15 apart in 14 runs (DP noise and sampling vary)


def test_a_secure_sum_step_in_a_public_subspace_clips_at_a_fifth_of_the_public_feature_norm_in_units_of_it(tmp_path, monkeypatch):
    """--dp-max-grad-norm public (the default) with --dp-secure-sum: clip at a fifth of the public feature norm, step
    secure-sum-lr / norm (secure-sum-lr keeps its meaning), and the round reports the norm; a number set by the factory is
    used as it is, in the same units."""
    import client.trainer as trainer_module

    calls = []
    real = trainer_module.noisy_gradient_step

    def spy(model, data, lr, noise_multiplier, max_grad_norm, **kw):
        calls.append((lr, max_grad_norm))
        return real(model, data, lr, noise_multiplier, max_grad_norm, **kw)

    monkeypatch.setattr(trainer_module, "noisy_gradient_step", spy)
    weights = weights_of(build_model(ARCH, 6, seed=1))
    config = {**CONFIG, "secure-sum-lr": 3.0}
    for name, norm in (("public", "public"), ("default", None), ("set", 2.5)):
        given = {} if norm is None else {"dp_max_grad_norm": norm}
        trainer = FactoryTrainer(AgentConfig(factory_id=name, factory_index=0, num_factories=2, train_size=60, dp=True, dp_secure_sum=True,
                                             dp_planned_rounds=3, state_dir=str(tmp_path / name), **given))
        privacy = trainer.train(weights, config, 1, run_id="r", public=_public(), noise_holders=2).privacy
        (sub,) = trainer._subspaces.values()
        clip = 0.2 * sub.feature_norm if norm in ("public", None) else norm
        assert calls[-1] == (pytest.approx(3.0 / clip), pytest.approx(clip)) and privacy["dp-max-grad-norm"] == pytest.approx(clip)
        trainer.close()
    assert sub.feature_norm > 3  # the pretrained features' scale: not the default 1.0
