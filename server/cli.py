"""``fedforge server`` (the central site) and ``fedforge run`` (submit a federation run)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import click

from common.procs import ProcessSet, wait_for_port
from server import launch

log = logging.getLogger("fedforge.server")


@click.command()
@click.option("--workdir", default="fedforge-central", type=click.Path(file_okay=False), help="SuperLink database, registry and logs.")
@click.option("--host", default="127.0.0.1", help="Address the SuperLink binds (0.0.0.0 to accept factories on the network).")
@click.option("--port", default=8000, type=int, help="SuperLink port (Fleet, Control and Runtime APIs).")
@click.option("--insecure/--tls", default=True, help="Plain HTTP (loopback demos only).")
@click.option("--registry-listen", default="127.0.0.1:50051", help="ModelRegistry gRPC address ('' to not serve it).")
def server(workdir: str, host: str, port: int, insecure: bool, registry_listen: str) -> None:
    """Run the central site: a Flower SuperLink with a durable database (restarted if it dies) and the model registry."""
    from common.signing import key_id
    from server.registry.grpc_service import serve_registry
    from server.registry.service import Registry

    root = Path(workdir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    registry = Registry.at(root / "registry", create_key=True)
    log.info("registry %s, signing key id %s", root / "registry", key_id(registry.signing_key.public_key()))
    registry_server = serve_registry(registry, registry_listen)[0] if registry_listen else None
    cmd = launch.superlink_command(root, host, port, insecure=insecure)
    with ProcessSet(root / "logs") as procs:
        try:
            restarts = 0
            while True:
                proc = procs.start("superlink", cmd, env={"FLWR_TELEMETRY_ENABLED": "0"}, cwd=root)
                wait_for_port(host if host != "0.0.0.0" else "127.0.0.1", port, timeout=60, proc=proc)
                log.info("SuperLink pid %d listening on %s:%d (workdir %s)", proc.pid, host, port, root)
                while proc.poll() is None:
                    time.sleep(0.5)
                restarts += 1
                log.warning("SuperLink exited with %s; restart %d", proc.returncode, restarts)
                procs.procs.remove(("superlink", proc))
                time.sleep(min(30, 2**restarts))
        except KeyboardInterrupt:
            log.info("stopping the central site")
        finally:
            if registry_server is not None:
                registry_server.stop(grace=1)


def parse_overrides(pairs: tuple[str, ...]) -> dict[str, object]:
    import tomllib

    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise click.BadParameter(f"expected key=value, got {pair!r}", param_hint="--set")
        try:
            out[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = value
    return out


@click.command()
@click.option("--superlink", default="127.0.0.1:8000", help="SuperLink address.")
@click.option("--workdir", default="fedforge-central", type=click.Path(file_okay=False), help="Where the Flower CLI config is kept.")
@click.option("--registry-dir", default=None, type=click.Path(file_okay=False), help="Registry directory (default: <workdir>/registry).")
@click.option("--rounds", default=3, type=int, help="Number of server rounds.")
@click.option("--set", "overrides", multiple=True, help="Any run-config key, e.g. --set lr=0.002 (repeatable).")
def run(superlink: str, workdir: str, registry_dir: str | None, rounds: int, overrides: tuple[str, ...]) -> None:
    """Submit a federation run to a SuperLink and print its run id."""
    root = Path(workdir).resolve()
    config = {"num-server-rounds": rounds, "registry-dir": str(Path(registry_dir or root / "registry").resolve()), **parse_overrides(overrides)}
    home = launch.flwr_home(root, superlink)
    click.echo(launch.submit_run(home, config))
