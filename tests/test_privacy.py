"""DP-SGD at the factory: noise applied, epsilon accounted across rounds and restarts, budget enforced."""

from __future__ import annotations

import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import OrderedDict

import grpc
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from google.protobuf import struct_pb2
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.analysis.gdp import eps_from_mu
from torch import nn

from client.config import AgentConfig
from client.dp import DPConfigError, DPPlan, check_dp_compatible, noisy_gradient_step, sample_rate, steps_per_epoch, train_private
from client.privacy import BudgetExhausted, PrivacyBudget, PrivacyLedger, epsilon_of, noise_for_budget
from client.trainer import FactoryTrainer
from common.data import datasets
from common.features import FeatureSet
from common.models import build_model
from common.procs import free_port
from common.rpc.fedforge.v1 import edge_pb2, edge_pb2_grpc
from common.tensors import from_tensor, to_tensors
from common.training import TrainConfig


def opacus_epsilon(history: list[tuple[float, float, int]], delta: float = 1e-5) -> float:
    """What the ledger must report, from Opacus alone: full-batch histories exactly (mu-GDP, the mus in quadrature,
    Opacus' dual), any other the smaller of Opacus' RDP and PRV upper bounds."""
    if all(rate == 1.0 for _, rate, _ in history):
        return eps_from_mu(mu=math.sqrt(sum(steps / noise**2 for noise, _, steps in history)), delta=delta)
    rdp, prv = RDPAccountant(), PRVAccountant()
    rdp.history = prv.history = list(history)
    bound = rdp.get_epsilon(delta=delta)  # PRV's upper bound, its error allowed to be 0.5% of the RDP bound (at least 0.01)
    return min(bound, prv.get_epsilon(delta=delta, eps_error=round(max(0.01, 0.005 * bound), 4)))


def _global():
    return OrderedDict((k, v.numpy()) for k, v in build_model("cnn-small", 6, seed=1).state_dict().items())


def _cfg(tmp_path, **kw):
    # no personal model: these tests are about what leaves the factory and what it costs, and a personal fine-tune (ten
    # local epochs, in a thread beside the next test) costs each train() call seconds
    base = {"factory_id": "dp-plant", "train_size": 96, "dp": True, "dp_epsilon": 4.0, "dp_planned_rounds": 4, "state_dir": str(tmp_path / "state"),
            "personalize": False}
    return AgentConfig(**{**base, **kw})


CONFIG = {"architecture": "cnn-small", "local-epochs": 1, "batch-size": 16}


def test_noise_is_actually_applied():
    data = datasets.factory_dataset(datasets.SyntheticSpec(train_size=64), 0)
    cfg = TrainConfig(epochs=1, batch_size=16, optimizer="sgd", lr=0.05)  # SGD: the step is proportional to the noisy gradient
    results = []
    for noise in (0.0, 1.0):
        model = build_model("cnn-small", 6, seed=3)
        train_private(model, data, cfg, DPPlan(noise_multiplier=noise, max_grad_norm=1.0, sample_rate=sample_rate(len(data), 16)))
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    start = torch.cat([p.detach().flatten() for p in build_model("cnn-small", 6, seed=3).parameters()])
    # with noise the weights move much further than clipped gradients alone move them
    assert (results[1] - start).norm() > 3 * (results[0] - start).norm()


def test_epsilon_grows_and_matches_opacus_accountant(tmp_path):
    trainer = FactoryTrainer(_cfg(tmp_path))
    eps = []
    for r in range(1, 4):
        metrics = trainer.train(_global(), CONFIG, r, run_id="run-a").privacy
        eps.append(metrics["epsilon-spent"])
        assert metrics["epsilon-remaining"] == pytest.approx(4.0 - metrics["epsilon-spent"])
        assert not any(k.startswith("_module.") for k in trainer.prepare(_global(), CONFIG).model.state_dict())
    assert eps[0] < eps[1] < eps[2] <= 4.0
    assert opacus_epsilon(trainer.ledger.history()) == pytest.approx(eps[-1], rel=1e-9)
    assert {rate for _, rate, _ in trainer.ledger.history()} != {1.0}  # subsampled steps: RDP and PRV bounds, the smaller
    accountant = RDPAccountant()
    accountant.history = trainer.ledger.history()
    assert eps[-1] < accountant.get_epsilon(delta=1e-5)

    # a restarted agent reads the same ledger: nothing is forgotten
    again = FactoryTrainer(_cfg(tmp_path))
    assert again.privacy_status()["epsilon-spent"] == pytest.approx(eps[-1])


