"""What FedForge's gRPC services need to face a network: a bearer-token check and the loopback test.

The central site's ModelRegistry and a factory's Inspection service both refuse every call without
``authorization: Bearer <token>`` before any handler runs, and speak TLS off loopback; both use these.
"""

from __future__ import annotations

import hmac
from typing import Any

import grpc


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1", "[::1]") or host.startswith("127.")


def host_of(address: str) -> str:
    """The host part of ``host:port`` (``[::1]:50062`` -> ``::1``); a ``unix:`` address has none (empty)."""
    if address.startswith("unix:"):
        return ""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]")


def faces_network(address: str) -> bool:
    """Whether a server listening on ``address`` can be reached from other hosts (not loopback, not a Unix socket)."""
    return not address.startswith("unix:") and not is_loopback(host_of(address))


class TokenAuth(grpc.ServerInterceptor):
    """Refuse every call without ``authorization: Bearer <token>`` (UNAUTHENTICATED), in constant time, before its handler runs."""

    def __init__(self, token: str, service: str, option: str) -> None:
        if not token:
            raise ValueError(f"the {service} requires a client token ({option})")
        self.expected = f"Bearer {token}".encode()
        self.refusal = f"the {service} requires its token ('authorization: Bearer <token>')"

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        supplied = dict(details.invocation_metadata or ()).get("authorization", "")
        handler = continuation(details)
        if handler is None or hmac.compare_digest(str(supplied).encode(), self.expected):
            return handler

        def deny(_request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, self.refusal)

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)
