"""``fedforge models pull|verify``: the edge side of model distribution (pinned key, verified before kept)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from client.models import ModelClient
from common.signing import VerificationError, load_public, verify_manifest, verify_weights


@click.command("pull")
@click.argument("version_id")
@click.option("--registry", "address", required=True, help="ModelRegistry gRPC address (host:port).")
@click.option("--public-key", required=True, type=click.Path(dir_okay=False, exists=True), help="The central site's pinned signing.pub.")
@click.option("--registry-token", required=True, envvar="FEDFORGE_REGISTRY_TOKEN", help="The registry's client token.")
@click.option("--cache-dir", default="fedforge-factory/models", type=click.Path(file_okay=False))
def models_pull(version_id: str, address: str, public_key: str, registry_token: str, cache_dir: str) -> None:
    """Download a version and verify its signature and sha256 before keeping it."""
    import grpc

    client = ModelClient(address, load_public(public_key), cache_dir, token=registry_token)
    try:
        model = client.pull(version_id)
    except VerificationError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    except grpc.RpcError as exc:
        raise click.ClickException(f"registry {address}: {exc.code().name}: {exc.details()}") from None
    click.echo(f"verified {model.version_id} ({model.manifest['architecture']}, round {model.manifest['round']}) -> {model.weights_path}")


@click.command("verify")
@click.argument("version_id")
@click.option("--public-key", required=True, type=click.Path(dir_okay=False, exists=True), help="The central site's pinned signing.pub.")
@click.option("--cache-dir", default="fedforge-factory/models", type=click.Path(file_okay=False))
def models_verify(version_id: str, public_key: str, cache_dir: str) -> None:
    """Re-verify a pulled version on disk."""
    saved = Path(cache_dir) / f"{version_id}.manifest.json"
    if not saved.exists():
        raise click.ClickException(f"{version_id} has not been pulled into {cache_dir}")
    envelope = json.loads(saved.read_text())
    try:
        manifest = verify_manifest(envelope["manifest"].encode(), envelope["signature"], load_public(public_key))
        verify_weights(Path(cache_dir) / f"{version_id}.npz", manifest)
    except VerificationError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    click.echo(f"{version_id}: signature and sha256 verified")