def test_round_over_budget_is_refused_and_not_charged(tmp_path, caplog):
    trainer = FactoryTrainer(_cfg(tmp_path, dp_epsilon=2.0, dp_planned_rounds=2))
    trainer.train(_global(), CONFIG, 1, run_id="r")
    trainer.train(_global(), CONFIG, 2, run_id="r")
    # DP on a from-scratch model runs as asked, and the operator is told, once, that it learns next to nothing
    assert caplog.text.count("DP training of the from-scratch cnn-small") == 1 and "pretrained architecture" in caplog.text
    charged = len(trainer.ledger.charges())
    with pytest.raises(BudgetExhausted, match="exhausted.*refused.*--dp-epsilon"):
        trainer.train(_global(), CONFIG, 3, run_id="r")
    assert len(trainer.ledger.charges()) == charged
    # more local epochs cost more privacy: also refused
    with pytest.raises(BudgetExhausted):
        trainer.train(_global(), {**CONFIG, "local-epochs": 5}, 3, run_id="r")


def test_server_cannot_raise_the_budget_or_lower_the_noise(tmp_path, caplog, monkeypatch):
    import client.trainer

    # the same release at both factories: the schedule, and with it the noise, is planned from it
    monkeypatch.setattr(client.trainer, "noisy_counts", lambda counts, noise: np.asarray(counts, dtype=np.float64))
    honest = FactoryTrainer(_cfg(tmp_path / "a"))
    m_honest = honest.train(_global(), CONFIG, 1, run_id="r").privacy
    greedy = FactoryTrainer(_cfg(tmp_path / "b"))
    m_greedy = greedy.train(_global(), {**CONFIG, "dp-epsilon": 1e9, "noise-multiplier": 0.0, "dp-delta": 0.5}, 1, run_id="r").privacy
    for key in ("noise-multiplier", "epsilon-spent", "epsilon-max", "delta"):
        assert m_greedy[key] == pytest.approx(m_honest[key])
    assert "ignoring privacy settings sent by the server" in caplog.text


def test_batchnorm_is_refused_with_advice_or_fixed():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2))
    with pytest.raises(DPConfigError, match="GroupNorm"):
        check_dp_compatible(model)
    fixed = check_dp_compatible(model, fix=True)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in fixed.modules())


def test_invalid_budget_is_rejected():
    with pytest.raises(ValueError, match="--dp-epsilon"):
        PrivacyBudget(epsilon_max=0, delta=1e-5)
    with pytest.raises(ValueError, match="--dp-delta"):
        PrivacyBudget(epsilon_max=1, delta=1.5)
    for bad in (0.0, -1.0, float("nan"), float("inf"), "auto"):
        with pytest.raises(ValueError, match="--dp-max-grad-norm must be a positive number or 'public'"):
            PrivacyBudget(epsilon_max=1, delta=1e-5, max_grad_norm=bad)


def test_the_clipping_norm_is_the_factorys_number_or_from_public_images_only_under_shared_noise():
    """public (the default): a fifth of the public feature norm for --dp-secure-sum's step in a public subspace, 1.0 for
    every other DP path; a number is used as it is on every path."""
    assert PrivacyBudget(8, 1e-5, max_grad_norm="public", secure_sum=True).clip_norm(11.5) == pytest.approx(2.3)
    assert PrivacyBudget(8, 1e-5, secure_sum=True).clip_norm(11.5) == pytest.approx(2.3)  # the default is public
    assert PrivacyBudget(8, 1e-5, max_grad_norm="public", secure_sum=True).clip_norm(None) == 1.0  # no public subspace (the whole head)
    assert PrivacyBudget(8, 1e-5, max_grad_norm="public").clip_norm(11.5) == 1.0  # local DP-SGD
    assert PrivacyBudget(8, 1e-5).clip_norm(None) == 1.0  # local DP-SGD of the whole head, by default
    assert PrivacyBudget(8, 1e-5, max_grad_norm=2.0, secure_sum=True).clip_norm(11.5) == 2.0
    assert PrivacyBudget(8, 1e-5, max_grad_norm=2.0).clip_norm(11.5) == 2.0


