"""Deployment: TLS and factory authentication over real processes; compose.yaml and its commands."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from common.procs import ProcessSet, free_port, stop_process
from server.local import LocalFederation, wait_for_run
from server.registry.service import Registry

pytestmark = pytest.mark.slow


def _supernode(superlink: str, log: Path, *flags: str) -> tuple[int, str]:
    """Start a SuperNode that should be refused; return (its exit code, its output).

    Its SuperExec child may keep retrying after the SuperNode itself exits, so the whole process
    group is stopped afterwards.
    """
    with open(log, "w") as out:
        proc = subprocess.Popen(["flower-supernode", "--superlink", superlink, "--port", str(free_port()), "--max-retries", "1", *flags],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            code = -1
        finally:
            stop_process(proc)
    return code, log.read_text()


def _compose_config(env: dict[str, str]) -> dict:
    """compose.yaml with every ${VARIABLE} resolved, by the compose implementation present."""
    import shutil

    import yaml

    root = Path(__file__).resolve().parents[1]
    if shutil.which("docker-compose"):
        cmd = ["docker-compose", "-f", str(root / "compose.yaml"), "config"]
    else:
        cmd = ["docker", "compose", "-f", str(root / "compose.yaml"), "config"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, cwd=root, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def test_compose_file_validates():
    config = _compose_config({"FEDFORGE_ADMIN_TOKEN": "x"})
    assert {"central", "fleet-proxy", "factory-a", "factory-b", "factory-c", "certs", "register", "run"} <= set(config["services"])
    central = config["services"]["central"]
    assert "--tls" in central["command"] and "--supernode-auth" in central["command"] and central["restart"] == "unless-stopped"
    # only the Fleet API faces the network: the SuperLink on loopback, nginx in its network namespace, Control API users beside it
    assert central["command"][central["command"].index("--host") + 1] == "127.0.0.1"
    proxy = config["services"]["fleet-proxy"]
    assert proxy["network_mode"] == "service:central" and proxy["image"].startswith("nginx:")
    assert any(str(v).endswith("server/fleet_proxy.conf.template:/etc/nginx/templates/default.conf.template:ro") or
               (isinstance(v, dict) and str(v.get("source", "")).endswith("server/fleet_proxy.conf.template")) for v in proxy["volumes"])
    assert all(config["services"][s]["network_mode"] == "service:central" for s in ("register", "run"))
    assert all("--auth-key" in config["services"][f]["command"] for f in ("factory-a", "factory-b", "factory-c"))
    assert {"central-data", "factory-a-state", "certs"} <= set(config["volumes"])
    # the agent (images, state, policy) and the SuperNode (whatever ClientApp the federation sends) are separate containers
    # that share only the agent's socket; the agent has no network and its control plane is that socket
    for f in ("a", "b", "c"):
        agent, node = config["services"][f"factory-{f}-agent"], config["services"][f"factory-{f}"]
        volumes = {name: [str(v.get("source", v)) if isinstance(v, dict) else str(v).split(":")[0] for v in svc["volumes"]]
                   for name, svc in (("agent", agent), ("node", node))}
        assert agent["network_mode"] == "none" and agent["command"][0] == "agent" and node["command"][0] == "supernode"
        assert agent["command"][agent["command"].index("--agent-listen") + 1] == "unix:/run/fedforge/agent.sock"
        assert agent["command"][agent["command"].index("--train-size") + 1] == "600"  # DEMO_TRAIN_SIZE unset: the demo's size
        assert node["command"][node["command"].index("--agent-address") + 1] == "unix:/run/fedforge/agent.sock"
        assert f"factory-{f}-socket" in volumes["agent"] and f"factory-{f}-socket" in volumes["node"]
        assert {f"factory-{f}-state", f"factory-{f}-data"} <= set(volumes["agent"]) and not {f"factory-{f}-state", f"factory-{f}-data"} & set(volumes["node"])
        assert node["depends_on"][f"factory-{f}-agent"]["condition"] == "service_healthy"


def _wait_for_agent(address: str, procs: ProcessSet, timeout: float = 180.0) -> None:
    """The compose healthcheck: the agent answers Health on its address (a Unix socket here)."""
    from common.rpc.fedforge.v1 import edge_pb2, edge_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        while True:
            assert not procs.dead(), procs.dead()
            try:
                edge_pb2_grpc.EdgeAgentStub(channel).Health(edge_pb2.HealthRequest(), timeout=2)
                return
            except grpc.RpcError:
                assert time.monotonic() < deadline, f"no agent serving on {address}"
                time.sleep(0.2)


def test_compose_commands_run_as_local_processes(tmp_path, no_leftover_processes):
    """The services' exact commands and environment, resolved by compose, started as processes on 127.0.0.1.

    TLS and SuperNode authentication are on, as in compose.yaml: an unregistered key, plain HTTP and a
    certificate from another CA are refused. kill -9 one factory's SuperNode mid-round: the round goes on
    without it, the federation finishes, and `fedforge client` brings the SuperNode back with its identity.
    """
    import signal

    from common.procs import wait_for_port
    from common.signing import load_public, verify_manifest, verify_weights
    from server.certs import create_ca, create_factory_key
    from server.local import fedforge_command

    env = {
        "FEDFORGE_ADMIN_TOKEN": "compose-test", "CERTS_DIR": str(tmp_path / "certs"), "CENTRAL_DATA": str(tmp_path / "central"),
        "CENTRAL_HOST": "127.0.0.1", "BIND_HOST": "127.0.0.1", "SUPERLINK_PORT": str(free_port()), "SUPERLINK_LOCAL_PORT": str(free_port()),
        "REGISTRY_PORT": str(free_port()),
        "DASHBOARD_PORT": str(free_port()), "REGISTER_HOME": str(tmp_path / "register"), "RUN_HOME": str(tmp_path / "run"), "ROUNDS": "2",
        "ROUND_TIMEOUT": "30.0", "DEMO_TRAIN_SIZE": "200",  # the deployment's wiring, not its accuracy: a third of the backbone passes
    }
    for f in ("A", "B", "C"):  # each factory's agent and SuperNode share only the agent's socket, as their containers do
        (tmp_path / f"socket-{f.lower()}").mkdir()
        env |= {f"FACTORY_{f}_AGENT": f"unix:{tmp_path / f'socket-{f.lower()}' / 'agent.sock'}", f"FACTORY_{f}_SUPERNODE_PORT": str(free_port()),
                f"FACTORY_{f}_STATE": str(tmp_path / f"state-{f.lower()}"), f"FACTORY_{f}_NODE": str(tmp_path / f"factory-{f.lower()}")}
    services = _compose_config(env)["services"]

    def command(name: str) -> tuple[list[str], dict[str, str]]:
        svc = services[name]
        return fedforge_command() + [str(a) for a in svc["command"]], {k: str(v) for k, v in (svc.get("environment") or {}).items()}

    def once(name: str) -> str:
        cmd, svc_env = command(name)
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **svc_env}, timeout=180, check=False)
        assert proc.returncode == 0, f"{name}: {proc.stdout[-1500:]} {proc.stderr[-1500:]}"
        return proc.stdout

    def fleet_proxy() -> list[str]:
        """The fleet-proxy service: nginx with the template the image's envsubst would render from its environment."""
        from server import fleet_proxy as proxy

        values = {k: str(v) for k, v in services["fleet-proxy"]["environment"].items()}
        block = proxy.render_server_block(values)
        run_dir = tmp_path / "fleet-proxy"
        run_dir.mkdir()
        (run_dir / "nginx.conf").write_text(proxy.nginx_conf(block, run_dir))
        return proxy.nginx_command(run_dir / "nginx.conf")

    with ProcessSet(tmp_path / "logs") as procs:
        once("certs")
        cmd, svc_env = command("central")
        central = procs.start("central", cmd, env=svc_env)
        wait_for_port("127.0.0.1", int(env["SUPERLINK_LOCAL_PORT"]), 90, central)
        nginx = procs.start("fleet-proxy", fleet_proxy())
        wait_for_port("127.0.0.1", int(env["SUPERLINK_PORT"]), 30, nginx)
        once("register")
        for f in ("a", "b", "c"):
            cmd, svc_env = command(f"factory-{f}-agent")
            procs.start(f"factory-{f}-agent", cmd, env=svc_env)
        for f in ("a", "b", "c"):  # compose starts a SuperNode once its agent is healthy
            _wait_for_agent(env[f"FACTORY_{f.upper()}_AGENT"], procs)
            assert os.stat(env[f"FACTORY_{f.upper()}_AGENT"].removeprefix("unix:")).st_mode & 0o777 == 0o660  # the agent's user and group only
            cmd, svc_env = command(f"factory-{f}")
            procs.start(f"factory-{f}", cmd, env=svc_env)
        run_id = "run-" + once("run").strip().splitlines()[-1]
        registry = Registry.at(tmp_path / "central" / "registry")
        deadline = time.monotonic() + 300
        while not registry.rounds(run_id):
            assert time.monotonic() < deadline, "round 1 never completed"
            time.sleep(0.2)
        time.sleep(1.0)  # round 2 in flight
        supernode_log = tmp_path / "factory-c" / "logs" / "supernode.log"
        activations = supernode_log.read_text().count("SuperNode ID:")
        (supernode,) = _pids("factory-id='factory-c'")
        os.kill(supernode, signal.SIGKILL)
        killed_at = time.monotonic()

        # while round 2 waits for factory-c: an unregistered key, plain HTTP, and another CA's certificate are refused
        superlink, certs = f"127.0.0.1:{env['SUPERLINK_PORT']}", tmp_path / "certs"
        rogue_key, _ = create_factory_key(certs, "rogue")
        code, out = _supernode(superlink, tmp_path / "rogue.log", "--root-certificates", str(certs / "ca.pem"), "--auth-supernode-private-key", str(rogue_key))
        assert code > 0 and "Failed to activate SuperNode" in out, out[-2000:]
        code, out = _supernode(superlink, tmp_path / "plain.log", "--insecure")
        assert code > 0, out[-2000:]
        other_ca, _ = create_ca(tmp_path / "other-ca")
        code, out = _supernode(superlink, tmp_path / "wrong-ca.log", "--root-certificates", str(other_ca),
                               "--auth-supernode-private-key", str(certs / "factories" / "factory-a"))
        assert code > 0 and "SSL/TLS handshake error" in out, out[-2000:]

        run = wait_for_run(registry, run_id, timeout=300, procs=procs)
        finished = time.monotonic() - killed_at
        # The SuperLink takes the same authenticated node back once its old heartbeat lapses: two declared intervals,
        # 20 s with FedForge's 10 s heartbeat (Flower's 30 s: a minute).
        while supernode_log.read_text().count("SuperNode ID:") == activations and time.monotonic() - killed_at < 120:
            time.sleep(1.0)
        rejoined = time.monotonic() - killed_at
        client_log = (tmp_path / "logs" / "factory-c.log").read_text()

    rounds = registry.rounds(run_id)
    assert run.status == "finished", run.error
    assert [r.status for r in rounds] == ["completed", "completed"] and rounds[0].participants == ["factory-a", "factory-b", "factory-c"]
    # Round 2 either reached factory-c after the restart or went on without it; either way nothing is counted twice.
    assert rounds[1].participants == ["factory-a", "factory-b", "factory-c"] or (
        rounds[1].participants == ["factory-a", "factory-b"] and list(rounds[1].failures) == ["factory-c"]), rounds[1]
    assert "SuperNode exited with -9; restart" in client_log, client_log[-3000:]  # fedforge client restarted it
    node_ids = [line.rsplit(":", 1)[1].strip() for line in supernode_log.read_text().splitlines() if "SuperNode ID:" in line]
    assert len(node_ids) > activations and len(set(node_ids)) == 1, node_ids  # active again, with its registered identity
    pinned = load_public(tmp_path / "central" / "registry" / "keys" / "signing.pub")
    for v in registry.versions(run_id):
        verify_weights(registry.artifacts.path_for(v.sha256), verify_manifest(v.manifest.encode(), v.signature, pinned))
    print(f"\nkilled SuperNode -> run finished: {finished:.1f} s (round 2: {rounds[1].participants}, {rounds[1].seconds:.1f} s); "
          f"restarted SuperNode active again after {rejoined:.1f} s")


