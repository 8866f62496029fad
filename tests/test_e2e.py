"""End to end over real processes on loopback: SuperLink, SuperNodes, edge agents, ServerApp."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from common.procs import ProcessSet
from tests.conftest import federation_pids
from server.local import LocalFederation, wait_for_run
from server.registry.service import Registry

pytestmark = pytest.mark.slow
CHANCE = 1 / 6


def _leftovers(before: set[int]) -> set[int]:
    deadline = time.monotonic() + 15
    while (left := federation_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.fixture(scope="module")
def default_demo(tmp_path_factory):
    """`fedforge demo --factories 3 --rounds 2` with its defaults (secure aggregation on), run once for this module."""
    tmp_path = tmp_path_factory.mktemp("default-demo")
    before = federation_pids()
    summary, proc = _demo(tmp_path, "secure", train_size=600)
    return tmp_path, summary, proc, _leftovers(before)


def test_demo_runs_a_federation_and_cleans_up(default_demo):
    tmp_path, summary, proc, leftovers = default_demo
    assert not leftovers, f"processes left running after the demo: {leftovers}"
    assert [r["round"] for r in summary["rounds"]] == [1, 2]
    assert all(r["status"] == "completed" and len(r["participants"]) == 3 for r in summary["rounds"])
    assert summary["final_accuracy"] > CHANCE + 0.08, summary
    assert summary["wall_seconds"] > 0 and all(r["seconds"] > 0 for r in summary["rounds"])

    registry = Registry.at(tmp_path / "secure" / "central" / "registry")
    versions = registry.versions(summary["run_id"])
    assert [v.kind for v in versions] == ["initial", "fedavg", "fedavg"]
    assert [v.parent_id for v in versions[1:]] == [v.id for v in versions[:-1]]
    assert [v.secure_aggregation for v in versions] == [False, True, True]  # secure aggregation is the default
    for v in versions:
        assert hashlib.sha256(registry.artifacts.path_for(v.sha256).read_bytes()).hexdigest() == v.sha256
    assert "final accuracy" in proc.stderr


def test_killed_agent_is_left_out_and_the_next_round_proceeds(tmp_path, no_leftover_processes):
    root = tmp_path / "fed"
    with ProcessSet(root / "logs") as procs:
        fed = LocalFederation(root, procs, num_factories=3, train_size=300)
        fed.start(separate_agents=frozenset({2}))
        flwr_run_id = fed.submit(fed.run_config(2, **{"min-factories": 2, "round-timeout": 120.0, "local-epochs": 1}))
        registry, run_id = Registry.at(fed.registry_dir), f"run-{flwr_run_id}"

        deadline = time.monotonic() + 300
        while not registry.rounds(run_id):
            assert time.monotonic() < deadline, "round 1 never completed"
            time.sleep(0.2)
        time.sleep(1.0)  # round 2 is in flight
        os.kill(fed.process("factory-2-agent").pid, signal.SIGKILL)

        run = wait_for_run(registry, run_id, timeout=max(1.0, deadline - time.monotonic()))

    rounds = registry.rounds(run_id)
    assert run.status == "finished", run.error
    assert [r.status for r in rounds] == ["completed"] * 2
    assert rounds[0].participants == ["factory-0", "factory-1", "factory-2"]
    assert rounds[1].participants == ["factory-0", "factory-1"]
    assert list(rounds[1].failures) == ["factory-2"], rounds[1].failures
    log = (fed.registry_dir / "server.log").read_text()
    assert "round 2: factory factory-2 failed" in log


def test_demo_with_dp_and_ddp(tmp_path, no_leftover_processes):
    summary_path = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "common.cli", "demo", "--factories", "2", "--rounds", "2", "--local-epochs", "1", "--train-size", "200",
         "--dp", "--epsilon", "8", "--parallelism", "ddp", "--local-world-size", "2", "--min-factories", "2",
         "--workdir", str(tmp_path / "demo"), "--json", str(summary_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert [r["status"] for r in summary["rounds"]] == ["completed", "completed"]
    privacy = [v["privacy"] for v in summary["versions"][1:]]
    for factory in ("factory-0", "factory-1"):
        spent = [p[factory]["epsilon-spent"] for p in privacy]
        assert 0 < spent[0] < spent[1] <= 8.0  # grows per round, within the budget
        assert privacy[-1][factory]["epsilon-max"] == 8.0


def _demo(tmp_path, name: str, *flags: str, train_size: int = 600) -> tuple[dict, subprocess.CompletedProcess]:
    path = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "common.cli", "demo", "--factories", "3", "--rounds", "2", "--train-size", str(train_size),
         "--workdir", str(tmp_path / name), "--json", str(path), *flags],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(path.read_text()), proc


def test_secure_aggregation_reaches_the_same_accuracy_as_plain(tmp_path, default_demo, no_leftover_processes):
    secure = default_demo[1]
    plain, _ = _demo(tmp_path, "plain", "--no-secure")
    assert [v["secure_aggregation"] for v in secure["versions"][1:]] == [True, True]
    assert [v["secure_aggregation"] for v in plain["versions"][1:]] == [False, False]
    # same seeds, data and training: only fixed-point rounding (2^-24) and clipping differ
    assert abs(secure["final_accuracy"] - plain["final_accuracy"]) <= 0.03, (secure["final_accuracy"], plain["final_accuracy"])
