"""Deployment: TLS and factory authentication over real processes; compose.yaml and its commands."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from common.procs import ProcessSet, free_port, stop_process
from server.local import LocalFederation
from server.registry.service import Registry

pytestmark = pytest.mark.slow


def _supernode(fed: LocalFederation, log: Path, *flags: str) -> tuple[int, str]:
    """Start a SuperNode that should be refused; return (its exit code, its output).

    Its SuperExec child may keep retrying after the SuperNode itself exits, so the whole process
    group is stopped afterwards.
    """
    with open(log, "w") as out:
        proc = subprocess.Popen(["flower-supernode", "--superlink", fed.superlink, "--port", str(free_port()), "--max-retries", "1", *flags],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            code = -1
        finally:
            stop_process(proc)
    return code, log.read_text()


def test_tls_federation_admits_only_registered_factories(tmp_path, no_leftover_processes):
    with ProcessSet(tmp_path / "logs") as procs:
        fed = LocalFederation(tmp_path, procs, num_factories=2, train_size=200, tls=True)
        fed.start()
        run_id = "run-" + fed.submit(fed.run_config(1, **{"local-epochs": 1, "min-factories": 2}))
        registry = Registry.at(fed.registry_dir)
        deadline = time.monotonic() + 300
        while (run := registry.get_run(run_id)) is None or run.status == "running":
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert run.status == "finished" and registry.rounds(run_id)[0].participants == ["factory-0", "factory-1"]

        # an unregistered key, plain HTTP, and a certificate from another CA are all refused
        from server.certs import create_ca, create_factory_key

        rogue_key, _ = create_factory_key(fed.certs_dir, "rogue")
        code, out = _supernode(fed, tmp_path / "rogue.log", "--root-certificates", str(fed.certs_dir / "ca.pem"),
                               "--auth-supernode-private-key", str(rogue_key))
        assert code > 0 and "Failed to activate SuperNode" in out, out[-2000:]
        code, out = _supernode(fed, tmp_path / "plain.log", "--insecure")
        assert code > 0, out[-2000:]
        other_ca, _ = create_ca(tmp_path / "other-ca")
        code, out = _supernode(fed, tmp_path / "wrong-ca.log", "--root-certificates", str(other_ca),
                               "--auth-supernode-private-key", str(fed.certs_dir / "factories" / "factory-0"))
        assert code > 0 and "SSL/TLS handshake error" in out, out[-2000:]
