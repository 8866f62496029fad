"""A federation on one machine, built from the same commands real sites run.

`LocalFederation` starts ``fedforge server`` and one ``fedforge client`` per factory (or, for fault
tests, ``fedforge agent`` and ``flower-supernode`` as separate processes), waits until every agent
serves, and submits runs. ``fedforge demo``, the end-to-end tests and the benchmarks all use it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from common.procs import ProcessSet, free_port, supernode_command, supernode_env, wait_for_port
from common.rpc.fedforge.v1 import edge_pb2, edge_pb2_grpc
from server import launch


def wait_for_run(registry: Any, run_id: str, timeout: float = 600.0, procs: ProcessSet | None = None) -> Any:
    """Block until the registry records the end of ``run_id``; raise if that takes longer or a process dies."""
    deadline = time.monotonic() + timeout
    while (run := registry.get_run(run_id)) is None or run.status == "running":
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} did not finish within {timeout:.0f}s")
        if procs is not None and (dead := procs.dead()):
            raise RuntimeError(f"process {dead[0][0]} exited with {dead[0][1]} during run {run_id}")
        time.sleep(0.5)
    return run


def fedforge_command() -> list[str]:
    exe = shutil.which("fedforge")
    return [exe] if exe else [sys.executable, "-m", "common.cli"]


@dataclass
class Factory:
    index: int
    factory_id: str
    agent_address: str
    supernode_port: int  # 0: `fedforge client` picks a free port each time it (re)starts the SuperNode


@dataclass
class LocalFederation:
    root: Path
    procs: ProcessSet
    num_factories: int = 3
    seed: int = 0
    alpha: float = 1.0
    train_size: int = 600
    factory_flags: list[str] = field(default_factory=list)  # extra `fedforge client|agent` flags (e.g. --dp)
    port: int = field(default_factory=free_port)
    registry_port: int = 0
    dashboard_port: int = 0
    admin_token: str = ""
    central_flags: list[str] = field(default_factory=list)  # extra `fedforge server` flags (e.g. --rounds 3)
    tls: bool = False  # TLS everywhere and SuperNode authentication (certificates made under <root>/certs)
    fleet_proxy: bool = False  # with tls: nginx on `port` exposes only the Fleet API; the SuperLink listens on `local_port`
    local_port: int = field(default_factory=free_port)
    architectures: list[str] = field(default_factory=list)  # per factory, cycled (e.g. cnn-small, cnn-medium); empty: the run's default
    factory_args: dict[int, list[str]] = field(default_factory=dict)  # extra flags for one factory (e.g. its own --data folder)
    secure: bool = True  # secure aggregation (factories require it); False: plain rounds, factories allow plaintext answers

    factories: list[Factory] = field(default_factory=list)

    @property
    def certs_dir(self) -> Path:
        return self.root / "certs"

    @property
    def superlink(self) -> str:
        """What factories dial (the Fleet proxy when there is one)."""
        return f"127.0.0.1:{self.port}"

    @property
    def operator_superlink(self) -> str:
        """Where an operator on the central host reaches the Control API."""
        return f"127.0.0.1:{self.local_port}" if self.fleet_proxy else self.superlink

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def registry_dir(self) -> Path:
        return self.root / "central" / "registry"

    @property
    def registry_address(self) -> str:
        return f"127.0.0.1:{self.registry_port}"

    def start_central(self) -> None:
        self.registry_port = self.registry_port or free_port()
        self.dashboard_port = self.dashboard_port or free_port()
        tls_flags = []
        if self.tls:
            subprocess.run(fedforge_command() + ["certs", "--dir", str(self.certs_dir)], check=True, capture_output=True)
            tls_flags = ["--tls", "--certs-dir", str(self.certs_dir)]
            if self.fleet_proxy:
                tls_flags += ["--fleet-proxy", "nginx", "--local-port", str(self.local_port)]
        proc = self.procs.start("central", fedforge_command() + [
            "server", "--workdir", str(self.root / "central"), "--port", str(self.port), "--registry-listen", self.registry_address,
            "--dashboard-listen", f"127.0.0.1:{self.dashboard_port}", *tls_flags,
            *([] if self.secure else ["--set", "secure-aggregation=false"]), *self.central_flags,
        ], env={"FEDFORGE_ADMIN_TOKEN": self.admin_token} if self.admin_token else None)
        wait_for_port("127.0.0.1", self.port, timeout=90, proc=proc)

    def _data_flags(self, index: int) -> list[str]:
        return ["--factory-index", str(index), "--num-factories", str(self.num_factories), "--data-seed", str(self.seed),
                "--alpha", str(self.alpha), "--train-size", str(self.train_size),
                "--state-dir", str(self.root / f"factory-{index}" / "state"), *self.architecture_flags(index), *self.factory_flags,
                *([] if self.secure else ["--no-require-secure-aggregation"]),
                *self.factory_args.get(index, [])]

    def architecture_flags(self, index: int) -> list[str]:
        return ["--architecture", self.architectures[index % len(self.architectures)]] if self.architectures else []

    def start_factory(self, index: int, separate_agent: bool = False) -> Factory:
        """One factory; with ``separate_agent`` its agent and SuperNode are separate processes."""
        # A port chosen here stays free only until something else on this host takes it: the agent binds its own at once
        # and `fedforge client` picks the SuperNode's (0) as it starts it, so no slow start-up (a DDP worker group) sits between.
        f = Factory(index, f"factory-{index}", f"127.0.0.1:{free_port()}", free_port() if separate_agent else 0)
        ff = fedforge_command()
        security = ["--insecure"]
        if self.tls:
            self.register(f.factory_id)
            security = ["--tls", "--root-certificates", str(self.certs_dir / "ca.pem"), "--auth-key", str(self.certs_dir / "factories" / f.factory_id)]
        if not separate_agent:
            self.procs.start(f.factory_id, ff + [
                "client", "--factory-id", f.factory_id, "--superlink", self.superlink, "--agent-listen", f.agent_address,
                "--supernode-port", str(f.supernode_port), "--workdir", str(self.root / f.factory_id), *security, *self._data_flags(index),
            ])
        else:
            self.procs.start(f"{f.factory_id}-agent", ff + ["agent", "--factory-id", f.factory_id, "--agent-listen", f.agent_address, *self._data_flags(index)])
            node_config = f"factory-id='{f.factory_id}' agent-address='{f.agent_address}'"
            self.procs.start(f"{f.factory_id}-supernode", [
                *supernode_command(), "--insecure", "--superlink", self.superlink,
                "--port", str(f.supernode_port), "--node-config", node_config,
            ], env=supernode_env())
        self.factories.append(f)
        return f

    def start(self, separate_agents: frozenset[int] = frozenset()) -> None:
        self.start_central()
        for i in range(self.num_factories):
            self.start_factory(i, separate_agent=i in separate_agents)
        for f in self.factories:
            self.wait_for_agent(f.agent_address)

    def wait_for_agent(self, address: str, timeout: float = 180.0) -> edge_pb2.HealthReply:
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(address) as channel:
            stub = edge_pb2_grpc.EdgeAgentStub(channel)
            while True:
                if dead := self.procs.dead():
                    raise RuntimeError(f"process {dead[0][0]} exited with {dead[0][1]} during start-up (see {self.root / 'logs'})")
                try:
                    return stub.Health(edge_pb2.HealthRequest(), timeout=2)
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"edge agent at {address} not serving after {timeout:.0f}s") from None
                    time.sleep(0.2)

    def register(self, name: str) -> None:
        """``fedforge factories add NAME``: what an operator runs before a factory may join."""
        proc = subprocess.run(fedforge_command() + ["factories", "add", name, "--certs-dir", str(self.certs_dir), "--superlink", self.operator_superlink,
                                                    "--workdir", str(self.root / "central")],
                              capture_output=True, text=True, timeout=120, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"fedforge factories add {name} failed: {proc.stdout} {proc.stderr}"[-2000:])

    def flwr_home(self) -> Path:
        if self.tls:
            return launch.flwr_home(self.root / "central", self.operator_superlink, insecure=False,
                                    root_certificates=str(self.certs_dir / "ca.pem"))
        return launch.flwr_home(self.root / "central", self.superlink)

    def run_config(self, rounds: int, **overrides: Any) -> dict[str, Any]:
        return {
            "num-server-rounds": rounds, "min-factories": max(1, self.num_factories - 1), "expected-factories": self.num_factories,
            "seed": self.seed, "data-seed": self.seed, "num-factories": self.num_factories, "alpha": self.alpha,
            "registry-dir": str(self.registry_dir), **({} if self.secure else {"secure-aggregation": False}), **overrides,
        }

    def submit(self, run_config: dict[str, Any]) -> str:
        return launch.submit_run(self.flwr_home(), run_config)

    def process(self, name: str) -> Any:
        return next(p for n, p in self.procs.procs if n == name)
