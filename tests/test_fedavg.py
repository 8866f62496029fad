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


def _message_objects(record) -> int:
    """How many content objects Flower moves, one request per hop each, for a train message's content holding ``record``."""
    from flwr.app import ConfigRecord, RecordDict
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return len(get_all_nested_objects(RecordDict({"arrays": record, "config": ConfigRecord({"server-round": 1})})))


def test_weights_travel_in_one_flower_array_whatever_the_number_of_tensors():
    """The packed record round-trips names, dtypes and values; its object count does not grow with the tensors
    (one Array per tensor costs about two objects each, every one its own request at every hop)."""
    from flwr.app import Array, ArrayRecord

    from common.wire import weights_of_record, weights_record

    arrays = OrderedDict((f"layer{i}.weight", np.full((i + 1, 3), i, np.float32)) for i in range(22))
    arrays["bn.num_batches_tracked"] = np.array(7, np.int64)
    back = weights_of_record(weights_record(arrays), "test")
    assert list(back) == list(arrays)
    assert all(np.array_equal(arrays[k], back[k]) and arrays[k].dtype == back[k].dtype and arrays[k].shape == back[k].shape for k in arrays)
    per_tensor = ArrayRecord(OrderedDict((k, Array(v)) for k, v in arrays.items()))
    assert _message_objects(weights_record(arrays)) <= 6 < 2 * len(arrays) <= _message_objects(per_tensor)
    assert _message_objects(weights_record(arrays)) == _message_objects(weights_record(OrderedDict(list(arrays.items())[:2])))


def test_a_malformed_weights_record_is_refused_naming_its_source():
    from flwr.app import Array, ArrayRecord

    from common.wire import WEIGHTS_KEY, record_of_tensors, weights_of_record, weights_record

    good = weights_record(OrderedDict(a=np.ones((2, 3), np.float32)))
    blob = good[WEIGHTS_KEY].numpy()
    cases = {
        "per-tensor arrays": (ArrayRecord(OrderedDict(a=Array(np.ones((2, 3), np.float32)))), "one FedForge version at both ends"),
        "an extra array": (ArrayRecord(OrderedDict({WEIGHTS_KEY: Array(blob), "x": Array(blob)})), "expected one array"),
        "float bytes": (ArrayRecord(OrderedDict({WEIGHTS_KEY: Array(blob.astype(np.float32))})), "1-d uint8"),
        "a truncated blob": (ArrayRecord(OrderedDict({WEIGHTS_KEY: Array(blob[:-5].copy())})), "factory f"),
        "random bytes": (ArrayRecord(OrderedDict({WEIGHTS_KEY: Array(np.frombuffer(b"\xff" * 40, np.uint8))})), "not a serialised TensorList"),
    }
    for case, (record, match) in cases.items():
        with pytest.raises(UpdateError, match=match) as err:
            weights_of_record(record, "factory f")
        assert str(err.value).startswith("factory f"), case
    twice = to_tensors(OrderedDict(a=np.ones(2, np.float32)))
    with pytest.raises(UpdateError, match="factory f: tensor 'a' appears twice"):
        weights_of_record(record_of_tensors(twice + twice), "factory f")


def test_a_lost_superlink_interrupts_the_run_and_a_fedforge_error_fails_it():
    """The supervisor resumes interrupted runs; a run is 'failed' only for FedForge's own errors."""
    import httpx

    from server.federation import ending_for

    request = httpx.Request("POST", "http://127.0.0.1:1/v1/runtime/pull-messages")
    assert ending_for(httpx.ConnectError("connection refused", request=request)) == "interrupted"
    assert ending_for(httpx.HTTPStatusError("403", request=request, response=httpx.Response(403, request=request))) == "interrupted"
    assert ending_for(KeyboardInterrupt()) == "interrupted"
    assert ending_for(ValueError("cannot resume from 'v9'")) == "failed"
