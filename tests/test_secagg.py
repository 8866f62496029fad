"""SecAgg+ protocol: correctness, dropouts at every stage, tampering, replays, and what the server sees."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client.secagg import SecAggClient, SecAggProtocolError, SecAggSessions
from common.secagg import quantize
from common.secagg.primitives import expand_mask, recover_secret, session_id, share_secret
from server.secure_sum import SecAggAborted, SecureSum, neighbour_graph

TERMS = hashlib.sha256(b"the round's terms, as the server sent them").digest()


def run_protocol(inputs: dict[int, np.ndarray], threshold: int, degree: int | None = None, drop_after: dict[str, set[int]] | None = None,
                 tamper: set[tuple[int, int]] = frozenset(), session: bytes = b"run|1|fedavg", terms_of: dict[int, bytes] | None = None,
                 server_terms: bytes = TERMS):
    """Run all four stages in-process; ``drop_after[stage]`` lists slots that vanish after that stage; ``terms_of[u]``: the round
    terms slot u received (default: what the server sent, ``server_terms``)."""
    drop_after = {k: set(v) for k, v in (drop_after or {}).items()}
    slots = sorted(inputs)
    server = SecureSum(session, slots, threshold, degree if degree is not None else len(slots) - 1)
    clients = {u: SecAggClient(session, u, threshold) for u in slots}
    alive = set(slots) - drop_after.get("start", set())

    plan = server.add_public_keys({u: clients[u].advertise() for u in alive})
    alive -= drop_after.get("advertise", set())  # advertised keys, then vanished: never shares
    sent = {u: clients[u].share_keys(*plan[u]) for u in alive}
    for (sender, receiver) in tamper:
        box = bytearray(sent[sender][receiver])
        box[-1] ^= 1
        sent[sender][receiver] = bytes(box)
    routed = server.add_share_boxes(sent)
    alive -= drop_after.get("share", set())  # shared keys, then vanished: its masks must be removed
    for u in sorted(alive):
        clients[u].receive_boxes(routed[u])
        server.add_masked_input(u, clients[u].mask(quantize.encode(inputs[u]), server.u2, (terms_of or {}).get(u, server_terms)))
    alive -= drop_after.get("input", set())  # sent its masked input, then vanished: still in the sum
    survivors, dropped = server.unmask_request()
    answers = {u: clients[u].unmask(survivors, dropped) for u in alive}
    return quantize.decode(server.result(answers, server_terms)), survivors, clients, server


@settings(max_examples=12, deadline=None)
@given(n=st.integers(3, 7), length=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_sum_equals_plain_sum_within_quantization(n, length, seed):
    rng = np.random.default_rng(seed)
    inputs = {u: rng.normal(0, 3, size=length) for u in range(1, n + 1)}
    total, survivors, _, _ = run_protocol(inputs, threshold=n // 2 + 1)
    assert survivors == list(range(1, n + 1))
    np.testing.assert_allclose(total, sum(inputs.values()), atol=quantize.error_bound(n))


def test_sparse_graph_sum_is_exact():
    rng = np.random.default_rng(1)
    inputs = {u: rng.normal(size=50) for u in range(1, 11)}
    total, _, _, server = run_protocol(inputs, threshold=3, degree=4)  # neighbourhoods of 5: 3 > 5/2
    assert all(len(v) == 4 for v in server.graph.values())
    np.testing.assert_allclose(total, sum(inputs.values()), atol=quantize.error_bound(10))


@pytest.mark.parametrize("stage", ["advertise", "share", "input"])
def test_dropout_at_each_stage_sums_the_survivors(stage):
    rng = np.random.default_rng(2)
    inputs = {u: rng.normal(size=64) for u in range(1, 8)}
    total, survivors, _, _ = run_protocol(inputs, threshold=4, drop_after={stage: {2, 5}})
    expected_contributors = [u for u in inputs if stage == "input" or u not in {2, 5}]
    assert survivors == expected_contributors
    np.testing.assert_allclose(total, sum(inputs[u] for u in expected_contributors), atol=quantize.error_bound(7))


def test_dropout_during_unmasking_above_threshold_still_completes():
    rng = np.random.default_rng(3)
    inputs = {u: rng.normal(size=16) for u in range(1, 6)}
    # slot 4 sends its masked input but does not answer the unmask request
    session = b"r|1|fedavg"
    slots = sorted(inputs)
    server = SecureSum(session, slots, 3, 4)
    clients = {u: SecAggClient(session, u, 3) for u in slots}
    plan = server.add_public_keys({u: clients[u].advertise() for u in slots})
    routed = server.add_share_boxes({u: clients[u].share_keys(*plan[u]) for u in slots})
    for u in slots:
        clients[u].receive_boxes(routed[u])
        server.add_masked_input(u, clients[u].mask(quantize.encode(inputs[u]), server.u2, TERMS))
    survivors, dropped = server.unmask_request()
    answers = {u: clients[u].unmask(survivors, dropped) for u in slots if u != 4}
    np.testing.assert_allclose(quantize.decode(server.result(answers, TERMS)), sum(inputs.values()), atol=quantize.error_bound(5))


@pytest.mark.parametrize("stage", ["start", "advertise", "share", "input"])
def test_below_threshold_aborts_cleanly(stage):
    inputs = {u: np.ones(8) for u in range(1, 6)}
    with pytest.raises((SecAggAborted, SecAggProtocolError), match="threshold"):
        run_protocol(inputs, threshold=4, drop_after={stage: {1, 2}})


def test_tampered_box_is_rejected_and_counted_as_a_pair_dropout():
    rng = np.random.default_rng(4)
    inputs = {u: rng.normal(size=32) for u in range(1, 6)}
    total, _, clients, _ = run_protocol(inputs, threshold=3, tamper={(2, 3)})  # 3 > 5/2
    assert 2 in clients[3].rejected and 2 not in clients[3].received  # no crash; that share is simply missing
    np.testing.assert_allclose(total, sum(inputs.values()), atol=quantize.error_bound(5))


def _trio(session: bytes):
    clients = {i: SecAggClient(session, i, 2) for i in (1, 2, 3)}  # 2 > 3/2
    boxes = {}
    for i, c in clients.items():
        others = [j for j in clients if j != i]
        boxes[i] = c.share_keys(others, [clients[j].advertise().enc_pk for j in others], [clients[j].advertise().mask_pk for j in others])
    return clients, boxes


def test_replayed_or_redirected_box_is_rejected():
    round1, boxes1 = _trio(session_id("run-a", 1))
    round2, _ = _trio(session_id("run-a", 2))
    round2[2].receive_boxes({1: boxes1[1][2]})  # a round-1 box replayed into round 2
    assert 1 in round2[2].rejected and 1 not in round2[2].received
    round1[3].receive_boxes({1: boxes1[1][2]})  # the box for slot 2 redirected to slot 3
    assert 1 in round1[3].rejected
    round1[2].receive_boxes({1: boxes1[1][2]})  # delivered as addressed
    assert 1 in round1[2].received and not round1[2].rejected


def test_client_refuses_to_reveal_both_secrets_of_one_factory():
    client = SecAggClient(b"s", 1, 2)
    client.share_keys([2, 3], [SecAggClient(b"s", 2, 2).advertise().enc_pk] * 2, [SecAggClient(b"s", 3, 2).advertise().mask_pk] * 2)
    client.mask(np.zeros(4, np.uint64), [1, 2, 3], TERMS)
    with pytest.raises(SecAggProtocolError, match="both"):
        client.unmask([1, 2], [2])
    client.unmask([1, 2, 3], [])
    with pytest.raises(SecAggProtocolError, match="already answered"):
        client.unmask([1, 2, 3], [])


def test_replayed_session_setup_is_refused():
    sessions = SecAggSessions()
    sessions.start(b"run|1|fedavg", 1, 2)
    with pytest.raises(SecAggProtocolError, match="replayed"):
        sessions.start(b"run|1|fedavg", 1, 2)
    with pytest.raises(SecAggProtocolError, match="unknown"):
        sessions.get(b"run|2|fedavg")


def test_a_single_masked_vector_looks_uniform():
    """What the server holds per factory: a masked vector, indistinguishable from uniform in Z_2^64."""
    inputs = {u: np.full(20000, 7.0) for u in (1, 2, 3)}  # highly structured inputs
    session = b"u|1|fedavg"
    server = SecureSum(session, [1, 2, 3], 2, 2)
    clients = {u: SecAggClient(session, u, 2) for u in inputs}
    plan = server.add_public_keys({u: clients[u].advertise() for u in inputs})
    routed = server.add_share_boxes({u: clients[u].share_keys(*plan[u]) for u in inputs})
    clients[1].receive_boxes(routed[1])
    masked = clients[1].mask(quantize.encode(inputs[1]), server.u2, TERMS)
    # chi-square over the 256 values of every byte of the masked words
    counts = np.bincount(masked.view(np.uint8), minlength=256)
    expected = len(masked) * 8 / 256
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 340  # 255 dof: p ~ 0.0003 threshold
    # and each bit is set about half the time
    bits = np.unpackbits(masked.view(np.uint8)).mean()
    assert abs(bits - 0.5) < 0.005


def test_mask_expansion_is_deterministic_and_keyed():
    key = bytes(range(32))
    a, b = expand_mask(key, 1000), expand_mask(key, 1000)
    assert np.array_equal(a, b) and a.dtype == np.uint64
    assert not np.array_equal(a, expand_mask(bytes(32), 1000))


def test_shamir_known_vectors_and_threshold():
    secret = bytes(range(32))
    shares = share_secret(secret, 3, 5)
    assert [i for i, _ in shares] == [1, 2, 3, 4, 5]
    assert recover_secret(shares[:3]) == secret and recover_secret(shares[2:]) == secret
    with pytest.raises(ValueError, match="32-byte secret"):  # below the threshold: not the secret (here: not even 32 bytes)
        recover_secret(shares[:2])


@settings(max_examples=25, deadline=None)
@given(secret=st.binary(min_size=32, max_size=32), holders=st.integers(1, 40), data=st.data())
def test_any_threshold_shares_recover_the_secret_and_fewer_or_tampered_do_not(secret, holders, data):
    threshold = data.draw(st.integers(1, holders))
    shares = share_secret(secret, threshold, holders)
    assert all(len(share) == 66 for _, share in shares)
    subset = data.draw(st.lists(st.sampled_from(shares), min_size=threshold, max_size=holders, unique=True))
    assert recover_secret(subset) == secret
    tampered = [(subset[0][0], bytes([subset[0][1][0] ^ 1]) + subset[0][1][1:]), *subset[1:]]
    try:  # a changed share never gives the secret back (callers also check recovered secrets against what was advertised)
        assert recover_secret(tampered[:threshold]) != secret
    except ValueError:
        pass
    with pytest.raises(ValueError):
        recover_secret([shares[0], shares[0]])  # a repeated index


def test_neighbour_graph_is_regular_and_symmetric():
    g = neighbour_graph(list(range(1, 21)), 6)
    assert all(len(vs) == 6 for vs in g.values())
    assert all(u in g[v] for u, vs in g.items() for v in vs)


def test_quantization_roundtrip_and_clipping():
    x = np.array([1.5, -2.25, 0.0, 1e-7])
    np.testing.assert_allclose(quantize.decode(quantize.encode(x)), x, atol=quantize.error_bound(1))
    clipped, norm = quantize.clip_l2(np.array([3.0, 4.0]), 1.0)
    assert norm == 5.0 and np.isclose(np.linalg.norm(clipped), 1.0)
    with pytest.raises(OverflowError):
        quantize.encode(np.array([np.inf]))


def test_every_stage_message_round_trips_and_a_malformed_field_is_named():
    """One typed schema for the server, the ClientApp and the agent; through the agent's wire encoding and back."""
    from common.secagg.layout import SecureLayout
    from common.secagg.messages import Advertise, Boxes, Keys, MaskedInput, MessageError, Share, Shares, Unmask
    from common.secagg.wire import from_values, to_values

    layout = SecureLayout.of({"cnn-small": 10}, 0, 6, ["cnn-small"], True)
    messages = [Advertise("s", 1, 3), Keys(b"e" * 32, b"m" * 32, b"c" * 32), Share("s", [2, 3], [b"a", b"b"], [b"c", b"d"]),
                Boxes.of({2: b"x", 3: b"y"}), MaskedInput("s", [1, 2, 3], 10.0, 65536.0, 500, [2, 3], [b"x", b"y"], layout),
                Unmask("s", [1, 2], [3]), Shares.of({1: (1, b"s" * 32)}, {3: (1, b"k" * 32)})]
    for message in messages:
        again = type(message).from_fields(from_values(to_values(message.to_fields())))
        assert again == message, type(message).__name__
    with pytest.raises(MessageError, match="secagg unmask: field 'dropped' is missing"):
        Unmask.from_fields({"session": "s", "survivors": [1]})
    with pytest.raises(MessageError, match="secagg share: field 'neighbors' must be ints"):
        Share.from_fields({"session": "s", "neighbors": [b"2"], "enc-pks": [b"a"], "mask-pks": [b"b"]})
    with pytest.raises(MessageError, match="share columns of different lengths"):
        Shares.from_fields({"seed-slots": [1, 2], "seed-index": [1], "seed-shares": [b"s"], "key-slots": [], "key-index": [], "key-shares": []})


