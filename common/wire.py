"""A model's weights inside a Flower message: one Flower ``Array`` for the whole model, not one per tensor.

Flower 1.42 moves every ``Array`` of a message as content objects of their own (the array and its
chunks), and every hop (ServerApp -> SuperLink -> SuperNode -> ClientApp, and back) transfers each
object in its own HTTP request, while the next hop backs off on objects that have not arrived yet.
So a message's transfer time grows with its number of tensors, not its bytes: `cnn-small`'s 22
tensors (320 KB) made a train message's content 47 objects (5 now), and a plain round on loopback spent
about 5 s moving its two messages (docs/benchmarks.md, "Federation round overhead").

Here the tensors are serialised as one ``TensorList`` (protos/fedforge/v1/edge.proto) in a single
uint8 ``Array`` under ``WEIGHTS_KEY``: the same ``Tensor`` encoding, and the same checks, as the
factory's channel to its edge agent, which receives these tensors as they are. Flower still cuts an
array above 5 MB into chunks.

No torch here: the thin ClientApp uses this module and must start fast.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord
from google.protobuf.message import DecodeError

from common.rpc.fedforge.v1 import edge_pb2
from common.tensors import UpdateError, from_tensors, to_tensors

WEIGHTS_KEY = "weights"


def record_of_tensors(tensors: Iterable[edge_pb2.Tensor]) -> ArrayRecord:
    """The ``ArrayRecord`` that carries these tensors through Flower."""
    blob = edge_pb2.TensorList(tensors=list(tensors)).SerializeToString()
    return ArrayRecord(OrderedDict({WEIGHTS_KEY: Array(np.frombuffer(blob, dtype=np.uint8))}))


def weights_record(weights: Mapping[str, np.ndarray]) -> ArrayRecord:
    """The ``ArrayRecord`` that carries a model's named arrays through Flower."""
    return record_of_tensors(to_tensors(weights))


def tensors_of_record(record: ArrayRecord, source: str) -> list[edge_pb2.Tensor]:
    """The tensors a `weights_record` holds; raises `UpdateError` naming ``source`` if it is not one."""
    keys = list(record.keys())
    if keys != [WEIGHTS_KEY]:
        hint = "; one array per tensor is how FedForge sent weights before common/wire.py: run one FedForge version at both ends" if (
            keys and WEIGHTS_KEY not in keys) else ""
        raise UpdateError(f"{source}: the weights record holds {keys[:4]}, expected one array {WEIGHTS_KEY!r}{hint}")
    array = record[WEIGHTS_KEY]
    if array.dtype != "uint8" or len(array.shape) != 1:
        raise UpdateError(f"{source}: the weights array is {array.dtype} of shape {tuple(array.shape)}, expected a 1-d uint8 array")
    try:
        message = edge_pb2.TensorList.FromString(array.numpy().tobytes())
    except (DecodeError, ValueError) as exc:
        raise UpdateError(f"{source}: the weights array is not a serialised TensorList ({exc})") from exc
    return list(message.tensors)


def weights_of_record(record: ArrayRecord, source: str) -> OrderedDict[str, np.ndarray]:
    """The named arrays a `weights_record` holds, checked (dtypes, byte counts, unique names)."""
    tensors = tensors_of_record(record, source)
    try:
        return from_tensors(tensors)
    except UpdateError as exc:
        raise UpdateError(f"{source}: {exc}") from exc