@pytest.mark.parametrize("given, expected", [("public", "public"), ("PUBLIC", "public"), ("2.5", 2.5), (3, 3.0)])
def test_the_clip_option_reads_a_number_or_public_and_refuses_anything_else(given, expected):
    import click

    from common.clip import CLIP_NORM

    assert CLIP_NORM.convert(given, None, None) == expected
    for bad in ("auto", "0", "-2", "inf", "nan"):
        with pytest.raises(click.BadParameter, match="public"):
            CLIP_NORM.convert(bad, None, None)


def test_refusal_reaches_the_caller_as_failed_precondition(tmp_path):
    from client.agent import serve

    address = f"127.0.0.1:{free_port()}"
    server = serve(_cfg(tmp_path, listen=address, dp_epsilon=0.05, dp_planned_rounds=50))
    try:
        stub = edge_pb2_grpc.EdgeAgentStub(grpc.insecure_channel(address))
        config = struct_pb2.Struct()
        config.update({**CONFIG, "local-epochs": 50})
        with pytest.raises(grpc.RpcError) as err:
            stub.Train(edge_pb2.TrainRequest(run_id="r", server_round=1, weights=to_tensors(_global()), config=config))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "refused and nothing is sent" in err.value.details()
    finally:
        server.stop(grace=None)


@pytest.mark.slow
def test_ledger_survives_kill_9_mid_round(tmp_path, no_leftover_processes):
    address = f"127.0.0.1:{free_port()}"
    state = tmp_path / "state"
    cmd = [sys.executable, "-m", "common.cli", "agent", "--factory-id", "k9", "--agent-listen", address, "--train-size", "300",
           "--dp", "--dp-epsilon", "50", "--state-dir", str(state), "--no-require-secure-aggregation"]  # Train RPC answers in plaintext

    def start():
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        channel = grpc.insecure_channel(address)
        grpc.channel_ready_future(channel).result(timeout=120)
        stub = edge_pb2_grpc.EdgeAgentStub(channel)
        for _ in range(600):
            try:
                stub.Health(edge_pb2.HealthRequest(), timeout=1)
                return proc, stub, channel
            except grpc.RpcError:
                time.sleep(0.2)
        raise TimeoutError("agent did not start")

    proc, stub, channel = start()
    config = struct_pb2.Struct()
    config.update({**CONFIG, "local-epochs": 20})
    request = edge_pb2.TrainRequest(run_id="r", server_round=1, weights=to_tensors(_global()), config=config)
    threading.Thread(target=lambda: pytest.raises(grpc.RpcError, stub.Train, request), daemon=True).start()
    ledger_path = state / "privacy-ledger.db"
    deadline = time.monotonic() + 120
    while not (ledger_path.exists() and sqlite3.connect(ledger_path).execute("SELECT count(*) FROM charges").fetchone()[0]):
        assert time.monotonic() < deadline, "the charge was never written"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # mid-round: the charge is on disk, training is running
    proc.wait(10)
    channel.close()

    proc, stub, channel = start()
    try:
        health = stub.Health(edge_pb2.HealthRequest())
        expected = PrivacyLedger(ledger_path, "k9").spent(1e-5)
        assert expected > 0 and health.privacy["epsilon-spent"] == pytest.approx(expected)
    finally:
        channel.close()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)


