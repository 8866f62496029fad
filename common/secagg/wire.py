"""SecAgg payloads as plain dicts (int, float, str, bytes, list[int], list[bytes]).

The same dict travels as a Flower ConfigRecord between server and factory, and as a map of
`Value` messages over the agent's local gRPC channel; these helpers convert between them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from common.rpc.fedforge.v1 import edge_pb2


def to_values(fields: Mapping[str, Any]) -> dict[str, edge_pb2.Value]:
    out = {}
    for key, v in fields.items():
        if isinstance(v, (bool, int)):
            out[key] = edge_pb2.Value(int=int(v))
        elif isinstance(v, float):
            out[key] = edge_pb2.Value(real=v)
        elif isinstance(v, bytes):
            out[key] = edge_pb2.Value(data=v)
        elif isinstance(v, str):
            out[key] = edge_pb2.Value(text=v)
        elif isinstance(v, list) and all(isinstance(x, int) for x in v):
            out[key] = edge_pb2.Value(ints=edge_pb2.IntList(values=v))
        elif isinstance(v, list) and all(isinstance(x, bytes) for x in v):
            out[key] = edge_pb2.Value(blobs=edge_pb2.BytesList(values=v))
        else:
            raise TypeError(f"secagg field {key!r} has unsupported type {type(v).__name__}")
    return out


def from_values(values: Mapping[str, edge_pb2.Value]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, v in values.items():
        kind = v.WhichOneof("kind")
        if kind in ("ints", "blobs"):
            out[key] = list(getattr(v, kind).values)
        elif kind is not None:
            out[key] = getattr(v, kind)
    return out
