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
from server.local import LocalFederation, wait_for_run
from server.registry.service import Registry
from tests.conftest import federation_pids, log_tails

pytestmark = pytest.mark.slow
CHANCE = 1 / 6


def _leftovers(before: set[int]) -> set[int]:
    deadline = time.monotonic() + 15
    while (left := federation_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.fixture(scope="module")
def default_demo(tmp_path_factory):
    """`fedforge demo --factories 3 --rounds 2` with its defaults (secure aggregation on), run once for this module, on 300
    generated images per factory (the default 600 doubles the backbone's work and tests nothing more here)."""
    tmp_path = tmp_path_factory.mktemp("default-demo")
    before = federation_pids()
    summary, proc = _demo(tmp_path, "secure", train_size=300)
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
    for i in range(3):  # every message's ClientApp came from the factory's warm server, whatever wraps flower-superexec
        forks = (tmp_path / "secure" / f"factory-{i}" / "logs" / "supernode.log").read_text().count("ClientApp forked")
        assert forks >= 5, forks  # round 1: keys, shares, train, unmask; round 2: train, unmask; final evaluation


def test_killed_agent_is_left_out_and_the_next_round_proceeds(tmp_path, no_leftover_processes):
    root = tmp_path / "fed"
    with ProcessSet(root / "logs") as procs:
        fed = LocalFederation(root, procs, num_factories=3, train_size=300)
        fed.start(separate_agents=frozenset({2}))
        flwr_run_id = fed.submit(fed.run_config(2, **{"min-factories": 2, "round-timeout": 120.0, "local-epochs": 1, "architecture": "cnn-small",
                                                      "personal-epochs": 0, "federated-evaluation": False,
                                                      "test-size": 120}))  # no figure is checked: a small central test set
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
         "--dp", "--epsilon", "8", "--parallelism", "ddp", "--local-world-size", "2", "--min-factories", "2", "--no-secure",
         "--architecture", "cnn-small", "--set", "personal-epochs=0", "--set", "test-size=120",  # DDP trains from-scratch CNNs (a frozen backbone's head trains in-process)
         "--workdir", str(tmp_path / "demo"), "--json", str(summary_path)],
        capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log_tails(tmp_path / "demo")
    summary = json.loads(summary_path.read_text())
    assert [r["status"] for r in summary["rounds"]] == ["completed", "completed"]
    privacy = [v["privacy"] for v in summary["versions"][1:]]
    for factory in ("factory-0", "factory-1"):
        spent = [p[factory]["epsilon-spent"] for p in privacy]
        assert 0 < spent[0] < spent[1] <= 8.0  # grows per round, within the budget
        assert privacy[-1][factory]["epsilon-max"] == 8.0
        assert f"{factory} ε {spent[1]:.2f} of 8.00" in " ".join(proc.stderr.split())  # the summary (on stderr) says what each spent


def _demo(tmp_path, name: str, *flags: str, train_size: int = 600) -> tuple[dict, subprocess.CompletedProcess]:
    path = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "common.cli", "demo", "--factories", "3", "--rounds", "2", "--train-size", str(train_size),
         "--workdir", str(tmp_path / name), "--json", str(path), *flags],
        capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log_tails(tmp_path / name)
    return json.loads(path.read_text()), proc


def test_the_pretrained_default_learns_far_faster_than_a_model_from_scratch(default_demo):
    """The default recipe (frozen EfficientNet-Lite0, federated head) after 2 secure rounds over real processes, against
    `cnn-small` from scratch after the same 2 rounds of FedAvg on the same factories' data (in process, same local epochs)."""
    from client.config import AgentConfig
    from client.data import DataRequest, factory_data
    from common.data import datasets
    from common.models import build_model, load_weights, weights_of
    from common.training import TrainConfig, evaluate, train
    from server.aggregate import FactoryUpdate, fedavg

    summary = default_demo[1]
    pretrained = summary["rounds"][1]["accuracy"]
    parts = [factory_data(AgentConfig(factory_id=f"f{i}", factory_index=i, num_factories=3, train_size=300)).split(DataRequest()).train
             for i in range(3)]
    model = build_model("cnn-small", 6, seed=0)
    weights = weights_of(model)
    for r in (1, 2):
        updates = []
        for i, part in enumerate(parts):
            train(load_weights(model, weights), part, TrainConfig(epochs=2, seed=r * 10 + i))
            updates.append(FactoryUpdate(f"f{i}", i, weights_of(model), len(part)))
        weights = fedavg(updates, like=weights)
    scratch = evaluate(load_weights(model, weights), datasets.test_dataset(datasets.SyntheticSpec(num_factories=3), 600)).accuracy
    assert pretrained > scratch + 0.15, (pretrained, scratch)


