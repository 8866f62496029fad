from collections import OrderedDict

import numpy as np
import pytest

from common.tensors import UpdateError, from_tensors, to_tensor, to_tensors
from server.aggregate import FactoryUpdate, fedavg, validate_update

GLOBAL = OrderedDict(w=np.zeros((2, 3), np.float32), b=np.zeros(3, np.float32))


def _update(fid, value, n, **override):
    weights = OrderedDict((k, np.full_like(v, value)) for k, v in GLOBAL.items())
    weights.update(override)
    return FactoryUpdate(fid, 1, weights, n)


def test_fedavg_weights_by_examples():
    out = fedavg([_update("a", 1.0, 100), _update("b", 4.0, 300)], like=GLOBAL)
    assert np.allclose(out["w"], 3.25) and out["w"].dtype == np.float32


def test_single_update_is_returned_unchanged():
    u = _update("a", 2.5, 10)
    assert np.array_equal(fedavg([u], like=GLOBAL)["b"], u.weights["b"])


@pytest.mark.parametrize(
    "override, match",
    [
        ({"w": np.zeros((3, 2), np.float32)}, "shape"),
        ({"w": np.full((2, 3), np.nan, np.float32)}, "NaN or Inf"),
        ({"b": np.array([0, np.inf, 0], np.float32)}, "NaN or Inf"),
        ({"extra": np.zeros(1, np.float32)}, "unexpected"),
    ],
)
def test_malformed_updates_are_rejected_naming_the_factory(override, match):
    with pytest.raises(UpdateError, match=match) as err:
        validate_update(GLOBAL, _update("factory-x", 1.0, 10, **override))
    assert "factory-x" in str(err.value)


def test_missing_parameter_and_zero_examples():
    u = _update("f", 1.0, 10)
    del u.weights["b"]
    with pytest.raises(UpdateError, match="missing"):
        validate_update(GLOBAL, u)
    with pytest.raises(UpdateError, match="examples"):
        validate_update(GLOBAL, _update("f", 1.0, 0))


def test_tensor_roundtrip_and_corrupt_bytes():
    arrays = OrderedDict(a=np.arange(6, dtype=np.float32).reshape(2, 3), b=np.array([1, 2], np.int64))
    back = from_tensors(to_tensors(arrays))
    assert all(np.array_equal(arrays[k], back[k]) and arrays[k].dtype == back[k].dtype for k in arrays)
    t = to_tensor("a", arrays["a"])
    t.data = t.data[:-4]
    with pytest.raises(UpdateError, match="bytes for shape"):
        from_tensors([t])
    t = to_tensor("a", arrays["a"])
    t.dtype = "object"
    with pytest.raises(UpdateError, match="dtype"):
        from_tensors([t])


def test_a_lost_superlink_interrupts_the_run_and_a_fedforge_error_fails_it():
    """The supervisor resumes interrupted runs; a run is 'failed' only for FedForge's own errors."""
    import httpx

    from server.federation import ending_for

    request = httpx.Request("POST", "http://127.0.0.1:1/v1/runtime/pull-messages")
    assert ending_for(httpx.ConnectError("connection refused", request=request)) == "interrupted"
    assert ending_for(httpx.HTTPStatusError("403", request=request, response=httpx.Response(403, request=request))) == "interrupted"
    assert ending_for(KeyboardInterrupt()) == "interrupted"
    assert ending_for(ValueError("cannot resume from 'v9'")) == "failed"
