"""``fedforge.v1.ModelRegistry`` over gRPC: how edge nodes list, download and follow model versions.

Only factories may ask: every call carries the registry token (``authorization: Bearer``), checked in
constant time before any handler runs, and off loopback the service speaks only TLS.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from common.grpc_auth import TokenAuth, host_of, is_loopback
from common.rpc.fedforge.v1 import registry_pb2, registry_pb2_grpc
from server.registry.schema import Version
from server.registry.service import Registry

log = logging.getLogger("fedforge.registry")

VERSION_ID = re.compile(r"^[0-9a-f]{32}$")
DEFAULT_CHUNK = 1 << 20
MAX_CHUNK = 4 << 20
MAX_REQUEST_BYTES = 64 << 10  # requests are tiny; anything bigger is refused by gRPC itself
WATCH_POLL_SECONDS = 0.5


def info(v: Version) -> registry_pb2.VersionInfo:
    return registry_pb2.VersionInfo(
        id=v.id, run_id=v.run_id, server_round=v.server_round, parent_id=v.parent_id or "", kind=v.kind, architecture=v.architecture,
        status=v.status, sha256=v.sha256, size_bytes=v.size_bytes, created_at=v.created_at.isoformat(), secure_aggregation=v.secure_aggregation,
    )


class ModelRegistryServicer(registry_pb2_grpc.ModelRegistryServicer):
    def __init__(self, registry: Registry, stop: threading.Event | None = None) -> None:
        self.registry = registry
        self.stop = stop or threading.Event()

    def ListVersions(self, request: Any, context: grpc.ServicerContext) -> registry_pb2.ListVersionsReply:
        if request.status and request.status not in ("candidate", "approved", "revoked"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown status {request.status!r}")
        versions = self.registry.versions(status=request.status or None, architecture=request.architecture or None)
        return registry_pb2.ListVersionsReply(versions=[info(v) for v in versions])

    def GetVersion(self, request: Any, context: grpc.ServicerContext):  # type: ignore[no-untyped-def]
        if not VERSION_ID.match(request.id):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "version id must be 32 lowercase hex characters")
        version = self.registry.get_version(request.id)
        if version is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no version {request.id}")
        if version.status == "revoked":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"version {request.id} is revoked")
        if not version.signature:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"version {request.id} is unsigned and cannot be distributed")
        if request.offset < 0 or request.offset > version.size_bytes:
            context.abort(grpc.StatusCode.OUT_OF_RANGE, f"offset {request.offset} outside 0..{version.size_bytes}")
        chunk = min(MAX_CHUNK, request.chunk_size or DEFAULT_CHUNK)
        if chunk <= 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "chunk_size must be positive")
        path = self.registry.artifacts.path_for(version.sha256)
        yield registry_pb2.VersionChunk(manifest=version.manifest.encode(), signature=version.signature, total_size=version.size_bytes,
                                        offset=request.offset)
        with open(path, "rb") as f:  # streamed from disk: memory stays at one chunk whatever the model size
            f.seek(request.offset)
            offset = request.offset
            while data := f.read(chunk):
                yield registry_pb2.VersionChunk(offset=offset, data=data)
                offset += len(data)

    def WatchApproved(self, request: Any, context: grpc.ServicerContext):  # type: ignore[no-untyped-def]
        after = max(0, request.after_action)  # 0: the whole history, so a follower can rebuild the current state
        while context.is_active() and not self.stop.is_set():
            for action in self.registry.actions(after_id=after):
                after = action.id
                v = self.registry.get_version(action.version_id)
                if v is None or (request.architecture and v.architecture != request.architecture):
                    continue
                yield registry_pb2.ApprovalEvent(action_id=action.id, version_id=v.id, action=action.action, status=v.status,
                                                 architecture=v.architecture, at=action.at.isoformat(), release=action.release or 0,
                                                 statement=action.statement.encode(), signature=action.signature)
            time.sleep(WATCH_POLL_SECONDS)


def registry_token(path: Path) -> str:
    """The federation's registry token in ``path`` (created once, mode 0600): factories present it on every call."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it first
            return path.read_text().strip()
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"{path} is empty: delete it to make a new registry token, then give the new one to the factories")
    return token


def serve_registry(registry: Registry, address: str, token: str, credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.Server, threading.Event]:
    """Serve the registry on ``address`` for callers holding ``token``; plaintext only on loopback."""
    if credentials is None and not is_loopback(host_of(address)):
        raise ValueError(f"the model registry on {address} faces the network: serve it with TLS (fedforge server --tls --certs-dir DIR) "
                         "or listen on 127.0.0.1")
    stop = threading.Event()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), interceptors=[TokenAuth(token, "model registry", "--registry-token or FEDFORGE_REGISTRY_TOKEN")],
                         options=[("grpc.max_receive_message_length", MAX_REQUEST_BYTES)])
    registry_pb2_grpc.add_ModelRegistryServicer_to_server(ModelRegistryServicer(registry, stop), server)
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"model registry could not listen on {address}")
    server.start()
    log.info("model registry serving on %s (%s, token required)", address, "TLS" if credentials else "plaintext on loopback")
    return server, stop