def _write_folder(root, classes: dict[str, str], per_class: int, seed: int, size: tuple[int, int], mode: str, suffix: str) -> None:
    """Generated images saved as files under ``root/<folder>/``: {folder name: generator class}."""
    from PIL import Image

    from common.data import synth

    rng = synth.rng_for(seed, 99)
    profile = synth.factory_profile(seed, 0)
    for folder, name in classes.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        for k in range(per_class):
            img = synth.render(rng, synth.CLASSES.index(name), profile, 64)[None][0]
            pil = Image.fromarray((img * 255).astype("uint8")).resize(size).convert(mode)
            pil.save(root / folder / f"{k}.{suffix}")


def test_own_image_folders_with_other_classes_missing_ones_and_an_ok_only_factory(tmp_path, no_leftover_processes):
    """`fedforge demo --folders ROOT`: each factory's `fedforge client --data` is its own folder. Class names of their own
    (one with a space); a factory without a `dent` folder, whose good parts are in `OK-parts` (an alias), with RGB JPEGs
    of another size beside the others' grey PNGs and a `val/` folder; an ok-only factory with class folders only, which
    the demo splits. Every factory takes part in every round; the factories' test images are the central test set, and
    the final version has federated figures from every factory's own held-out split."""
    root = tmp_path / "images"
    for part, per_class, seed in (("train", 9, 1), ("test", 3, 2)):
        _write_folder(root / "plant-a" / part, {"Good": "ok", "Scratch Mark": "scratch", "crack": "crack", "dent": "pit"}, per_class, seed,
                      (64, 64), "L", "png")
        _write_folder(root / "plant-b" / ("val" if part == "test" else part), {"OK-parts": "ok", "Scratch Mark": "scratch", "crack": "crack"},
                      per_class, seed + 2, (80, 60), "RGB", "jpg")
    _write_folder(root / "plant-c", {"Good": "ok"}, 20, 5, (64, 64), "L", "png")  # good parts only, and no split of its own
    _write_folder(root / "proxy", {"any": "ok", "other": "pit"}, 10, 6, (64, 64), "L", "png")
    summary_path = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "common.cli", "demo", "--folders", str(root), "--class-alias", "OK-parts=Good", "--rounds", "2",
         "--local-epochs", "1", "--min-factories", "3", "--set", "image-size=48", "--workdir", str(tmp_path / "demo"), "--json", str(summary_path)],
        capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log_tails(tmp_path / "demo")
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "finished"
    assert [r["participants"] for r in summary["rounds"]] == [["factory-0", "factory-1", "factory-2"]] * 2, [r["failures"] for r in summary["rounds"]]
    assert "['plant-c'] have no test folders of their own" in " ".join(proc.stderr.split())
    registry = Registry.at(tmp_path / "demo" / "central" / "registry")
    versions = registry.versions(summary["run_id"])
    classes = ["Good", "Scratch Mark", "crack", "dent"]
    assert all(v.model_input["classes"] == classes and v.model_input["image_size"] == 48 for v in versions)
    assert versions[-1].model_input["channels"] == 1  # grey images, also those saved as RGB JPEG
    from common.data.images import DECODE_VERSION

    assert all(v.model_input["decoding"] == DECODE_VERSION for v in versions)  # edges feed inspection requests alike
    central = {p.resolve() for p in (tmp_path / "demo" / "central-test").rglob("*") if p.is_file()}
    assert len(central) == 4 * 3 + 3 * 3 + 5  # every factory's test images: plant-c's every 4th of 20
    assert {p.name for p in (tmp_path / "demo" / "central-test").iterdir()} == set(classes)  # OK-parts' images under Good
    assert not central & {p.resolve() for p in (root / "plant-a" / "train").rglob("*")} and "accuracy" in versions[-1].metrics
    final = registry.latest_evaluation(versions[-1].id)
    assert final.phase == "final" and final.factories == 3 and final.classes == classes
    # every factory's held-out split (drawn by path, `keyed_split`): about 10% of 36 + 27 + 15 images, at least one per class
    assert 4 + 3 + 1 <= final.examples <= 14
    flower_run = summary["run_id"].removeprefix("run-")  # each agent learnt the run's id from its first message and indexed its folder
    for factory, images in (("factory-0", 36), ("factory-1", 27), ("factory-2", 15)):
        agent_log = (tmp_path / "demo" / "logs" / f"{factory}.log").read_text()
        assert f"run {flower_run}: factory {factory} trains on {images} image files" in agent_log, agent_log[-2000:]
    assert final.figures["escape-rate"] is not None and final.figures["recall"]["dent"] is not None  # "Good" is the good parts