@pytest.mark.parametrize("n_images, batch", [(53, 16), (90, 7), (41, 41)])
def test_the_ledger_charges_exactly_the_schedule_the_factory_trains_with(tmp_path, monkeypatch, n_images, batch):
    """Batch sizes that do not divide n: the ledger's (q, steps) are those of the Poisson loader the factory trains with,
    planned from the total of its released class counts (the update's weight), not from its exact image count."""
    from client import dp

    made = []

    def recording(dataset, rate, **kwargs):
        made.append(real(dataset, rate, **kwargs))
        return made[-1]

    real = dp.poisson_loader
    monkeypatch.setattr(dp, "poisson_loader", recording)
    trainer = FactoryTrainer(_cfg(tmp_path, train_size=n_images, dp_epsilon=50.0))
    local = trainer.train(_global(), {**CONFIG, "batch-size": batch, "local-epochs": 2}, 1, run_id="r")
    (release, charge) = trainer.ledger.charges()  # the class counts' one release, then the round
    assert (release.sample_rate, release.steps) == (1.0, 1)
    (loader,) = made
    assert charge.sample_rate == pytest.approx(loader.sample_rate) and charge.steps == 2 * len(loader)
    assert len(loader) == steps_per_epoch(local.examples, batch) and local.privacy["dp-steps"] == charge.steps


def test_the_schedule_and_the_spend_depend_on_the_released_count_only(tmp_path, monkeypatch):
    """Two factories whose exact image counts fall either side of a batch boundary (45 and 63 training images: 3 and 4
    Poisson batches of 16 per epoch) but whose releases have the same total (60) train the same schedule and report the same
    noise, steps and spend: what leaves a DP factory tells nothing of its exact count beyond the release."""
    import client.trainer

    monkeypatch.setattr(client.trainer, "noisy_counts", lambda counts, noise: np.full(len(counts), 10.0))
    reports, exact = [], []
    for name, size in (("small", 50), ("large", 70)):
        trainer = FactoryTrainer(_cfg(tmp_path / name, train_size=size, dp_epsilon=50.0))
        local = trainer.train(_global(), CONFIG, 1, run_id="r")
        exact.append(len(trainer.prepare(_global(), CONFIG).train_set))
        assert local.examples == 60  # the update's weight: the released total
        reports.append({k: local.privacy[k] for k in ("noise-multiplier", "dp-steps", "epsilon-spent")})
        trainer.close()
    assert steps_per_epoch(exact[0], 16) != steps_per_epoch(exact[1], 16)  # planned from the exact counts, they would differ
    assert reports[0] == reports[1] and reports[0]["dp-steps"] == steps_per_epoch(60, 16)


def test_renaming_a_factory_never_resets_its_budget(tmp_path):
    first = FactoryTrainer(_cfg(tmp_path))
    spent = first.train(_global(), CONFIG, 1, run_id="r").privacy["epsilon-spent"]
    first.close()
    renamed = FactoryTrainer(_cfg(tmp_path, factory_id="dp-plant-renamed"))
    assert renamed.privacy_status()["epsilon-spent"] == pytest.approx(spent)