def _pids(pattern: str) -> list[int]:
    from tests.conftest import federation_pids

    out = []
    for pid in federation_pids():
        try:
            if pattern in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                out.append(pid)
        except OSError:
            pass
    return out


def test_central_site_crashes_resume_from_the_registry(tmp_path, no_leftover_processes, chromium):
    """kill -9 the SuperLink mid-round, then the ServerApp mid-round: the federation still finishes its 3 rounds,
    and the dashboard shows both interruptions and where each later run resumed from."""
    import signal

    from selenium.webdriver.common.by import By

    from common.procs import wait_for_port
    from common.signing import load_public, verify_manifest, verify_weights
    from server import launch
    from server.dashboard.app import DashboardSettings, serve_dashboard

    with ProcessSet(tmp_path / "logs") as procs:
        fed = LocalFederation(tmp_path, procs, num_factories=2, train_size=200, secure=False,
                              central_flags=["--rounds", "3", "--set", "local-epochs=1", "--set", "min-factories=2", "--set", "expected-factories=2",
                                             "--set", "architecture='cnn-small'", "--set", "personal-epochs=0", "--set", "federated-evaluation=false",
                                             "--set", "test-size=120"])
        fed.start()
        registry = Registry.at(fed.registry_dir)

        def completed_rounds() -> list[int]:
            return sorted(r.server_round for run in registry.runs() for r in registry.rounds(run.id) if r.status == "completed")

        def wait_for(predicate, what: str, timeout: float = 300) -> None:
            deadline = time.monotonic() + timeout
            while not predicate():
                assert time.monotonic() < deadline, f"timed out waiting for {what}; rounds {completed_rounds()}"
                time.sleep(0.3)

        wait_for(lambda: completed_rounds() == [1], "round 1")
        time.sleep(1.0)  # round 2 in flight
        (superlink,) = _pids(str(tmp_path / "central" / "superlink.db"))
        os.kill(superlink, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(lambda: 2 in completed_rounds(), "round 2 after the SuperLink restart")
        recovery = time.monotonic() - killed_at
        time.sleep(1.0)  # round 3 in flight
        for pid in _pids("flwr-serverapp"):
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: 3 in completed_rounds() and all(r.status != "running" for r in registry.runs()), "round 3 after the ServerApp kill")
        # both interrupted runs were stopped in Flower by the supervisor, not left to lapse (a restarted SuperLink keeps a run
        # of a dead ServerApp running for a minute, and a SuperNode stuck on one of its messages takes no other)
        interrupted = [run.id.removeprefix("run-") for run in registry.runs() if run.status == "interrupted"]
        assert [launch.run_status(fed.flwr_home(), i) for i in interrupted] == ["finished:stopped"] * 2, interrupted

    assert completed_rounds() == [1, 2, 3]  # no round counted twice
    statuses = [run.status for run in registry.runs()]
    assert statuses.count("interrupted") == 2 and statuses[-1] == "finished", statuses
    pinned = load_public(fed.registry_dir / "keys" / "signing.pub")
    for v in registry.versions():
        manifest = verify_manifest(v.manifest.encode(), v.signature, pinned)
        verify_weights(registry.artifacts.path_for(v.sha256), manifest)
    chain = [v for v in registry.versions() if v.kind == "fedavg"]
    assert [v.server_round for v in chain] == [1, 2, 3] and chain[1].parent_id == chain[0].id and chain[2].parent_id == chain[1].id

    port = free_port()
    dashboard = serve_dashboard(DashboardSettings(fed.registry_dir), "127.0.0.1", port)
    try:
        wait_for_port("127.0.0.1", port, 30)
        chromium.get(f"http://127.0.0.1:{port}/runs")
        rows = {r.get_attribute("data-run"): r for r in chromium.find_elements(By.CSS_SELECTOR, "tr[data-run]")}
        assert set(rows) == {run.id for run in registry.runs()}
        for run in registry.runs():
            row = rows[run.id]
            assert row.find_element(By.CSS_SELECTOR, "td.status").text == run.status
            assert row.find_element(By.CSS_SELECTOR, "td.resumed-from").text == (run.config.get("resume_from") or "–")
            if run.status == "interrupted":
                assert row.find_element(By.CSS_SELECTOR, "td.status").value_of_css_property("color") == "rgba(180, 83, 9, 1)"
                assert row.find_element(By.CSS_SELECTOR, "td.error").text == run.error.strip() != ""
        resumed = [run.config.get("resume_from") for run in registry.runs()][1:]
        assert resumed == [chain[0].id, chain[1].id]  # each restart continued from the last complete version
    finally:
        dashboard.should_exit = True
    print(f"\nkilled SuperLink -> next completed round: {recovery:.1f} s")


