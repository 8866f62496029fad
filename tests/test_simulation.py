"""`fedforge simulate`: the FedForge ServerApp and ClientApp on Flower's Simulation Engine (Ray)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from common.simulation import dropped, parse_stages


def test_dropouts_are_a_fixed_share_chosen_per_round_and_stage_and_repeatable():
    stages = parse_stages("train,unmask")
    first = dropped(0.3, stages, 0, 20, 1, "unmask")
    assert len(first) == 6 and first == dropped(0.3, stages, 0, 20, 1, "unmask")
    assert first != dropped(0.3, stages, 0, 20, 2, "unmask") or first != dropped(0.3, stages, 0, 20, 1, "train")
    assert dropped(0.3, stages, 0, 20, 1, "advertise") == set()  # not a chosen stage
    assert dropped(0.0, stages, 0, 20, 1, "unmask") == set()
    with pytest.raises(ValueError, match="mask-input"):
        parse_stages("train,mask-input")


def test_virtual_factories_get_their_partition_and_their_own_state(tmp_path):
    from client.simulation import agent_config, is_virtual

    node = {"partition-id": 4, "num-partitions": 20}
    cfg = agent_config(node, {"simulation-dir": str(tmp_path), "simulation-train-size": 50, "alpha": 0.5, "secure-aggregation": True})
    assert is_virtual(node) and not is_virtual({"partition-id": 4, "agent-address": "127.0.0.1:1"})
    assert (cfg.factory_id, cfg.factory_index, cfg.num_factories, cfg.train_size, cfg.alpha) == ("factory-4", 4, 20, 50, 0.5)
    assert cfg.state_dir == str(tmp_path / "factories" / "factory-4") and cfg.require_secure_aggregation


def test_virtual_factories_make_personal_models_from_their_own_images_unless_told(tmp_path):
    from common.training import TrainConfig
    from server.simulate import simulation_run_config

    def run_config(overrides: dict) -> dict:
        return simulation_run_config(10, 3, True, 0.0, "unmask", 120, 1.0, 0, tmp_path, None, overrides)

    assert TrainConfig.from_run_config(run_config({})).personal_public_confidence == 0.0  # no proxy features per virtual factory
    assert TrainConfig.from_run_config(run_config({"personal-public-confidence": 0.8})).personal_public_confidence == 0.8


def test_simulate_without_ray_says_how_to_install_it(monkeypatch):
    import click

    from server import simulate

    monkeypatch.setattr(simulate.importlib.util, "find_spec", lambda name: None)  # Ray cannot be uninstalled for one test
    with pytest.raises(click.ClickException, match=r"pip install -e '\.\[simulation\]'"):
        simulate.require_backend("ray")


@pytest.mark.slow
def test_twenty_virtual_factories_complete_secure_rounds_with_dropouts_and_the_sums_check_out(tmp_path):
    """20 factories, secure aggregation, 30% dropping out after their masked input: both rounds complete, and every
    unmasked sum equals the sum of the contributions that went into it."""
    summary_path = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, "-m", "common.cli", "simulate", "--factories", "20", "--rounds", "2", "--dropout", "0.3",
                           "--dropout-stages", "unmask", "--train-size", "30", "--audit", "--set", "personal-epochs=0",
                           "--workdir", str(tmp_path / "sim"), "--json", str(summary_path)],
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "finished" and [r["status"] for r in summary["rounds"]] == ["completed", "completed"]
    for r in summary["rounds"]:
        dropped_at_unmask = {name for name, why in r["failures"].items() if "dropped out at unmask" in why}
        assert len(dropped_at_unmask) == 6  # round(0.3 * 20), chosen per round
        assert len(r["participants"]) == 20  # their masked inputs are in the sum; the others' shares removed their masks
    assert summary["audit"] == {"rounds": 2, "equal": True, "mismatched": []}
    assert len(summary["versions"]) == 3 and all(v["secure_aggregation"] for v in summary["versions"][1:])