def test_concurrent_charges_cannot_both_pass_the_budget_check(tmp_path):
    """Two ledgers on one file (two processes' worth of connections) race for the last of a budget: one wins."""
    budget = PrivacyBudget(epsilon_max=7.0, delta=1e-5)  # one charge below is epsilon 6.24, two are 8.41
    a, b = PrivacyLedger(tmp_path / "l.db", "x"), PrivacyLedger(tmp_path / "l.db", "x")
    outcomes = []

    def charge(ledger):
        try:
            outcomes.append(ledger.charge(budget, "r", 1, noise_multiplier=1.1, sample_rate=0.25, steps=12))
        except BudgetExhausted:
            outcomes.append("refused")

    threads = [threading.Thread(target=charge, args=(ledger,)) for ledger in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(map(str, outcomes)).count("refused") == 1 and len(a.charges()) == 1


def _features(n: int, dims: int, classes: int, seed: int = 0) -> FeatureSet:
    rng = np.random.default_rng(seed)
    return FeatureSet((rng.normal(size=(n, dims)) * 3).astype(np.float16), rng.integers(0, classes, n), tuple("abcdefgh"[:classes]))


def test_a_secure_sum_step_is_the_gaussian_mechanism_on_clipped_per_example_gradients():
    """--dp-secure-sum's update: -lr (sum of per-example gradients, each clipped to C, + N(0, (sigma C)^2)) / n, whatever the chunking."""
    data = _features(50, 8, 3)
    start = nn.Linear(8, 3)
    expected = {k: torch.zeros_like(v) for k, v in start.state_dict().items()}
    for i in range(len(data)):  # one example at a time, clipped as Opacus clips
        one = nn.Linear(8, 3)
        one.load_state_dict(start.state_dict())
        F.cross_entropy(one(torch.from_numpy(data.images_at([i]))), torch.tensor([int(data.labels[i])])).backward()
        norm = float(torch.sqrt(one.weight.grad.pow(2).sum() + one.bias.grad.pow(2).sum()))
        for name, p in one.named_parameters():
            expected[name] += min(1.0, 0.5 / (norm + 1e-6)) * p.grad
    stepped = nn.Linear(8, 3)
    stepped.load_state_dict(start.state_dict())
    result = noisy_gradient_step(stepped, data, lr=0.3, noise_multiplier=0.0, max_grad_norm=0.5, chunk=16)
    assert result.steps == 1 and result.examples == 50
    for name, p in stepped.named_parameters():
        torch.testing.assert_close(p.detach(), start.state_dict()[name] - 0.3 * expected[name] / 50, atol=1e-6, rtol=0)

    # the noise: standard deviation sigma * C in every coordinate of the sum, fresh at every step
    wide, sigma = nn.Linear(200, 8), 2.0
    base = nn.Linear(200, 8)
    wide.load_state_dict(base.state_dict())
    data = _features(20, 200, 8)
    clean = nn.Linear(200, 8)
    clean.load_state_dict(base.state_dict())
    noisy_gradient_step(clean, data, lr=1.0, noise_multiplier=0.0, max_grad_norm=1.0)
    noisy_gradient_step(wide, data, lr=1.0, noise_multiplier=sigma, max_grad_norm=1.0)
    added = (clean.weight - wide.weight).detach().flatten() * 20  # (noise) in the sum's units
    assert float(added.std()) == pytest.approx(sigma, rel=0.1) and abs(float(added.mean())) < 0.2


def test_sharing_the_secure_sums_noise_charges_one_gaussian_step_and_keeps_what_its_own_noise_guarantees(tmp_path):
    """The ledger charges the sum's noise (q = 1, one step per round); the factory adds sigma / sqrt(holders) of it; epsilon-alone is
    what its own noise would guarantee, and without --dp-secure-sum a number of holders changes nothing."""
    shared = FactoryTrainer(_cfg(tmp_path / "shared", dp_secure_sum=True, dp_planned_rounds=10))
    for r in (1, 2):
        privacy = shared.train(_global(), CONFIG, r, run_id="r", noise_holders=4).privacy
    (_, first, second) = shared.ledger.charges()  # after the class counts' release
    assert (first.sample_rate, first.steps, first.noise_holders) == (1.0, 1, 4) and second.noise_multiplier == first.noise_multiplier
    sigma = first.noise_multiplier
    # full-batch Gaussian releases compose exactly: (1 / sigma)-GDP each, the mus add in quadrature, and Opacus' dual of
    # mu-GDP gives epsilon; the RDP bound of the same history is looser
    def exact(history):
        return eps_from_mu(mu=math.sqrt(sum(steps / noise**2 for noise, steps in history)), delta=1e-5)

    def rdp(history):
        accountant = RDPAccountant()
        accountant.history = [(noise, 1.0, steps) for noise, steps in history]
        return accountant.get_epsilon(delta=1e-5)

    assert privacy["epsilon-spent"] == pytest.approx(exact([(sigma, 2), (4.0, 1)]), rel=1e-6)
    assert privacy["epsilon-spent"] < rdp([(sigma, 2), (4.0, 1)])
    alone = [(sigma / 2.0, 2), (4.0, 1)]  # the counts' release is this factory's own noise
    assert privacy["epsilon-alone"] == pytest.approx(exact(alone), rel=1e-6) and privacy["epsilon-alone"] > privacy["epsilon-spent"]
    assert privacy["dp-noise-holders"] == 4 and privacy["dp-steps"] == 1
    # the whole budget fits the planned rounds: ten such rounds and the class counts' one release spend it exactly
    assert exact([(sigma, 10), (4.0, 1)]) == pytest.approx(4.0, abs=1e-4) and exact([(sigma, 10), (4.0, 1)]) <= 4.0

    local = FactoryTrainer(_cfg(tmp_path / "local"))
    privacy = local.train(_global(), CONFIG, 1, run_id="r", noise_holders=4).privacy
    assert local.ledger.charges()[1].noise_holders == 1 and "epsilon-alone" not in privacy and privacy["dp-steps"] > 1


def test_a_ledger_written_before_shared_noise_reads_as_the_factorys_own_noise(tmp_path):
    path = tmp_path / "privacy-ledger.db"
    old = sqlite3.connect(path)
    old.execute("CREATE TABLE charges (id INTEGER PRIMARY KEY AUTOINCREMENT, factory_id TEXT NOT NULL, run_id TEXT NOT NULL,"
                " server_round INTEGER NOT NULL, noise_multiplier REAL NOT NULL, sample_rate REAL NOT NULL, steps INTEGER NOT NULL,"
                " delta REAL NOT NULL, created_at REAL NOT NULL)")
    old.execute("INSERT INTO charges (factory_id, run_id, server_round, noise_multiplier, sample_rate, steps, delta, created_at)"
                " VALUES ('p', 'r', 1, 1.1, 0.25, 8, 1e-5, 0)")
    old.commit()
    old.close()
    ledger = PrivacyLedger(path, "p")
    (charge,) = ledger.charges()
    assert charge.noise_holders == 1 and ledger.spent(1e-5) > 0 and ledger.spent_alone(1e-5) == pytest.approx(ledger.spent(1e-5))


def test_full_batch_releases_are_accounted_exactly_and_never_above_the_rdp_bound():
    """Sample rate 1 (the class counts, --dp-secure-sum's step, DP-SGD over a factory no larger than its batch): the
    history is mu-GDP with the mus added in quadrature, converted by Opacus' exact dual; any subsampled step in the
    history keeps the whole history on Opacus' RDP accountant."""
    def rdp(history):
        accountant = RDPAccountant()
        accountant.history = list(history)
        return accountant.get_epsilon(delta=1e-5)

    for history in ([(0.8, 1.0, 1)], [(3.3, 1.0, 30), (4.0, 1.0, 1)], [(1.5, 1.0, 3), (6.0, 1.0, 12), (4.0, 1.0, 1)]):
        mu = math.sqrt(sum(steps / noise**2 for noise, _, steps in history))
        assert epsilon_of(history, 1e-5) == pytest.approx(eps_from_mu(mu=mu, delta=1e-5), rel=1e-9)
        assert epsilon_of(history, 1e-5) < rdp(history)
    mixed = [(3.0, 0.5, 80), (4.0, 1.0, 1)]
    assert epsilon_of(mixed, 1e-5) == pytest.approx(opacus_epsilon(mixed), rel=1e-9)
    assert epsilon_of(mixed, 1e-5) < rdp(mixed)
    assert epsilon_of([(1e4, 1.0, 1)], 1e-5) == pytest.approx(0.0, abs=1e-3) and epsilon_of([(1e-3, 1.0, 1)], 1e-5) == math.inf
    # the plan spends the budget exactly (never above it), with less noise than the RDP bound needs
    budget = PrivacyBudget(epsilon_max=8.0, delta=1e-5)
    planned = noise_for_budget(8.0, 1e-5, 1.0, 30, budget.reserved)
    assert epsilon_of([(planned, 1.0, 30), *budget.reserved], 1e-5) == pytest.approx(8.0, abs=1e-4)
    assert epsilon_of([(planned, 1.0, 30), *budget.reserved], 1e-5) <= 8.0
    assert rdp([(planned, 1.0, 30), *budget.reserved]) > 8.0
    with pytest.raises(BudgetExhausted, match="class-count release alone"):
        noise_for_budget(0.5, 1e-5, 1.0, 30, PrivacyBudget(epsilon_max=0.5, delta=1e-5, count_noise=0.5).reserved)


def test_the_noise_plan_is_the_smallest_noise_that_fits_to_a_tenth_of_a_percent():
    budget = PrivacyBudget(epsilon_max=8.0, delta=1e-5)
    for rate, steps in ((0.5, 80), (0.05, 800)):
        planned = noise_for_budget(8.0, 1e-5, rate, steps, budget.reserved)
        assert epsilon_of([(planned, rate, steps), *budget.reserved], 1e-5) <= 8.0
        assert epsilon_of([(planned * 0.999, rate, steps), *budget.reserved], 1e-5) > 8.0


def test_the_plans_search_falls_back_to_bisection_and_never_returns_a_noise_that_does_not_fit():
    from client.privacy import _smallest_fitting

    def nowhere_finite(noise: float) -> float:  # an accountant outside its domain: no sign change a root-finder can use
        return math.inf

    assert _smallest_fitting(lambda noise: noise >= 1.2345, nowhere_finite, 1.0, 2.0) == pytest.approx(1.2345, rel=1e-3)
    assert _smallest_fitting(lambda noise: noise >= 1.2345, nowhere_finite, 1.0, 2.0) >= 1.2345
    # a root-finder misled by an excess that disagrees with the check: the checked bracket still decides
    assert _smallest_fitting(lambda noise: noise >= 1.5, lambda noise: noise - 1.2, 1.0, 2.0) >= 1.5


def test_the_noise_plan_keeps_room_for_the_class_count_release():
    budget = PrivacyBudget(epsilon_max=8.0, delta=1e-5)
    rate, steps = 0.25, 40
    alone = noise_for_budget(8.0, 1e-5, rate, steps)
    planned = noise_for_budget(8.0, 1e-5, rate, steps, budget.reserved)
    assert planned > alone  # a little more noise per step ...
    with_release = epsilon_of([(planned, rate, steps), *budget.reserved], 1e-5)
    assert with_release <= 8.0 and with_release == pytest.approx(8.0, abs=0.01)  # ... so that steps and release spend the budget
    assert epsilon_of([(alone, rate, steps), *budget.reserved], 1e-5) > 8.0
    with pytest.raises(BudgetExhausted, match="class-count release alone"):
        noise_for_budget(0.5, 1e-5, rate, steps, PrivacyBudget(epsilon_max=0.5, delta=1e-5, count_noise=0.5).reserved)
    with pytest.raises(ValueError, match="--dp-count-noise"):
        PrivacyBudget(epsilon_max=8.0, delta=1e-5, count_noise=0.0)


def test_a_dp_factory_releases_its_class_counts_once_with_noise(tmp_path):
    """Distillation weights predictions by class counts, and every update is weighted by an image count: a DP factory sends
    a noisy release of its class counts and their total, charged once and reused."""
    trainer = FactoryTrainer(_cfg(tmp_path, dp_epsilon=3.0, dp_planned_rounds=2))
    prep = trainer.prepare(_global(), CONFIG)
    exact = np.bincount(np.asarray(prep.train_set.labels), minlength=len(prep.request.classes))
    local = trainer.train(_global(), CONFIG, 1, run_id="r")  # charged before training: one release, one round
    assert [c.steps for c in trainer.ledger.charges()] == [1, trainer.ledger.charges()[1].steps]
    released = trainer.class_counts(prep, "r", 1)
    assert np.all(released >= 0) and np.all(released == np.rint(released)) and not np.array_equal(released, exact)
    assert local.examples == int(released.sum())  # the update's weight is the released total, not the exact image count
    charges = trainer.ledger.charges()
    assert charges[0].noise_multiplier == 4.0 and charges[0].sample_rate == 1.0
    # the same counts again, in later rounds or after a restart: the same release, nothing charged
    trained = trainer.train(_global(), CONFIG, 2, run_id="r").weights
    np.testing.assert_array_equal(trainer.predict(trained, CONFIG, np.zeros((4, 1, 64, 64), np.float32), 2.0, "r", 2)[1], released)
    trainer.close()
    again = FactoryTrainer(_cfg(tmp_path, dp_epsilon=3.0, dp_planned_rounds=2))
    np.testing.assert_array_equal(again.class_counts(again.prepare(_global(), CONFIG), "r", 3), released)
    assert len(again.ledger.charges()) == 3  # the release and the two planned rounds fit the budget together ...
    with pytest.raises(BudgetExhausted):  # ... and nothing more does
        again.train(_global(), CONFIG, 3, run_id="r")
    spent = again.privacy_status()["epsilon-spent"]  # Opacus' accounting of every step and the release
    assert opacus_epsilon(again.ledger.history()) == pytest.approx(spent, rel=1e-9) and spent <= 3.0


def test_a_dp_factory_in_a_distillation_round_sends_released_counts_and_their_cost(tmp_path):
    """Over the agent's gRPC service: the class counts and the weight in the reply are the ledger's noisy release, and the
    spend it reports includes that release."""
    from client.agent import serve
    from common.distill import ProxySet
    from common.tensors import to_tensor

    address = f"127.0.0.1:{free_port()}"
    server = serve(_cfg(tmp_path, listen=address))
    try:
        stub = edge_pb2_grpc.EdgeAgentStub(grpc.insecure_channel(address))
        proxy = ProxySet(np.random.default_rng(0).random((8, 1, 64, 64), dtype=np.float32))
        assert stub.Proxy(edge_pb2.ProxyRequest(sha256=proxy.sha256, images=to_tensor("proxy", proxy.images))).have
        config = struct_pb2.Struct()
        config.update({**CONFIG, "proxy-sha256": proxy.sha256})
        reply = stub.Train(edge_pb2.TrainRequest(run_id="r", server_round=1, weights=to_tensors(_global()), config=config))
        ledger = PrivacyLedger(tmp_path / "state" / "privacy-ledger.db", "dp-plant")
        ((value,),) = ledger._db.execute("SELECT value FROM releases WHERE kind = 'class-counts'").fetchall()
        np.testing.assert_array_equal(from_tensor(reply.class_counts), np.asarray(json.loads(value)))
        release, _ = ledger.charges()  # the release, then the round
        assert (release.steps, release.sample_rate) == (1, 1.0)
        assert reply.num_examples == int(sum(json.loads(value)))  # the update's weight: the released total
        assert reply.metrics["epsilon-spent"] == pytest.approx(ledger.spent(1e-5))
        assert "train-loss" not in reply.metrics  # nor any other training statistic
    finally:
        server.stop(grace=None)


def test_a_class_count_release_over_budget_is_refused_and_keeps_nothing(tmp_path):
    ledger = PrivacyLedger(tmp_path / "l.db", "x")
    budget = PrivacyBudget(epsilon_max=0.5, delta=1e-5)  # one release at noise 4 costs about 1.0
    with pytest.raises(BudgetExhausted, match="class-counts"):
        ledger.release(budget, "r", 1, "class-counts", "k", 4.0, lambda: [1.0, 2.0])
    assert ledger.charges() == [] and ledger._db.execute("SELECT count(*) FROM releases").fetchone()[0] == 0


def test_a_factory_without_dp_sends_its_exact_class_counts(tmp_path):
    trainer = FactoryTrainer(_cfg(tmp_path, dp=False))
    prep = trainer.prepare(_global(), CONFIG)
    np.testing.assert_array_equal(trainer.class_counts(prep), np.bincount(np.asarray(prep.train_set.labels), minlength=len(prep.request.classes)))


def test_the_demo_summary_names_each_factorys_spend_and_what_its_own_noise_guarantees():
    """`fedforge demo --dp`'s summary line, from the last version's privacy entries (the JSON summary's): each factory's
    spend against its budget, and for a factory sharing the secure sum's noise how many honest inputs it counted and what
    its own noise alone guarantees; nothing for a run without DP."""
    from server.demo import privacy_line

    local = {"epsilon-spent": 7.5, "epsilon-max": 8.0, "delta": 1e-5}
    shared = {**local, "epsilon-spent": 8.0, "dp-noise-holders": 3.0, "epsilon-alone": 15.706}
    line = privacy_line([{"privacy": {}}, {"privacy": {"plant-b": shared, "plant-a": local}}])
    assert line == ("privacy spent (δ 1e-05): plant-a ε 7.50 of 8.00; "
                    "plant-b ε 8.00 of 8.00 (noise shared with 3 honest inputs; ε 15.71 on its own noise)")
    assert privacy_line([{"privacy": {}}]) == privacy_line([]) == ""