def test_masks_cancel_only_between_factories_that_received_the_same_round_terms():
    """A server that sends one factory other terms (say a larger step size, to shrink everyone else's share of the DP noise under
    --dp-secure-sum) gets a sum that is noise; honest terms, and the masks of a factory that dropped, still give the exact sum."""
    from common.secagg.layout import Contribution, SecureLayout, SumNotValid
    from common.secagg.terms import round_terms

    layout = SecureLayout.of({"head": 6}, classes=2, confusion=["head"], metrics=True)
    config = {"secure-sum-lr": 4.0, "public-proxy-sha256": "ab" * 32, "local-epochs": 2}
    honest = round_terms(config, 10.0, quantize.DEFAULT_SCALE, 1000, layout)
    assert honest == round_terms({**config, "local-epochs": 2.0, "architecture": "other", "send-weights": False}, 10, quantize.DEFAULT_SCALE,
                                 1000, layout)  # ints arrive as floats; the per-factory keys do not count
    lying = round_terms({**config, "secure-sum-lr": 400.0}, 10.0, quantize.DEFAULT_SCALE, 1000, layout)
    assert lying != honest and round_terms(config, 1.0, quantize.DEFAULT_SCALE, 1000, layout) != honest

    rng = np.random.default_rng(5)
    like = {"w": np.zeros(6)}
    vectors = {u: layout.encode(Contribution("head", like, {"w": rng.normal(size=6)}, 30 + u, confusion=np.eye(2) * u, confusion_group="head"),
                                10.0, quantize.DEFAULT_SCALE, 1000)[0].view(np.int64).astype(np.float64) / quantize.DEFAULT_SCALE
               for u in range(1, 6)}
    total, *_ = run_protocol(vectors, threshold=4, server_terms=honest, drop_after={"share": {5}})
    expected = sum(v for u, v in vectors.items() if u != 5)
    np.testing.assert_allclose(total, expected, atol=quantize.error_bound(4))
    sums = layout.decode(quantize.encode(total), quantize.DEFAULT_SCALE)
    assert sums.groups["head"][1] == 31 + 32 + 33 + 34

    told_otherwise, *_ = run_protocol(vectors, threshold=4, server_terms=honest, terms_of={2: lying})
    assert not np.allclose(told_otherwise, sum(vectors.values()), atol=1.0)
    with pytest.raises(SumNotValid, match="different round terms"):
        layout.decode(quantize.encode(np.clip(told_otherwise, -2.0**37, 2.0**37)), quantize.DEFAULT_SCALE)
