"""Finding 1 (critical): the central site's single open port. Only the Fleet API may face the network.

`fedforge server --tls --fleet-proxy nginx` (what `--host 0.0.0.0` does by default) over real processes:
a client that holds nothing but the federation's public ca.pem cannot reach a single Control or
Runtime API endpoint, cannot `flwr run` its own app and cannot `flwr supernode register` its own key,
while registered factories train through the proxy and the operator's `fedforge run` on the central
host (the SuperLink's loopback port) works.
"""

from __future__ import annotations

import socket
import ssl

import httpx
import pytest

from common.procs import ProcessSet
from server import launch
from server.certs import create_factory_key
from server.local import LocalFederation, wait_for_run
from server.registry.service import Registry

pytestmark = pytest.mark.slow


def _superlink_api_paths() -> list[str]:
    """Every path Flower 1.42's SuperLink serves (its own OpenAPI schema), plus its docs pages."""
    from flwr.superlink.main import create_app

    return sorted(create_app().openapi()["paths"]) + ["/docs", "/openapi.json"]


def _raw_post(port: int, ca: str, path: str) -> int:
    """POST a request line exactly as written (no client-side path normalisation); returns the status code."""
    context = ssl.create_default_context(cafile=ca)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock, context.wrap_socket(sock, server_hostname="127.0.0.1") as tls:
        tls.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
        return int(tls.recv(4096).split(b" ", 2)[1])


def test_only_the_fleet_api_faces_the_network(tmp_path, no_leftover_processes):
    root = tmp_path / "fed"
    with ProcessSet(root / "logs") as procs:
        fed = LocalFederation(root, procs, num_factories=3, train_size=120, tls=True, fleet_proxy=True)
        fed.start()
        ca = str(fed.certs_dir / "ca.pem")

        # 1. From the network, with only ca.pem: every API but the Fleet one answers 403 (the SuperLink never sees the request).
        refused = {}
        with httpx.Client(base_url=f"https://127.0.0.1:{fed.port}", verify=ca, timeout=20) as client:
            for path in _superlink_api_paths():
                if path.startswith("/v1/fleet/"):
                    continue
                status = client.post(path, content=b"").status_code
                refused[path] = status
                assert client.get(path).status_code == 403, path
        assert refused and set(refused.values()) == {403}, {p: s for p, s in refused.items() if s != 403}
        assert sum(p.startswith("/v1/control/") for p in refused) >= 40 and any(p.startswith("/v1/runtime/") for p in refused)
        for path in ("/v1/fleet/../control/start-run", "/v1/fleet/%2e%2e/control/start-run", "/v1/fleet/..%2fcontrol/list-runs",
                     "/v1/fleet//../control/register-node", "/v1/fleet/get-run/../../control/list-runs", "/v1/fleet/get-run?x=/../control"):
            assert _raw_post(fed.port, ca, path) in (400, 403), path

        # 2. The flwr CLI with only ca.pem: no run of its own, no SuperNode key of its own.
        attacker = launch.flwr_home(tmp_path / "attacker", fed.superlink, insecure=False, root_certificates=ca)
        with pytest.raises(RuntimeError, match="flwr run failed"):
            launch.submit_run(attacker, {"num-server-rounds": 1})
        _, rogue_pub = create_factory_key(tmp_path / "attacker-keys", "rogue")
        with pytest.raises(RuntimeError, match="registering"):
            launch.register_supernode(attacker, rogue_pub)

        # 3. The operator on the central host submits through the loopback port; registered factories train through nginx.
        flwr_run_id = fed.submit(fed.run_config(1, **{"architecture": "cnn-small", "local-epochs": 1, "personal-epochs": 0, "min-factories": 3,
                                                      "federated-evaluation": False, "test-size": 120}))
        registry = Registry.at(fed.registry_dir)
        run = wait_for_run(registry, f"run-{flwr_run_id}", timeout=300, procs=procs)
    assert run.status == "finished", run.error
    (round1,) = registry.rounds(f"run-{flwr_run_id}")
    assert round1.status == "completed" and round1.participants == ["factory-0", "factory-1", "factory-2"]
    assert len([r for r in registry.runs()]) == 1  # the attacker's run never started
