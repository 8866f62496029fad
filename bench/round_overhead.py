#!/usr/bin/env python3
"""Per-round overhead without local training: FedForge vs a plain Flower FedAvg app, same run.

Both federations use the same model, data and factory count over real SuperLink/SuperNode processes
on loopback, with ``local-epochs = 0`` so that a round's time is all overhead (messaging, process
spawns, (de)serialisation, aggregation, central evaluation). Prints the ratio FedForge / plain Flower.

    python bench/round_overhead.py --factories 3 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import itertools

from common.procs import ProcessSet, free_port, wait_for_port
from server import launch
from server.local import LocalFederation, wait_for_run
from server.registry.service import Registry


def fedforge_rounds(root: Path, factories: int, rounds: int, architecture: str) -> list[float]:
    with ProcessSet(root / "logs") as procs:
        fed = LocalFederation(root, procs, num_factories=factories, secure=False)  # plain rounds: factories allow plaintext answers
        fed.start()
        run_id = "run-" + fed.submit(fed.run_config(rounds, **{"local-epochs": 0, "architecture": architecture, "min-factories": factories, "secure-aggregation": False}))
        registry = Registry.at(fed.registry_dir)
        wait_for_run(registry, run_id, procs=procs)
        done = registry.rounds(run_id)
        assert all(r.status == "completed" for r in done), [(r.status, r.failures) for r in done]  # a refused round is no timing
        return [r.seconds for r in done]


def plain_flower_rounds(root: Path, factories: int, rounds: int, architecture: str, app: str = "plain_flower", local_epochs: int = 0) -> list[float]:
    port = free_port()
    timings = root / "timings.json"
    with ProcessSet(root / "logs") as procs:
        sl = procs.start("superlink", launch.superlink_command(root, "127.0.0.1", port), cwd=root, env={"PYTHONPATH": str(ROOT)})
        wait_for_port("127.0.0.1", port, 60, sl)
        for i in range(factories):
            procs.start(f"supernode-{i}", [shutil.which("flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}",
                                           "--port", str(free_port()), "--node-config", f"partition-id={i}"], env={"PYTHONPATH": str(ROOT)})
        home = launch.flwr_home(root, f"127.0.0.1:{port}")
        import subprocess

        cfg = (f'num-server-rounds={rounds} num-factories={factories} architecture="{architecture}" timings-file="{timings}" '
               f'local-epochs={local_epochs}')
        out = subprocess.run([shutil.which("flwr"), "run", str(ROOT / "bench" / app), launch.CONNECTION, "--run-config", cfg, "--format", "json"],
                             env=launch.flwr_env(home), capture_output=True, text=True, timeout=120, check=False)
        if out.returncode != 0:
            raise RuntimeError(out.stdout + out.stderr)
        deadline = time.monotonic() + 180 * rounds + 120
        while time.monotonic() < deadline:
            if timings.exists() and len(json.loads(timings.read_text() or "[]")) == rounds + 1:
                break
            time.sleep(0.5)
        stamps = json.loads(timings.read_text())
    times = [s["time"] for s in stamps]
    return [b - a for a, b in itertools.pairwise(times)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--factories", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--architecture", default="cnn-small")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ff = fedforge_rounds(Path(tmp) / "fedforge", args.factories, args.rounds, args.architecture)
        plain = plain_flower_rounds(Path(tmp) / "plain", args.factories, args.rounds, args.architecture)
    # the first round includes start-up effects (process warm-up, first connections): report both
    ff_med, plain_med = statistics.median(ff[1:] or ff), statistics.median(plain[1:] or plain)
    print(json.dumps({"factories": args.factories, "architecture": args.architecture, "fedforge_round_seconds": [round(x, 2) for x in ff],
                      "plain_flower_round_seconds": [round(x, 2) for x in plain]}))
    print(f"FedForge round overhead (median of rounds 2..{args.rounds}): {ff_med:.2f} s")
    print(f"plain Flower FedAvg round overhead (same):               {plain_med:.2f} s")
    print(f"ratio FedForge / plain Flower: {ff_med / plain_med:.2f}")


if __name__ == "__main__":
    main()
