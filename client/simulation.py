"""Virtual factories for Flower's Simulation Engine: the agent's own training code, in-process.

Under ``fedforge simulate`` there are no edge agents and no SuperNodes: Flower runs the FedForge
ClientApp for N virtual SuperNodes, each with ``partition-id`` and ``num-partitions`` in its node
config. The ClientApp then builds, once per virtual factory and process, the same ``FactoryTrainer``
and ``EdgeAgentServicer`` a real agent runs, on the generated partition ``partition-id`` of
``num-partitions``, and calls it directly. The virtual factories keep their SecAgg session keys in the
process's memory, as a real agent does; ``fedforge simulate`` therefore runs them in one simulation
worker so that every stage of a factory's session reaches the same memory.

The factory-side settings a real factory takes from its own flags come here from the simulation's
``simulation-*`` run-config keys (they are the simulated operators' choices, not the server's):
``simulation-dir`` (where each virtual factory keeps its state), ``simulation-train-size`` (images per
factory), ``simulation-dropout`` (the fraction of factories that drop at each chosen stage) and
``simulation-dropout-stages`` (comma-separated: advertise, share, train, unmask; which factories drop
is decided by ``common.simulation``) and ``simulation-audit-dir`` (each virtual factory writes its
encoded contribution there before masking, so that a bench can check the server's unmasked sum; a
real agent has no such path).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from common.simulation import RUN_CONFIG_DEFAULTS, dropped_in_run

log = logging.getLogger("fedforge.simulation")


class SimulatedDropout(RuntimeError):
    """This virtual factory drops out at this stage, as chosen by ``simulation-dropout``."""


def is_virtual(node_config: dict[str, Any]) -> bool:
    """A node of Flower's Simulation Engine (it has a partition id and no edge agent)."""
    return "partition-id" in node_config and not node_config.get("agent-address")


def factory_name(partition: int) -> str:
    return f"factory-{partition}"


def agent_config(node_config: dict[str, Any], run_config: dict[str, Any]):  # type: ignore[no-untyped-def]
    """The AgentConfig of virtual factory ``partition-id``: its generated partition and its own state directory."""
    from client.config import AgentConfig

    partition = int(node_config["partition-id"])
    root = Path(str(run_config.get("simulation-dir", "") or "fedforge-simulation")).resolve()
    secure = bool(run_config.get("secure-aggregation", True))
    return AgentConfig(
        factory_id=factory_name(partition),
        factory_index=partition,
        num_factories=int(node_config.get("num-partitions", run_config.get("num-factories", 1))),
        data="synthetic",
        classes=str(run_config.get("classes", "")) or AgentConfig.classes,
        data_seed=int(run_config.get("data-seed", 0)),
        alpha=float(run_config.get("alpha", 1.0)),
        train_size=int(run_config.get("simulation-train-size", RUN_CONFIG_DEFAULTS["simulation-train-size"])),
        torch_threads=1,
        state_dir=str(root / "factories" / factory_name(partition)),
        require_secure_aggregation=secure,  # as `fedforge client` does by default
    ).validated()


_servicers: dict[int, Any] = {}


def servicer(node_config: dict[str, Any], run_config: dict[str, Any]) -> Any:
    """The virtual factory's servicer, built on first use in this process and kept (its SecAgg sessions live in it)."""
    partition = int(node_config["partition-id"])
    if partition not in _servicers:
        from client.agent import EdgeAgentServicer  # torch is only imported on this path
        from client.trainer import FactoryTrainer

        servicer = EdgeAgentServicer(FactoryTrainer(agent_config(node_config, run_config)))
        if audit_dir := str(run_config.get("simulation-audit-dir", "")):
            servicer.audit = _auditor(Path(audit_dir), factory_name(partition))
        _servicers[partition] = servicer
    return _servicers[partition]


def _auditor(directory: Path, factory: str):  # type: ignore[no-untyped-def]
    """Writes a virtual factory's encoded (unmasked) contribution per round: simulation only, for checking the sum."""
    import numpy as np

    def write(server_round: int, encoded: Any) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        np.save(directory / f"round-{server_round}-{factory}.npy", encoded)

    return write


def check_dropout(node_config: dict[str, Any], run_config: dict[str, Any], server_round: int, stage: str) -> None:
    """Raise ``SimulatedDropout`` if this virtual factory drops at ``stage`` of ``server_round``."""
    partition = int(node_config["partition-id"])
    n = int(node_config.get("num-partitions", 1))
    if partition in dropped_in_run(run_config, n, server_round, stage):
        log.info("round %d: %s drops out at %s (simulation-dropout)", server_round, factory_name(partition), stage)
        raise SimulatedDropout(f"{factory_name(partition)} dropped out at {stage} of round {server_round} (simulated)")
