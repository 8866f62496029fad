"""``fedforge simulate``: the FedForge app on Flower's Simulation Engine, N virtual factories on one machine.

It answers "what will N factories cost, and does secure aggregation survive P of them dropping out?"
with the production ServerApp and ClientApp: a SuperLink in simulation mode (``flower-superlink
--simulation``) runs the submitted FAB with Flower's Ray backend; every virtual SuperNode runs the
FedForge ClientApp, which runs the edge agent's own training and SecAgg code in-process on a generated
partition (``client.simulation``). Rounds, versions and the summary land in a registry exactly as with
``fedforge demo``.

The virtual factories share one simulation worker (``--workers`` CPUs, one Ray actor): a factory's
SecAgg session keys live in the memory of the process that made them, as in a real agent, so every
stage of one factory's session must reach that process.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from common.procs import ProcessSet, free_port, wait_for_port
from common.simulation import parse_stages
from server import launch
from server.cli import parse_overrides

log = logging.getLogger("fedforge.simulate")
console = Console(stderr=True)

BACKENDS = ("ray",)
MISSING_RAY = ("Flower's Simulation Engine needs Ray, which is not installed. Install the optional extra: "
               "pip install -e '.[simulation]'  (or: pip install 'flwr[simulation]==1.42.0')")


def require_backend(backend: str) -> None:
    """Fail with the install command when the simulation backend's package is missing."""
    if backend == "ray" and importlib.util.find_spec("ray") is None:
        raise click.ClickException(MISSING_RAY)


def simulation_run_config(factories: int, rounds: int, secure: bool, dropout: float, dropout_stages: str, train_size: int, alpha: float,
                          seed: int, workdir: Path, min_factories: int | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """The run config a simulation submits: the production keys, plus the virtual factories' ``simulation-*`` settings.
    Personal models learn from the factories' own images only unless ``overrides`` say otherwise: every virtual factory
    would compute the public proxy set's features in the one simulation worker."""
    return {
        "personal-public-confidence": 0.0,
        "num-server-rounds": rounds, "secure-aggregation": secure, "num-factories": factories, "expected-factories": factories,
        "min-factories": min_factories or max(1, math.ceil(factories / 2)), "alpha": alpha, "data-seed": seed, "seed": seed,
        "registry-dir": str(workdir / "registry"), "simulation-dir": str(workdir), "simulation-train-size": train_size,
        "simulation-dropout": dropout, "simulation-dropout-stages": dropout_stages, **overrides,
    }


@click.command()
@click.option("--factories", default=10, type=click.IntRange(2, 2000), help="Virtual factories (simulated SuperNodes).")
@click.option("--rounds", default=3, type=click.IntRange(1), help="Server rounds.")
@click.option("--secure/--no-secure", default=True, help="Secure aggregation (SecAgg+); the virtual factories require it when on.")
@click.option("--dropout", default=0.0, type=click.FloatRange(0.0, 0.95), help="Fraction of factories that drop out at each of --dropout-stages.")
@click.option("--dropout-stages", default="unmask", show_default=True,
              help="Comma-separated SecAgg stages at which --dropout applies: advertise, share, train (the masked input), unmask.")
@click.option("--secagg-degree", default=None, type=click.IntRange(0), help="Neighbours per factory (even); 0: automatic (see docs/security.md).")
@click.option("--architecture", default=None, help="Model architecture (default: the run configuration's).")
@click.option("--local-epochs", default=None, type=click.IntRange(0), help="Local epochs per round (default: the run configuration's).")
@click.option("--train-size", default=120, type=click.IntRange(10), help="Generated images per virtual factory.")
@click.option("--alpha", default=1.0, type=float, help="Dirichlet label skew across factories (smaller = more skewed).")
@click.option("--min-factories", default=None, type=click.IntRange(1), help="Abort a round below this many good updates (default: half).")
@click.option("--seed", default=0, type=int, help="Seed for data, model and which factories drop out.")
@click.option("--workers", default=None, type=click.IntRange(1), help="CPUs of the simulation worker (default: every core).")
@click.option("--backend", default="ray", type=click.Choice(BACKENDS), help="Flower simulation backend.")
@click.option("--timeout", default=3600.0, type=float, help="Give up (exit 1) if the run has not ended after this many seconds.")
@click.option("--workdir", default="fedforge-simulation", type=click.Path(file_okay=False), help="Logs, SuperLink database, registry, factory state.")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), help="Write the JSON summary (as `fedforge demo`) here.")
@click.option("--audit/--no-audit", default=False, help="Check every secure round's unmasked sum against the sum of the virtual factories' "
              "unmasked contributions (they and the server write them under WORKDIR/audit).")
