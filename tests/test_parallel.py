"""The warm DDP/FSDP worker group on CPU (gloo, 2 ranks), with and without DP-SGD."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from client.config import AgentConfig
from client.data import DataRequest, factory_data
from client.dp import DPPlan
from client.workers import Job, WorkerGroup
from common.models import build_model
from common.training import TrainConfig, train

pytestmark = pytest.mark.slow
CFG = AgentConfig(factory_id="multi", train_size=74, torch_threads=1)
TRAIN = TrainConfig(epochs=1, batch_size=16, seed=5)


def _initial():
    return {k: v.numpy() for k, v in build_model("cnn-small", 6, seed=2).state_dict().items()}


@pytest.fixture(scope="module")
def ddp():
    group = WorkerGroup(CFG, "ddp", 2)
    yield group
    group.close()


@pytest.fixture(scope="module")
def fsdp():
    group = WorkerGroup(CFG, "fsdp", 2)
    yield group
    group.close()


def test_ddp_ranks_agree_and_match_single_process(ddp):
    out = ddp.run(Job(weights=_initial(), architecture="cnn-small", train=asdict(TRAIN)))
    assert len(set(out["rank_digests"])) == 1  # parameters identical on both ranks

    train_data = factory_data(CFG).split(DataRequest()).train
    assert len(train_data) % 16 % 2 == 1  # the last global batch splits unevenly: still exact
    model = build_model("cnn-small", 6)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in _initial().items()})
    train(model, train_data, TRAIN)
    for k, v in model.state_dict().items():
        np.testing.assert_allclose(out["weights"][k], v.numpy(), atol=2e-5, err_msg=k)


def test_fsdp_trains_and_returns_a_full_state_dict(fsdp):
    weights, losses = _initial(), []
    for _ in range(3):
        out = fsdp.run(Job(weights=weights, architecture="cnn-small", train=asdict(TrainConfig(epochs=2, batch_size=16, seed=1))))
        weights = out["weights"]
        losses.append(out["loss"])
    assert losses[-1] < losses[0]
    reference = build_model("cnn-small", 6).state_dict()
    assert list(weights) == list(reference)
    assert all(weights[k].shape == tuple(reference[k].shape) for k in reference)  # unsharded, on rank 0


DP = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "sample_rate": 16 / 65}


def test_ddp_with_dp(ddp):
    out = ddp.run(Job(weights=_initial(), architecture="cnn-small", train=asdict(TRAIN), dp=DPPlan(**DP, grad_sample_mode="hooks")))
    assert len(set(out["rank_digests"])) == 1
    assert not any(k.startswith(("_module.", "module.")) for k in out["weights"])
    assert all(np.isfinite(v).all() for v in out["weights"].values())
    assert any(not np.allclose(out["weights"][k], v) for k, v in _initial().items())


def test_fsdp_with_dp_ghost_clipping(fsdp):
    out = fsdp.run(Job(weights=_initial(), architecture="cnn-small", train=asdict(TRAIN), dp=DPPlan(**DP, grad_sample_mode="ghost_fsdp")))
    assert list(out["weights"]) == list(_initial())
    assert all(np.isfinite(v).all() for v in out["weights"].values())


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _threads(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/task").iterdir()))


def test_worker_group_survives_many_rounds_without_leaking(ddp):
    pids = ddp.pids()
    job = Job(weights=_initial(), architecture="cnn-small", train=asdict(TrainConfig(epochs=1, batch_size=32)))
    rss, threads = [], []
    for i in range(12):
        ddp.run(job)
        if i in (2, 11):
            rss.append(sum(_rss_kib(p) for p in pids))
            threads.append(sum(_threads(p) for p in pids))
    assert ddp.pids() == pids  # the same processes: never re-spawned per round
    assert threads[1] == threads[0]
    assert rss[1] - rss[0] < 40 * 1024, f"RSS grew {rss[1] - rss[0]} KiB over 9 rounds"


def test_bf16_autocast_and_activation_checkpointing_switches():
    """Both switches train (finite loss, weights move); checkpointing leaves the forward pass unchanged."""
    from client.parallel import apply_activation_checkpointing

    data = factory_data(CFG).split(DataRequest()).train
    x = torch.from_numpy(data.images[:8])
    model = build_model("cnn-small", 6, seed=4)
    reference = model(x).detach()
    apply_activation_checkpointing(model)
    torch.testing.assert_close(model(x), reference)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = train(model, data, TrainConfig(epochs=1, batch_size=16, bf16=True, activation_checkpointing=True))
    assert np.isfinite(result.loss) and any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert list(model.state_dict()) == list(before)  # checkpointing does not rename parameters


def test_a_group_with_a_dead_rank_restarts_at_the_next_job_and_trains(ddp):
    """kill -9 one rank: the next job starts a new group (new processes, a new rendezvous store) and both ranks agree.
    Last in this module: it replaces the shared group's processes."""
    old = list(ddp.procs)
    old[1].kill()
    old[1].join(10)
    out = ddp.run(Job(weights=_initial(), architecture="cnn-small", train=asdict(TRAIN)))
    assert len(set(out["rank_digests"])) == 1
    assert not set(ddp.pids()) & {p.pid for p in old}
    assert not any(p.is_alive() for p in old)  # the surviving rank of the dead group was stopped, not left waiting
