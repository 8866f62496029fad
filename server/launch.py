"""Starting a SuperLink and submitting FedForge runs to it (used by ``fedforge server|run|demo``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomli_w

CONNECTION = "fedforge"


def superlink_command(workdir: Path, host: str, port: int, insecure: bool = True, tls: Mapping[str, str] | None = None,
                      supernode_auth: bool = False, simulation: bool = False) -> list[str]:
    """The exact SuperLink command line FedForge runs (compose runs the same); ``simulation``: Flower's Simulation
    Engine runs the ClientApps of virtual SuperNodes (``fedforge simulate``) instead of real SuperNodes."""
    cmd = [
        shutil.which("flower-superlink") or "flower-superlink",
        "--database", str(workdir / "superlink.db"),
        "--disable-runtime-dependency-installation",  # offline factories: never `uv sync` per run
        "--host", host, "--port", str(port),
    ]
    if insecure:
        cmd.append("--insecure")
    elif tls:
        cmd += ["--ssl-ca-certfile", tls["ca"], "--ssl-certfile", tls["cert"], "--ssl-keyfile", tls["key"]]
    if supernode_auth:
        cmd.append("--enable-supernode-auth")  # only factories registered with `fedforge factories add` may join
    if simulation:
        cmd.append("--simulation")
    return cmd


def tls_files(certs_dir: str | Path) -> dict[str, str]:
    d = Path(certs_dir).resolve()
    files = {"ca": str(d / "ca.pem"), "cert": str(d / "server.pem"), "key": str(d / "server.key")}
    missing = [f for f in files.values() if not Path(f).exists()]
    if missing:
        raise FileNotFoundError(f"missing TLS files {missing}; create them with `fedforge certs --dir {d}`")
    return files


def register_supernode(home: Path, public_key: str | Path, timeout: float = 60.0) -> str:
    """``flwr supernode register KEY.pub fedforge``; returns Flower's node id."""
    proc = subprocess.run([shutil.which("flwr") or "flwr", "supernode", "register", str(public_key), CONNECTION, "--format", "json"],
                          env=flwr_env(home), capture_output=True, text=True, timeout=timeout, check=False)
    try:
        out = json.loads(proc.stdout)
    except json.JSONDecodeError:
        out = {}
    if proc.returncode != 0 or not out.get("success", False):
        raise RuntimeError(f"registering {public_key} failed: {proc.stdout.strip()} {proc.stderr.strip()}"[-1500:])
    return str(out.get("node-id", ""))


def app_dir() -> Path:
    """The directory whose pyproject.toml holds ``[tool.flwr.app]`` (FEDFORGE_APP_DIR overrides)."""
    env = os.environ.get("FEDFORGE_APP_DIR")
    candidate = Path(env) if env else Path(__file__).resolve().parents[1]
    if not (candidate / "pyproject.toml").is_file():
        raise FileNotFoundError(
            f"no pyproject.toml with the Flower app in {candidate}; set FEDFORGE_APP_DIR to the FedForge source directory"
        )
    return candidate


def flwr_home(workdir: Path, superlink: str, insecure: bool = True, root_certificates: str | None = None) -> Path:
    """A private FLWR_HOME whose config.toml names the SuperLink connection ``fedforge``."""
    home = workdir / "flwr-home"
    home.mkdir(parents=True, exist_ok=True)
    conn: dict[str, Any] = {"address": superlink, "insecure": insecure}
    if root_certificates:
        conn["root-certificates"] = root_certificates
    (home / "config.toml").write_text(tomli_w.dumps({"superlink": {"default": CONNECTION, CONNECTION: conn}}))
    return home


def flwr_env(home: Path) -> dict[str, str]:
    return {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0"}


def _toml_value(value: Any) -> str:
    return tomli_w.dumps({"v": value}).split("=", 1)[1].strip()


def _overrides(config: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={_toml_value(v)}" for k, v in config.items())


def submit_run(home: Path, run_config: Mapping[str, Any], timeout: float = 120.0, federation_config: Mapping[str, Any] | None = None) -> str:
    """``flwr run <app> fedforge --run-config ...``; returns the Flower run id. ``federation_config`` goes to
    ``--federation-config`` (a simulation's ``num-supernodes``, backend and resources)."""
    cmd = [shutil.which("flwr") or "flwr", "run", str(app_dir()), CONNECTION, "--format", "json"]
    if run_config:
        cmd += ["--run-config", _overrides(run_config)]
    if federation_config:
        cmd += ["--federation-config", _overrides(federation_config)]
    proc = subprocess.run(cmd, env=flwr_env(home), capture_output=True, text=True, timeout=timeout, check=False)
    try:
        out = json.loads(proc.stdout)
    except json.JSONDecodeError:
        out = {}
    if proc.returncode != 0 or not out.get("success", False) or "run-id" not in out:
        raise RuntimeError(f"flwr run failed ({proc.returncode}): {proc.stdout.strip()} {proc.stderr.strip()}"[-2000:])
    return str(out["run-id"])


def run_status(home: Path, run_id: str, timeout: float = 60.0) -> str:
    """The SuperLink's status of a run (e.g. 'running', 'finished:completed', 'finished:failed')."""
    proc = subprocess.run([shutil.which("flwr") or "flwr", "ls", CONNECTION, "--run-id", run_id, "--format", "json"],
                          env=flwr_env(home), capture_output=True, text=True, timeout=timeout, check=False)
    try:
        runs = json.loads(proc.stdout).get("runs", [])
    except json.JSONDecodeError:
        return "unknown"
    return str(runs[0].get("status", "unknown")) if runs else "unknown"


def stop_run(home: Path, run_id: str, timeout: float = 60.0) -> None:
    proc = subprocess.run([shutil.which("flwr") or "flwr", "stop", run_id, CONNECTION], env=flwr_env(home), capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"flwr stop {run_id} failed: {proc.stdout.strip()} {proc.stderr.strip()}"[-1000:])
