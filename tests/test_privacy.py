"""DP-SGD at the factory: noise applied, epsilon accounted across rounds and restarts, budget enforced."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import OrderedDict

import grpc
import pytest
import torch
from google.protobuf import struct_pb2
from opacus.accountants import RDPAccountant
from torch import nn

from client.config import AgentConfig
from client.dp import DPConfigError, DPPlan, check_dp_compatible, sample_rate, train_private
from client.privacy import BudgetExhausted, PrivacyBudget, PrivacyLedger
from client.trainer import FactoryTrainer
from common.data import datasets
from common.models import build_model
from common.procs import free_port
from common.rpc.fedforge.v1 import edge_pb2, edge_pb2_grpc
from common.tensors import to_tensors
from common.training import TrainConfig


def _global():
    return OrderedDict((k, v.numpy()) for k, v in build_model("cnn-small", 6, seed=1).state_dict().items())


def _cfg(tmp_path, **kw):
    base = {"factory_id": "dp-plant", "train_size": 96, "dp": True, "dp_epsilon": 4.0, "dp_planned_rounds": 4, "state_dir": str(tmp_path / "state")}
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
    accountant = RDPAccountant()
    for noise, rate, steps in trainer.ledger.history():
        for _ in range(steps):
            accountant.step(noise_multiplier=noise, sample_rate=rate)
    assert accountant.get_epsilon(delta=1e-5) == pytest.approx(eps[-1], rel=1e-9)

    # a restarted agent reads the same ledger: nothing is forgotten
    again = FactoryTrainer(_cfg(tmp_path))
    assert again.privacy_status()["epsilon-spent"] == pytest.approx(eps[-1])


def test_round_over_budget_is_refused_and_not_charged(tmp_path):
    trainer = FactoryTrainer(_cfg(tmp_path, dp_epsilon=2.0, dp_planned_rounds=2))
    trainer.train(_global(), CONFIG, 1, run_id="r")
    trainer.train(_global(), CONFIG, 2, run_id="r")
    charged = len(trainer.ledger.charges())
    with pytest.raises(BudgetExhausted, match="exhausted.*refused.*--dp-epsilon"):
        trainer.train(_global(), CONFIG, 3, run_id="r")
    assert len(trainer.ledger.charges()) == charged
    # more local epochs cost more privacy: also refused
    with pytest.raises(BudgetExhausted):
        trainer.train(_global(), {**CONFIG, "local-epochs": 5}, 3, run_id="r")


def test_server_cannot_raise_the_budget_or_lower_the_noise(tmp_path, caplog):
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
def test_the_ledger_charges_exactly_what_opacus_samples(tmp_path, n_images, batch):
    """Batch sizes that do not divide n: the ledger's (q, steps) are those of the Poisson loader Opacus builds."""
    from opacus.data_loader import DPDataLoader
    from torch.utils.data import DataLoader

    from client.data import DataRequest
    from client.dp import ImageSetDataset

    trainer = FactoryTrainer(_cfg(tmp_path, train_size=n_images, dp_epsilon=50.0))
    train_set = trainer.data.split(DataRequest()).train
    trainer.train(_global(), {**CONFIG, "batch-size": batch, "local-epochs": 2}, 1, run_id="r")
    (charge,) = trainer.ledger.charges()
    loader = DPDataLoader.from_data_loader(DataLoader(ImageSetDataset(train_set), batch_size=batch))
    assert charge.sample_rate == pytest.approx(loader.sample_rate) and charge.steps == 2 * len(loader)


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
