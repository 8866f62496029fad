"""Named numpy arrays <-> the `Tensor` messages of protos/, with the checks every hop needs.

No torch here: the thin ClientApp uses this module and must start fast.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

import numpy as np

from common.rpc.fedforge.v1 import edge_pb2

ALLOWED_DTYPES = frozenset({"float32", "float64", "float16", "int64", "int32", "uint8", "uint32", "uint64", "bool"})


class UpdateError(ValueError):
    """A model or update is malformed: wrong names, shapes or dtypes, or non-finite values."""


def to_tensor(name: str, array: np.ndarray) -> edge_pb2.Tensor:
    array = np.asarray(array, order="C")  # np.ascontiguousarray would turn a 0-d array into shape (1,)
    if array.dtype.name not in ALLOWED_DTYPES:
        raise UpdateError(f"array {name!r} has unsupported dtype {array.dtype}")
    return edge_pb2.Tensor(name=name, shape=list(array.shape), dtype=array.dtype.name, data=array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())


def from_tensor(tensor: edge_pb2.Tensor) -> np.ndarray:
    if tensor.dtype not in ALLOWED_DTYPES:
        raise UpdateError(f"tensor {tensor.name!r} has unsupported dtype {tensor.dtype!r}")
    dtype = np.dtype(tensor.dtype).newbyteorder("<")
    shape = tuple(int(s) for s in tensor.shape)
    if any(s < 0 for s in shape):
        raise UpdateError(f"tensor {tensor.name!r} has a negative dimension in shape {shape}")
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(tensor.data) != expected:
        raise UpdateError(f"tensor {tensor.name!r}: {len(tensor.data)} bytes for shape {shape} of {tensor.dtype} (expected {expected})")
    return np.frombuffer(tensor.data, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="), copy=True)


def to_tensors(arrays: Mapping[str, np.ndarray]) -> list[edge_pb2.Tensor]:
    return [to_tensor(name, arr) for name, arr in arrays.items()]


def from_tensors(tensors: Iterable[edge_pb2.Tensor]) -> OrderedDict[str, np.ndarray]:
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    for t in tensors:
        if t.name in out:
            raise UpdateError(f"tensor {t.name!r} appears twice")
        out[t.name] = from_tensor(t)
    return out


def check_like(reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray], source: str) -> None:
    """Raise `UpdateError` naming ``source`` unless ``candidate`` matches ``reference`` and is finite."""
    missing = [k for k in reference if k not in candidate]
    extra = [k for k in candidate if k not in reference]
    if missing or extra:
        raise UpdateError(f"{source}: parameter names differ from the global model (missing {missing[:3]}, unexpected {extra[:3]})")
    for name, ref in reference.items():
        arr = candidate[name]
        if arr.shape != ref.shape:
            raise UpdateError(f"{source}: parameter {name!r} has shape {arr.shape}, expected {ref.shape}")
        if np.issubdtype(arr.dtype, np.floating) and not np.isfinite(arr).all():
            raise UpdateError(f"{source}: parameter {name!r} contains NaN or Inf")
