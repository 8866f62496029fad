"""``fedforge keys`` and ``fedforge models``: the central site's signing key and model versions."""

from __future__ import annotations

import getpass
import json
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from common.signing import create_keypair, key_id, load_private, load_public
from server.registry.service import Registry, ReleaseKeyError, TransitionError

console = Console()
DEFAULT_REGISTRY = "fedforge-central/registry"  # `fedforge server`'s default workdir; `fedforge demo` prints its own


@click.group()
def keys() -> None:
    """Create and show the federation's Ed25519 keys: ``signing`` (made by the central site, signs every version) and
    ``release`` (signs approvals, revocations and rollbacks; keep it off the central host in production)."""


@keys.command("create")
@click.option("--registry-dir", default=DEFAULT_REGISTRY, type=click.Path(file_okay=False), help="Registry directory (keys go to <dir>/keys).")
@click.option("--dir", "key_dir", default=None, type=click.Path(file_okay=False), help="Or write the key pair here (e.g. removable media).")
@click.option("--name", default="signing", type=click.Choice(["signing", "release"]), help="Which key.")
def keys_create(registry_dir: str, key_dir: str | None, name: str) -> None:
    """Create NAME.key (0600) and NAME.pub; never overwrites."""
    try:
        key_path, pub_path = create_keypair(Path(key_dir) if key_dir else Path(registry_dir) / "keys", name)
    except FileExistsError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"private key {key_path}")
    if name == "signing":
        click.echo(f"public key  {pub_path}  (copy it to every factory: --registry-public-key)")
    else:
        click.echo(f"public key  {pub_path}  (copy it to <registry-dir>/keys/release.pub and to every factory: --release-public-key)")
    click.echo(f"key id      {key_id(load_public(pub_path))}")


@keys.command("show")
@click.option("--registry-dir", default=DEFAULT_REGISTRY, type=click.Path(file_okay=False), help="Registry directory.")
@click.option("--name", default="signing", type=click.Choice(["signing", "release"]), help="Which key.")
def keys_show(registry_dir: str, name: str) -> None:
    """Print a public key and its id."""
    pub = Path(registry_dir) / "keys" / f"{name}.pub"
    if not pub.exists():
        raise click.ClickException(f"no {name} key in {pub.parent}; run `fedforge keys create --registry-dir {registry_dir} --name {name}`")
    click.echo(pub.read_text().strip())
    click.echo(f"key id {key_id(load_public(pub))}")


def _registry(registry_dir: str) -> Registry:
    if not (Path(registry_dir) / "registry.db").exists():
        raise click.ClickException(f"no registry at {registry_dir}")
    return Registry.at(registry_dir)


def federated_figures(reg: Registry, version_id: str) -> dict[str, Any]:
    """The latest federated evaluation of a version (accuracy, escape and false-reject rates on the factories' images)."""
    ev = reg.latest_evaluation(version_id)
    if ev is None:
        return {}
    return {"federated_accuracy": ev.figures.get("accuracy"), "escape_rate": ev.figures.get("escape-rate"),
            "false_reject_rate": ev.figures.get("false-reject-rate"), "evaluated_images": ev.examples, "evaluated_by": ev.factories}


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else "-"


