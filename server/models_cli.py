"""``fedforge keys`` and ``fedforge models``: the central site's signing key and model versions."""

from __future__ import annotations

import getpass
import json
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from common.signing import create_keypair, key_id, load_public
from server.registry.service import Registry, TransitionError

console = Console()


@click.group()
def keys() -> None:
    """Create and show the central site's Ed25519 signing key."""


@keys.command("create")
@click.option("--registry-dir", default="fedforge-central/registry", type=click.Path(file_okay=False), help="Registry directory.")
def keys_create(registry_dir: str) -> None:
    """Create <registry-dir>/keys/signing.key (0600) and signing.pub; never overwrites."""
    try:
        key_path, pub_path = create_keypair(Path(registry_dir) / "keys")
    except FileExistsError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"private key {key_path}\npublic key  {pub_path}  (copy it to every factory: --registry-public-key)")
    click.echo(f"key id      {key_id(load_public(pub_path))}")


@keys.command("show")
@click.option("--registry-dir", default="fedforge-central/registry", type=click.Path(file_okay=False), help="Registry directory.")
def keys_show(registry_dir: str) -> None:
    """Print the public key and its id."""
    pub = Path(registry_dir) / "keys" / "signing.pub"
    if not pub.exists():
        raise click.ClickException(f"no signing key in {pub.parent}; run `fedforge keys create --registry-dir {registry_dir}`")
    click.echo(pub.read_text().strip())
    click.echo(f"key id {key_id(load_public(pub))}")


def _registry(registry_dir: str) -> Registry:
    if not (Path(registry_dir) / "registry.db").exists():
        raise click.ClickException(f"no registry at {registry_dir}")
    return Registry.at(registry_dir)


@click.command("ls")
@click.option("--registry-dir", default=None, type=click.Path(file_okay=False), help="Read a local registry directly.")
@click.option("--registry", "address", default=None, help="Or ask a ModelRegistry gRPC service (host:port).")
@click.option("--status", default="", type=click.Choice(["", "candidate", "approved", "revoked"]), help="Filter by status.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def models_ls(registry_dir: str | None, address: str | None, status: str, as_json: bool) -> None:
    """List model versions, oldest first."""
    if address:
        import grpc

        from common.rpc.fedforge.v1 import registry_pb2, registry_pb2_grpc

        with grpc.insecure_channel(address) as channel:
            rows = [
                {"id": v.id, "round": v.server_round, "kind": v.kind, "architecture": v.architecture, "status": v.status,
                 "secure": v.secure_aggregation, "created": v.created_at}
                for v in registry_pb2_grpc.ModelRegistryStub(channel).ListVersions(registry_pb2.ListVersionsRequest(status=status)).versions
            ]
    else:
        reg = _registry(registry_dir or "fedforge-central/registry")
        rows = [
            {"id": v.id, "round": v.server_round, "kind": v.kind, "architecture": v.architecture, "status": v.status,
             "secure": v.secure_aggregation, "created": v.created_at.isoformat(), "accuracy": v.metrics.get("accuracy")}
            for v in reg.versions(status=status or None)
        ]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table()
    for col in ("id", "round", "kind", "architecture", "status", "secure", "accuracy"):
        table.add_column(col)
    for r in rows:
        acc = r.get("accuracy")
        table.add_row(r["id"], str(r["round"]), r["kind"], r["architecture"], r["status"], "yes" if r["secure"] else "no",
                      f"{acc:.4f}" if isinstance(acc, float) else "-")
    console.print(table)


def _change(registry_dir: str, version_id: str, actor: str | None, note: str, op: str) -> None:
    reg = _registry(registry_dir)
    try:
        v = getattr(reg, op)(version_id, actor=actor or getpass.getuser(), note=note)
    except KeyError as exc:
        raise click.ClickException(str(exc)) from None
    except TransitionError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{v.id} is now {v.status}")


for _op, _help in (("approve", "Approve a version for the factories' inspection lines."),
                   ("revoke", "Revoke a version: edge nodes stop serving it."),
                   ("rollback", "Approve an older version again (it becomes the current one).")):
    def _make(op: str = _op, help_text: str = _help):  # type: ignore[no-untyped-def]
        @click.command(op, help=help_text)
        @click.argument("version_id")
        @click.option("--registry-dir", default="fedforge-central/registry", type=click.Path(file_okay=False))
        @click.option("--actor", default=None, help="Who does this (default: the OS user).")
        @click.option("--note", default="", help="Why.")
        def command(version_id: str, registry_dir: str, actor: str | None, note: str) -> None:
            _change(registry_dir, version_id, actor, note, op)
        return command
    globals()[f"models_{_op}"] = _make()




@click.command("export")
@click.argument("version_id")
@click.option("--registry-dir", default="fedforge-central/registry", type=click.Path(file_okay=False))
@click.option("--out", "out_dir", default="fedforge-export", type=click.Path(file_okay=False), help="Where the exported files go.")
@click.option("--quantize/--no-quantize", default=False, help="Dynamic int8 quantization of linear layers.")
@click.option("--test-data", default=None, type=click.Path(file_okay=False, exists=True), help="Image folder for the accuracy check.")
def models_export(version_id: str, registry_dir: str, out_dir: str, quantize: bool, test_data: str | None) -> None:
    """Export an approved version (TorchScript, ONNX when installed), reporting the accuracy delta."""
    from common.data.folder import load_image_folder
    from server.export import export_version

    data = load_image_folder(test_data)[0] if test_data else None
    try:
        report = export_version(_registry(registry_dir), version_id, out_dir, quantize=quantize, test_data=data)
    except (KeyError, PermissionError) as exc:
        raise click.ClickException(str(exc)) from None
    for f in report.files:
        click.echo(f"wrote {f}")
    for s in report.skipped:
        click.echo(f"skipped {s}")
    click.echo(f"accuracy {report.accuracy:.4f}" + (f", int8 {report.quantized_accuracy:.4f} (delta {report.accuracy_delta:+.4f})"
                                                    if report.quantized_accuracy is not None else ""))
