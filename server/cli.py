"""``fedforge server`` (the central site) and ``fedforge run`` (submit a federation run)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import click

from common.grpc_auth import is_loopback
from common.procs import ProcessSet, keep_running, wait_for_port
from server import launch

log = logging.getLogger("fedforge.server")


@click.command()
@click.option("--workdir", default="fedforge-central", type=click.Path(file_okay=False), help="SuperLink database, registry and logs.")
@click.option("--host", default="127.0.0.1", help="Address factories dial (0.0.0.0: every interface). Off loopback only the Fleet API is "
              "exposed, through nginx (see --fleet-proxy).")
@click.option("--port", default=8000, type=int, help="The port factories dial.")
@click.option("--local-port", default=0, type=int, help="With the Fleet proxy: the SuperLink's own port on 127.0.0.1, where operators on "
              "this host reach the Control API (default: --port + 1).")
@click.option("--fleet-proxy", default="auto", type=click.Choice(["auto", "nginx", "none"]),
              help="auto: nginx in front of a loopback SuperLink whenever --host is not loopback (Flower's Control API has no "
                   "authentication); nginx: always; none: the SuperLink itself listens on --host (every API exposed).")
@click.option("--insecure/--tls", default=True, help="Plain HTTP (loopback demos only) or TLS with --certs-dir.")
@click.option("--certs-dir", default=None, type=click.Path(file_okay=False), help="ca.pem, server.pem, server.key from `fedforge certs`.")
@click.option("--supernode-auth/--no-supernode-auth", default=None, help="Only registered factories may join (default: on with --tls).")
@click.option("--registry-listen", default="127.0.0.1:50051", help="ModelRegistry gRPC address ('' to not serve it).")
@click.option("--registry-token", default=None, envvar="FEDFORGE_REGISTRY_TOKEN",
              help="Token factories present to the registry; default: the one in <workdir>/registry/keys/registry.token (made once).")
@click.option("--dashboard-listen", default="127.0.0.1:8080", help="Web dashboard address ('' to not serve it).")
@click.option("--admin-token", default=None, envvar="FEDFORGE_ADMIN_TOKEN", help="Token for dashboard actions (approve, revoke, stop); none: read-only.")
@click.option("--view-token", default=None, envvar="FEDFORGE_VIEW_TOKEN", help="Token required to view the dashboard; none: open.")
@click.option("--rounds", default=0, type=int, help="Run a federation of this many rounds and keep it going across crashes (0: only serve).")
@click.option("--set", "overrides", multiple=True, help="Run-config key=value for --rounds (repeatable).")
def server(workdir: str, host: str, port: int, local_port: int, fleet_proxy: str, insecure: bool, certs_dir: str | None,
           supernode_auth: bool | None, registry_listen: str, registry_token: str | None, dashboard_listen: str, admin_token: str | None, view_token: str | None, rounds: int,
           overrides: tuple[str, ...]) -> None:
    """Run the central site: a Flower SuperLink with a durable database (restarted if it dies), behind nginx when it faces
    the network, and the model registry."""
    from common.signing import key_id
    from server import fleet_proxy as proxy
    from server.registry.grpc_service import registry_token as stored_token
    from server.registry.grpc_service import serve_registry
    from server.registry.service import Registry

    root = Path(workdir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    registry = Registry.at(root / "registry", create_key=True)
    log.info("registry %s, signing key id %s", root / "registry", key_id(registry.signing_key.public_key()))
    tls = None
    if not insecure:
        if not certs_dir:
            raise click.UsageError("--tls needs --certs-dir (create one with `fedforge certs`)")
        try:
            tls = launch.tls_files(certs_dir)
        except FileNotFoundError as exc:
            raise click.UsageError(str(exc)) from None
    proxied = fleet_proxy == "nginx" or (fleet_proxy == "auto" and not is_loopback(host))
    if proxied and tls is None:
        raise click.UsageError(f"--host {host} faces the network: the Fleet proxy needs --tls --certs-dir (or --host 127.0.0.1 for a local demo)")
    if proxied:
        try:
            proxy.nginx_binary()
        except proxy.ProxyError as exc:
            raise click.UsageError(str(exc)) from None
    # Where the SuperLink itself listens, and how operators on this host reach its Control API.
    link_host, link_port = ("127.0.0.1", local_port or port + 1) if proxied else (host, port)
    local = f"{'127.0.0.1' if link_host == '0.0.0.0' else link_host}:{link_port}"
    local_tls = tls  # behind the proxy too: Flower refuses SuperNode authentication without TLS
    auth = (not insecure) if supernode_auth is None else supernode_auth
    credentials = None
    if tls:
        import grpc

        credentials = grpc.ssl_server_credentials([(Path(tls["key"]).read_bytes(), Path(tls["cert"]).read_bytes())])
    registry_server = None
    if registry_listen:
        token_file = root / "registry" / "keys" / "registry.token"
        try:
            registry_server = serve_registry(registry, registry_listen, registry_token or stored_token(token_file), credentials)[0]
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        if not registry_token:
            log.info("registry token in %s: give it to factories (--registry-token or FEDFORGE_REGISTRY_TOKEN)", token_file)
    operator_home = launch.flwr_home(root, local, insecure=local_tls is None, root_certificates=local_tls["ca"] if local_tls else None)
    dashboard = None
    if dashboard_listen:
        from server.dashboard.app import DashboardSettings, serve_dashboard

        d_host, _, d_port = dashboard_listen.rpartition(":")
        dashboard = serve_dashboard(DashboardSettings(root / "registry", admin_token, view_token,
                                                      stop_run=lambda run_id: launch.stop_run(operator_home, run_id)), d_host, int(d_port))
        log.info("dashboard on http://%s%s", dashboard_listen, "" if admin_token else " (read-only: no --admin-token)")
    cmd = launch.superlink_command(root, link_host, link_port, insecure=local_tls is None, tls=local_tls, supernode_auth=auth)
    supervisor = None
    if rounds > 0:
        from server.supervisor import FederationSupervisor

        supervisor = FederationSupervisor(registry, operator_home, rounds, {"registry-dir": str(root / "registry"), **parse_overrides(overrides)})
    stop_proxy = threading.Event()

    def started(proc: Any) -> None:
        wait_for_port("127.0.0.1" if link_host == "0.0.0.0" else link_host, link_port, timeout=60, proc=proc)
        log.info("SuperLink pid %d listening on %s (workdir %s)", proc.pid, local, root)
        if proxied and not hasattr(started, "proxy"):
            conf = proxy.write_config(root / "fleet-proxy", f"{host}:{port}", local, tls)  # type: ignore[arg-type]
            started.proxy = threading.Thread(  # type: ignore[attr-defined]
                target=keep_running, args=(procs, "fleet-proxy", proxy.nginx_command(conf), "Fleet proxy (nginx)"),
                kwargs={"stop": stop_proxy}, daemon=True, name="fedforge-fleet-proxy")
            started.proxy.start()  # type: ignore[attr-defined]
            wait_for_port("127.0.0.1" if host == "0.0.0.0" else host, port, timeout=30)
            log.info("factories dial %s:%d (nginx: the Fleet API only); operators on this host: --superlink %s", host, port, local)
        if supervisor is not None and supervisor.ident is None:
            supervisor.start()

    with ProcessSet(root / "logs") as procs:
        try:
            keep_running(procs, "superlink", cmd, "SuperLink", env={"FLWR_TELEMETRY_ENABLED": "0"}, cwd=root, on_start=started)
        except KeyboardInterrupt:
            log.info("stopping the central site")
        finally:
            stop_proxy.set()
            if supervisor is not None:
                supervisor.stop()
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
@click.option("--root-certificates", default=None, type=click.Path(dir_okay=False, exists=True), help="CA certificate when the SuperLink uses TLS.")
@click.option("--set", "overrides", multiple=True, help="Any run-config key, e.g. --set lr=0.002 (repeatable).")
def run(superlink: str, workdir: str, registry_dir: str | None, rounds: int, root_certificates: str | None, overrides: tuple[str, ...]) -> None:
    """Submit a federation run to a SuperLink and print its run id."""
    root = Path(workdir).resolve()
    config = {"num-server-rounds": rounds, "registry-dir": str(Path(registry_dir or root / "registry").resolve()), **parse_overrides(overrides)}
    home = launch.flwr_home(root, superlink, insecure=root_certificates is None,
                            root_certificates=str(Path(root_certificates).resolve()) if root_certificates else None)
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


@click.command()
@click.option("--dir", "directory", default="fedforge-certs", type=click.Path(file_okay=False), help="Where to write the files.")
@click.option("--san", "sans", multiple=True, default=("localhost", "127.0.0.1"), show_default=True,
              help="A DNS name or IP address factories dial (repeatable).")
@click.option("--factory", "factories", multiple=True, help="Also create this factory's authentication key (repeatable).")
def certs(directory: str, sans: tuple[str, ...], factories: tuple[str, ...]) -> None:
    """Create the federation CA, the central site's TLS certificate and factory authentication keys."""
    from server.certs import create_ca, create_factory_key, create_server_cert

    d = Path(directory).resolve()
    ca, _ = create_ca(d)
    click.echo(f"CA               {ca}   (copy to every factory)")
    if not (d / "server.key").exists():
        cert, _ = create_server_cert(d, list(sans))
        click.echo(f"server cert      {cert}   SANs: {', '.join(sans)}")
    for name in factories:
        try:
            key, pub = create_factory_key(d, name)
        except (FileExistsError, ValueError) as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"factory {name:8s} {key} (copy to the factory) / {pub} (register with `fedforge factories add {name}`)")