@click.option("--set", "overrides", multiple=True, help="Any other run-config key, e.g. --set personal-epochs=0 (repeatable).")
def simulate(factories: int, rounds: int, secure: bool, dropout: float, dropout_stages: str, secagg_degree: int | None, architecture: str | None,
             local_epochs: int | None, train_size: int, alpha: float, min_factories: int | None, seed: int, workers: int | None, backend: str,
             timeout: float, workdir: str, audit: bool, json_path: str | None, overrides: tuple[str, ...]) -> None:
    """Run the FedForge federation with N virtual factories on Flower's Simulation Engine."""
    require_backend(backend)
    try:
        parse_stages(dropout_stages)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--dropout-stages") from None
    extra = parse_overrides(overrides)
    extra.update({k: v for k, v in {"secagg-degree": secagg_degree, "architecture": architecture, "local-epochs": local_epochs}.items() if v is not None})
    root = Path(workdir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    if audit:
        extra.update({"simulation-audit-dir": str(root / "audit"), "secagg-audit-dir": str(root / "audit")})
    run_config = simulation_run_config(factories, rounds, secure, dropout, dropout_stages, train_size, alpha, seed, root, min_factories, extra)
    cpus = workers or os.cpu_count() or 1
    federation = {"num-supernodes": factories, "backend": backend, "init-args-num-cpus": cpus, "client-resources-num-cpus": cpus}
    summary = run_simulation(root, run_config, federation, rounds, timeout)
    summary["simulation"] = {"factories": factories, "dropout": dropout, "dropout_stages": dropout_stages, "backend": backend, "workers": cpus,
                             "secure_aggregation": secure, "train_size": train_size}
    if audit:
        summary["audit"] = check_audit(root / "audit")
        console.print(f"audit: {summary['audit']['rounds']} secure sums checked, "
                      f"{'all equal to the sum of their contributors' if summary['audit']['equal'] else 'MISMATCH: ' + str(summary['audit']['mismatched'])}")
    from server.demo import print_summary

    print_summary(summary)
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2))
    if summary["status"] != "finished" or (audit and not summary["audit"]["equal"]):
        raise SystemExit(1)


def check_audit(directory: Path) -> dict[str, Any]:
    """Each ``round-R-train-sum.npz`` (the server's unmasked sum and its contributors) against the sum, in Z_2^64, of
    those contributors' ``round-R-<factory>.npy`` (what each virtual factory encoded before masking)."""
    import numpy as np

    checked, mismatched = 0, []
    for path in sorted(directory.glob("round-*-train-sum.npz")):
        server_round = int(path.name.split("-")[1])
        with np.load(path) as saved:
            total, participants = saved["total"], [str(p) for p in saved["participants"]]
        expected = np.zeros_like(total)
        for factory in participants:
            expected += np.load(directory / f"round-{server_round}-{factory}.npy")  # uint64: wraps mod 2^64, as the masks do
        checked += 1
        if not np.array_equal(expected, total):
            mismatched.append(server_round)
    return {"rounds": checked, "equal": checked > 0 and not mismatched, "mismatched": mismatched}


def run_simulation(root: Path, run_config: dict[str, Any], federation: dict[str, Any], rounds: int, timeout: float) -> dict[str, Any]:
    """Start a simulation-mode SuperLink, submit the run, follow it through the registry, stop everything; the summary."""
    from server.demo import follow_run
    from server.registry.service import Registry

    t_start = time.perf_counter()
    registry = Registry.at(Path(run_config["registry-dir"]))  # created here, before the ServerApp opens it
    port = free_port()
    # the SuperLink starts flwr-simulation, which starts Ray's workers: all of them import the app's modules
    env = {"FLWR_TELEMETRY_ENABLED": "0", "PYTHONPATH": os.pathsep.join(filter(None, [str(launch.app_dir()), os.environ.get("PYTHONPATH", "")])),
           "RAY_DEDUP_LOGS": "0"}
    with ProcessSet(root / "logs") as procs:
        proc = procs.start("superlink", launch.superlink_command(root, "127.0.0.1", port, insecure=True, simulation=True), env=env, cwd=root)
        wait_for_port("127.0.0.1", port, timeout=90, proc=proc)
        home = launch.flwr_home(root, f"127.0.0.1:{port}")
        flwr_run_id = launch.submit_run(home, run_config, federation_config=federation)
        console.print(f"[bold]FedForge simulation[/]: {federation['num-supernodes']} virtual factories, {rounds} rounds, Flower run {flwr_run_id}; "
                      f"logs: flwr log {flwr_run_id} (FLWR_HOME={home}) and {root / 'registry' / 'server.log'}")
        deadline = time.monotonic() + timeout
        try:
            summary = follow_run(registry, f"run-{flwr_run_id}", rounds, home, flwr_run_id, procs, deadline=deadline)
        except (RuntimeError, TimeoutError) as exc:
            raise click.ClickException(f"simulation failed: {exc}") from None
        finally:
            _save_flower_log(home, flwr_run_id, root / "logs" / "simulation.log")
    summary["wall_seconds"] = round(time.perf_counter() - t_start, 2)
    return summary


def _save_flower_log(home: Path, flwr_run_id: str, path: Path) -> None:
    """Keep Flower's own log of the run (the ServerApp's and the virtual ClientApps' output) next to the others."""
    import subprocess

    try:
        proc = subprocess.run(["flwr", "log", flwr_run_id, launch.CONNECTION, "--show"], env=launch.flwr_env(home), capture_output=True,
                              text=True, timeout=30, check=False)
        path.write_text(proc.stdout + proc.stderr)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("could not save Flower's log of run %s: %s", flwr_run_id, exc)
