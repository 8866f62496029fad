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
@click.option("--dashboard-listen", default="127.0.0.1:8080", help="Web dashboard address ('' to not serve it).")
@click.option("--admin-token", default=None, envvar="FEDFORGE_ADMIN_TOKEN", help="Token for dashboard actions (approve, revoke, stop); none: read-only.")
@click.option("--view-token", default=None, envvar="FEDFORGE_VIEW_TOKEN", help="Token required to view the dashboard; none: open.")
def server(workdir: str, host: str, port: int, insecure: bool, registry_listen: str, dashboard_listen: str, admin_token: str | None,
           view_token: str | None) -> None:
    """Run the central site: a Flower SuperLink with a durable database (restarted if it dies) and the model registry."""
    from common.signing import key_id
    from server.registry.grpc_service import serve_registry
    from server.registry.service import Registry

    root = Path(workdir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    registry = Registry.at(root / "registry", create_key=True)
    log.info("registry %s, signing key id %s", root / "registry", key_id(registry.signing_key.public_key()))
    registry_server = serve_registry(registry, registry_listen)[0] if registry_listen else None
    dashboard = None
    if dashboard_listen:
        from server.dashboard.app import DashboardSettings, serve_dashboard

        home = launch.flwr_home(root, f"{'127.0.0.1' if host == '0.0.0.0' else host}:{port}")
        d_host, _, d_port = dashboard_listen.rpartition(":")
        dashboard = serve_dashboard(DashboardSettings(root / "registry", admin_token, view_token,
                                                      stop_run=lambda run_id: launch.stop_run(home, run_id)), d_host, int(d_port))
        log.info("dashboard on http://%s%s", dashboard_listen, "" if admin_token else " (read-only: no --admin-token)")
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
            if dashboard is not None:
                dashboard.should_exit = True


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


@click.command()
@click.option("--registry-dir", default="fedforge-central/registry", type=click.Path(file_okay=False, exists=True), help="An existing registry.")
@click.option("--host", default="127.0.0.1", help="Address to bind.")
@click.option("--port", default=8080, type=int, help="Port to bind.")
@click.option("--admin-token", default=None, envvar="FEDFORGE_ADMIN_TOKEN", help="Token for state-changing actions; none: read-only.")
@click.option("--view-token", default=None, envvar="FEDFORGE_VIEW_TOKEN", help="Token required to view; none: open.")
def dashboard(registry_dir: str, host: str, port: int, admin_token: str | None, view_token: str | None) -> None:
    """Serve the web dashboard over an existing registry."""
    import uvicorn

    from server.dashboard.app import DashboardSettings, create_app

    click.echo(f"FedForge dashboard on http://{host}:{port}{'' if admin_token else '  (read-only: no --admin-token)'}")
    uvicorn.run(create_app(DashboardSettings(Path(registry_dir).resolve(), admin_token, view_token)), host=host, port=port, log_level="warning")
