"""Pulling signed model versions from the central registry onto an edge node, and verifying them.

A download goes to ``<cache>/<id>.part`` and resumes from its current size after a dropped stream;
only when the signature (pinned key) and the sha256 both check out is it renamed to ``<id>.npz``
beside ``<id>.manifest.json``. A version that fails is deleted and never loaded.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from common.rpc.fedforge.v1 import registry_pb2, registry_pb2_grpc
from common.signing import TruncatedDownloadError, VerificationError, verify_manifest, verify_weights

log = logging.getLogger(__name__)


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call on the channel."""

    def __init__(self, token: str) -> None:
        self.metadata = ("authorization", f"Bearer {token}")

    def _with_token(self, details: Any) -> Any:
        return details._replace(metadata=[*(details.metadata or ()), self.metadata])

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)


@dataclass(frozen=True)
class VerifiedModel:
    version_id: str
    manifest: dict[str, Any]
    weights_path: Path


class ModelClient:
    def __init__(self, address: str, pinned_key: Any, cache_dir: str | Path, credentials: grpc.ChannelCredentials | None = None,
                 token: str = "") -> None:
        if not token:
            raise ValueError("the model registry requires its token: --registry-token (or FEDFORGE_REGISTRY_TOKEN), "
                             "from the central site's registry/keys/registry.token")
        self.channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
        self.channel = grpc.intercept_channel(self.channel, _BearerToken(token))
        self.stub = registry_pb2_grpc.ModelRegistryStub(self.channel)
        self.pinned = pinned_key
        self.cache = Path(cache_dir)
        self.cache.mkdir(parents=True, exist_ok=True)

    def list(self, status: str = "", architecture: str = "") -> list[Any]:
        return list(self.stub.ListVersions(registry_pb2.ListVersionsRequest(status=status, architecture=architecture)).versions)

    def pull(self, version_id: str, chunk_size: int = 0, max_resumes: int = 5) -> VerifiedModel:
        """Download (resuming after dropped streams) and verify; raises a `VerificationError` subclass."""
        final = self.cache / f"{version_id}.npz"
        manifest_path = self.cache / f"{version_id}.manifest.json"
        if final.exists() and manifest_path.exists():
            return self.verify(version_id)
        part = self.cache / f"{version_id}.part"
        manifest_bytes, signature, total = b"", "", -1
        for attempt in range(max_resumes + 1):
            offset = part.stat().st_size if part.exists() else 0
            try:
                with open(part, "ab") as out:
                    for chunk in self.stub.GetVersion(registry_pb2.GetVersionRequest(id=version_id, offset=offset, chunk_size=chunk_size)):
                        if chunk.manifest:
                            manifest_bytes, signature, total = chunk.manifest, chunk.signature, chunk.total_size
                        if chunk.data:
                            if chunk.offset != out.tell():
                                raise VerificationError(f"chunk at offset {chunk.offset}, expected {out.tell()}")
                            out.write(chunk.data)
                    out.flush()
                    os.fsync(out.fileno())
                break
            except grpc.RpcError as err:
                if err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                    raise
                log.warning("download of %s interrupted at %d bytes (%s); resuming (%d/%d)", version_id, part.stat().st_size,
                            err.code().name, attempt + 1, max_resumes)
        if total < 0 or not manifest_bytes:
            raise TruncatedDownloadError(f"download of {version_id} never received its manifest")
        try:
            manifest = verify_manifest(manifest_bytes, signature, self.pinned)
            if manifest["id"] != version_id:
                raise VerificationError(f"server sent the manifest of {manifest['id']} for {version_id}")
            verify_weights(part, manifest)
        except VerificationError as exc:
            log.error("model %s refused: %s", version_id, exc)
            if not isinstance(exc, TruncatedDownloadError):
                part.unlink(missing_ok=True)
            raise
        manifest_path.write_text(json.dumps({"manifest": manifest_bytes.decode(), "signature": signature}))
        os.replace(part, final)
        return VerifiedModel(version_id, manifest, final)

    def verify(self, version_id: str) -> VerifiedModel:
        """Re-verify a cached version (signature and sha256) before it is loaded."""
        saved = json.loads((self.cache / f"{version_id}.manifest.json").read_text())
        manifest = verify_manifest(saved["manifest"].encode(), saved["signature"], self.pinned)
        verify_weights(self.cache / f"{version_id}.npz", manifest)
        return VerifiedModel(version_id, manifest, self.cache / f"{version_id}.npz")

    def watch(self, architecture: str = "", after_action: int = 0):  # type: ignore[no-untyped-def]
        return self.stub.WatchApproved(registry_pb2.WatchApprovedRequest(architecture=architecture, after_action=after_action))

    def close(self) -> None:
        self.channel.close()