@click.command("ls")
@click.option("--registry-dir", default=None, type=click.Path(file_okay=False), help="Read a local registry directly.")
@click.option("--registry", "address", default=None, help="Or ask a ModelRegistry gRPC service (host:port).")
@click.option("--registry-token", default="", envvar="FEDFORGE_REGISTRY_TOKEN", help="With --registry: the registry's client token.")
@click.option("--status", default="", type=click.Choice(["", "candidate", "approved", "revoked"]), help="Filter by status.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def models_ls(registry_dir: str | None, address: str | None, registry_token: str, as_json: bool, status: str) -> None:
    """List model versions, oldest first, with their federated figures (on the factories' own held-out images)."""
    if address:
        import grpc

        from common.rpc.fedforge.v1 import registry_pb2, registry_pb2_grpc

        with grpc.insecure_channel(address) as channel:
            try:
                reply = registry_pb2_grpc.ModelRegistryStub(channel).ListVersions(
                    registry_pb2.ListVersionsRequest(status=status), metadata=(("authorization", f"Bearer {registry_token}"),), timeout=30)
            except grpc.RpcError as exc:
                raise click.ClickException(f"registry {address}: {exc.code().name}: {exc.details()}") from None
            rows = [
                {"id": v.id, "round": v.server_round, "kind": v.kind, "architecture": v.architecture, "status": v.status,
                 "secure": v.secure_aggregation, "created": v.created_at}
                for v in reply.versions
            ]
    else:
        reg = _registry(registry_dir or DEFAULT_REGISTRY)
        rows = [
            {"id": v.id, "round": v.server_round, "kind": v.kind, "architecture": v.architecture, "status": v.status,
             "secure": v.secure_aggregation, "created": v.created_at.isoformat(), "accuracy": v.metrics.get("accuracy"),
             **federated_figures(reg, v.id)}
            for v in reg.versions(status=status or None)
        ]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(caption="federated: on the factories' own held-out images; escape: defects passed as good; false reject: good parts rejected")
    for col in ("id", "round", "kind", "architecture", "status", "secure", "test accuracy", "federated", "escape", "false reject"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["id"], str(r["round"]), r["kind"], r["architecture"], r["status"], "yes" if r["secure"] else "no", _fmt(r.get("accuracy")),
                      _fmt(r.get("federated_accuracy")), _fmt(r.get("escape_rate")), _fmt(r.get("false_reject_rate")))
    console.print(table)


def _change(registry_dir: str, version_id: str, actor: str | None, note: str, op: str, release_key: str | None) -> None:
    reg = _registry(registry_dir)
    try:
        key = load_private(release_key) if release_key else None
        v = getattr(reg, op)(version_id, actor=actor or getpass.getuser(), note=note, release_key=key)
    except (KeyError, TransitionError, ReleaseKeyError, TypeError, ValueError) as exc:
        raise click.ClickException(str(exc).strip("'\"")) from None
    click.echo(f"{v.id} is now {v.status} (release {reg.actions(version_id=v.id)[-1].release}, signed by the release key)")
    if op in ("approve", "rollback"):
        f = federated_figures(reg, v.id)
        if f:
            click.echo(f"  on {f['evaluated_images']} held-out images at {f['evaluated_by']} factories: accuracy {_fmt(f['federated_accuracy'])}, "
                       f"escape rate {_fmt(f['escape_rate'])}, false-reject rate {_fmt(f['false_reject_rate'])}")
        else:
            click.echo("  no federated evaluation recorded for this version: its escape rate is unknown")


def _status_options(f):  # type: ignore[no-untyped-def]
    f = click.argument("version_id")(f)
    f = click.option("--registry-dir", default=DEFAULT_REGISTRY, type=click.Path(file_okay=False))(f)
    f = click.option("--actor", default=None, help="Who does this (default: the OS user).")(f)
    f = click.option("--release-key", default=None, envvar="FEDFORGE_RELEASE_KEY", type=click.Path(dir_okay=False, exists=True),
                     help="The release key that signs the statement (default: <registry-dir>/keys/release.key, when it lives there).")(f)
    return click.option("--note", default="", help="Why.")(f)


@click.command("approve")
@_status_options
def models_approve(version_id: str, registry_dir: str, actor: str | None, release_key: str | None, note: str) -> None:
    """Approve a version for the factories' inspection lines (prints its escape rate)."""
    _change(registry_dir, version_id, actor, note, "approve", release_key)


@click.command("revoke")
@_status_options
def models_revoke(version_id: str, registry_dir: str, actor: str | None, release_key: str | None, note: str) -> None:
    """Revoke a version: edge nodes stop serving it (and go back to the newest version still approved)."""
    _change(registry_dir, version_id, actor, note, "revoke", release_key)


@click.command("rollback")
@_status_options
def models_rollback(version_id: str, registry_dir: str, actor: str | None, release_key: str | None, note: str) -> None:
    """Approve an older version again (it becomes the current one)."""
    _change(registry_dir, version_id, actor, note, "rollback", release_key)


@click.command("export")
@click.argument("version_id")
@click.option("--registry-dir", default=DEFAULT_REGISTRY, type=click.Path(file_okay=False))
@click.option("--out", "out_dir", default="fedforge-export", type=click.Path(file_okay=False), help="Where the exported files go.")
@click.option("--quantize/--no-quantize", default=False, help="Dynamic int8 quantization of linear layers.")
@click.option("--test-data", default=None, type=click.Path(file_okay=False, exists=True), help="Image folder for the accuracy check.")
@click.option("--bit-depth", default=16, type=click.IntRange(8, 16), help="Significant bits of its 16-bit grey images and colour TIFFs (12: Mono12 as 0..4095).")
def models_export(version_id: str, registry_dir: str, out_dir: str, quantize: bool, test_data: str | None, bit_depth: int) -> None:
    """Export an approved version (a torch.export .pt2 program, TorchScript, ONNX when installed), reporting the accuracy delta."""
    from common.data.folder import load_image_folder
    from server.export import export_version, input_of

    reg = _registry(registry_dir)
    version = reg.get_version(version_id)
    data = None
    if test_data and version is not None:  # an unknown version is reported by export_version
        classes, size, channels = input_of(version)
        data = load_image_folder(test_data, size, classes, channels, bit_depth=bit_depth)[0]
    try:
        report = export_version(reg, version_id, out_dir, quantize=quantize, test_data=data)
    except (KeyError, PermissionError) as exc:
        raise click.ClickException(str(exc)) from None
    for f in report.files:
        click.echo(f"wrote {f}")
    for s in report.skipped:
        click.echo(f"skipped {s}")
    if report.accuracy is not None:
        click.echo(f"accuracy {report.accuracy:.4f}" + (f", int8 {report.quantized_accuracy:.4f} (delta {report.accuracy_delta:+.4f})"
                                                        if report.quantized_accuracy is not None else ""))