@click.group()
def factories() -> None:
    """Register factories (SuperNode authentication keys) with the SuperLink."""


@factories.command("add")
@click.argument("names", nargs=-1, required=True)
@click.option("--certs-dir", default="fedforge-certs", type=click.Path(file_okay=False), help="From `fedforge certs`.")
@click.option("--superlink", default="127.0.0.1:8000", help="SuperLink address.")
@click.option("--workdir", default="fedforge-central", type=click.Path(file_okay=False), help="Where the Flower CLI config is kept.")
@click.option("--insecure/--tls", default=False, help="Plain HTTP to the SuperLink (a loopback demo without certificates).")
def factories_add(names: tuple[str, ...], certs_dir: str, superlink: str, workdir: str, insecure: bool) -> None:
    """Create (if needed) and register each factory's public key; print what to copy to the factory."""
    from server.certs import create_factory_key

    d = Path(certs_dir).resolve()
    home = launch.flwr_home(Path(workdir).resolve(), superlink, insecure=insecure, root_certificates=None if insecure else str(d / "ca.pem"))
    for name in names:
        key, pub = d / "factories" / name, d / "factories" / f"{name}.pub"
        if not key.exists():
            try:
                key, pub = create_factory_key(d, name)
            except ValueError as exc:
                raise click.ClickException(str(exc)) from None
        try:
            node_id = launch.register_supernode(home, pub)
        except RuntimeError as exc:
            raise click.ClickException(str(exc)) from None
        keys = Path(workdir).resolve() / "registry" / "keys"
        click.echo(f"registered factory {name} (SuperNode {node_id}). Copy to the factory: {d / 'ca.pem'} and {key}, then run")
        click.echo(f"  fedforge client --factory-id {name} --superlink {superlink} --tls --root-certificates ca.pem --auth-key {name}")
        click.echo(f"  with inspection: --registry <central>:50051 --registry-public-key {keys / 'signing.pub'} "
                   f"--release-public-key {keys / 'release.pub'} and FEDFORGE_REGISTRY_TOKEN from {keys / 'registry.token'}")