def test_registry_killed_mid_write_leaves_no_half_version(tmp_path):
    """kill -9 a process while it writes a large version: nothing half-written becomes visible."""
    import signal
    import textwrap

    from common.signing import load_public, verify_manifest, verify_weights

    Registry.at(tmp_path, create_key=True)  # migrate and create the key first, as `fedforge server` does
    script = textwrap.dedent(f"""
        from collections import OrderedDict
        import numpy as np
        from server.registry.service import NewVersion, Registry
        reg = Registry.at({str(tmp_path)!r})
        reg.add_version(NewVersion(run_id="ok", server_round=0, parent_id=None, kind="initial", architecture="x",
                                   weights=OrderedDict(w=np.ones(1000, np.float32)), metrics={{}}, participants=[]))
        print("first", flush=True)
        while True:
            reg.add_version(NewVersion(run_id="big", server_round=1, parent_id=None, kind="fedavg", architecture="x",
                                       weights=OrderedDict(w=np.random.default_rng().random(60_000_000, dtype=np.float32)),
                                       metrics={{}}, participants=[]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "first"
    deadline = time.monotonic() + 60
    while not list((tmp_path / "artifacts").rglob(".tmp-*")):  # the big file is being written
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)

    registry = Registry.at(tmp_path)
    pinned = load_public(tmp_path / "keys" / "signing.pub")
    for v in registry.versions():  # every visible version is complete and verifies
        verify_weights(registry.artifacts.path_for(v.sha256), verify_manifest(v.manifest.encode(), v.signature, pinned))
    assert "ok" in {v.run_id for v in registry.versions()}
    finals = [p for p in (tmp_path / "artifacts").rglob("*.npz") if not p.name.startswith(".tmp-")]
    assert len(finals) == len({v.sha256 for v in registry.versions()})  # no orphan final file either


def test_a_restarted_process_gets_a_fresh_command_so_a_port_taken_meanwhile_is_not_retried(tmp_path):
    """`keep_running` with a callable command (what `fedforge client --supernode-port 0` passes): a process that died
    because its port was taken is restarted on the port chosen at that moment, not on the taken one again."""
    import socket
    import threading

    from common.procs import keep_running

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1], free_port()])
    started: list[int] = []
    stop = threading.Event()
    bind_or_fail = "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); time.sleep(0.5)"

    def command() -> list[str]:
        started.append(next(ports))
        return [sys.executable, "-c", bind_or_fail, str(started[-1])]

    with taken, ProcessSet(tmp_path) as procs:
        keep_running(procs, "binder", command, "a port binder", stop=stop, stable_seconds=0.0,
                     on_start=lambda proc: stop.set() if len(started) == 2 else None)
        assert [p.returncode for _, p in procs.procs] == [0]  # the second start bound its port and exited cleanly
    assert len(started) == 2 and started[0] != started[1]
    assert "Address already in use" in (tmp_path / "binder.log").read_text()
