"""Finding 2 (high): the factory defends itself against a curious or malicious server.

Every attack is driven by hand, as a malicious server would, against real edge agents over gRPC on
loopback: the agent enforces its own policy (client/secagg.py, `--require-secure-aggregation`,
`--secagg-min-cohort`, `--secagg-colluders`), whatever the server sends.
"""

from __future__ import annotations

from collections import OrderedDict

import grpc
import numpy as np
import pytest
from google.protobuf import struct_pb2

from client.agent import GRPC_OPTIONS, serve
from client.config import AgentConfig
from client.secagg import SecAggClient
from common.models import build_model, weights_of
from common.procs import free_port
from common.rpc.fedforge.v1 import edge_pb2, edge_pb2_grpc
from common.secagg import quantize
from common.secagg.layout import SecureLayout
from common.secagg.primitives import recover_secret, seed_commitment
from common.secagg.wire import from_values, to_values
from common.tensors import to_tensors
from server.secure_sum import KeyExchange, SecAggAborted, SecureSum
from tests.test_server_rounds import _task_identity  # noqa: F401 - the autouse fixture Flower messages need

ARCH = "cnn-small"
TERMS = bytes(range(32))  # the round's terms, as every factory received them (common.secagg.terms)
CONFIG = {"architecture": ARCH, "local-epochs": 1, "batch-size": 16, "personal-epochs": 0}


class Agents:
    """N real agents and a hand-driven SecAgg server: every request is what the test chooses to send."""

    def __init__(self, tmp_path, n: int, **cfg) -> None:
        cfg = {"require_secure_aggregation": True, **cfg}
        self.agents = [serve(AgentConfig(factory_id=f"f{i}", listen=f"127.0.0.1:{free_port()}", factory_index=i % 3, num_factories=3,
                                         train_size=40, state_dir=str(tmp_path / f"f{i}"), **cfg))
                       for i in range(n)]
        self.stubs = {i + 1: edge_pb2_grpc.EdgeAgentStub(grpc.insecure_channel(a.trainer.cfg.listen, options=GRPC_OPTIONS))
                      for i, a in enumerate(self.agents)}
        self.weights = weights_of(build_model(ARCH, 6, seed=0))

    def close(self) -> None:
        for a in self.agents:
            a.stop(0)

    def secagg(self, agent: int, stage: str, **fields) -> dict:
        """One SecAgg stage request to agent ``agent`` (its 1-based position), with exactly ``fields``."""
        return from_values(self.stubs[agent].SecAgg(edge_pb2.SecAggRequest(stage=stage, fields=to_values(fields))).fields)

    def keyed(self, session: str, threshold: int) -> tuple[dict[int, dict], dict[int, dict[int, bytes]]]:
        """Advertise and share honestly (complete graph); returns (advertised keys, boxes routed to each slot)."""
        slots = sorted(self.stubs)
        keys = {u: self.secagg(u, "advertise", session=session, slot=u, threshold=threshold) for u in slots}
        routed: dict[int, dict[int, bytes]] = {u: {} for u in slots}
        for u in slots:
            others = [v for v in slots if v != u]
            out = self.secagg(u, "share", session=session, neighbors=others, **{"enc-pks": [keys[v]["enc-pk"] for v in others],
                                                                               "mask-pks": [keys[v]["mask-pk"] for v in others]})
            for v, box in zip(out["to"], out["boxes"]):
                routed[v][u] = box
        return keys, routed

    def train(self, slot: int, session: str | None, alive: list[int] | None = None, routed: dict[int, bytes] | None = None, max_weight: int = 1000,
              **extra_config) -> edge_pb2.TrainReply:
        config = struct_pb2.Struct()
        config.update({**CONFIG, **extra_config})
        secagg = {}
        if session is not None:
            layout = SecureLayout.of({ARCH: sum(v.size for v in self.weights.values())}, classes=6, metrics=True)
            secagg = to_values({"session": session, "alive": alive or [], "clip": 10.0, "scale": float(quantize.DEFAULT_SCALE),
                                "max-weight": max_weight, **layout.fields(), "from": list((routed or {}).keys()),
                                "boxes": list((routed or {}).values())})
        return self.stubs[slot].Train(edge_pb2.TrainRequest(run_id="attack", server_round=1, weights=to_tensors(self.weights), config=config,
                                                             secagg=secagg))


@pytest.fixture
def six(tmp_path):
    agents = Agents(tmp_path, 6)
    yield agents
    agents.close()


def _refused(call, code=grpc.StatusCode.INVALID_ARGUMENT) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    return err.value.details()


def test_thresholds_that_let_a_server_collect_a_secret_are_refused(six):
    assert "t < 2" in _refused(lambda: six.secagg(1, "advertise", session="s1", slot=1, threshold=1))
    # 6 holders, t = 3: the split view worked with this (2t = n); every factory refuses to share its keys
    keys = {u: six.secagg(u, "advertise", session="s3", slot=u, threshold=3) for u in six.stubs}
    others = [v for v in six.stubs if v != 1]
    details = _refused(lambda: six.secagg(1, "share", session="s3", neighbors=others, **{"enc-pks": [keys[v]["enc-pk"] for v in others],
                                                                                           "mask-pks": [keys[v]["mask-pk"] for v in others]}))
    assert "not above half of the 6 share holders" in details
    # a cohort of two is below the minimum whatever the threshold
    six.secagg(1, "advertise", session="s2", slot=1, threshold=2)
    assert "minimum cohort of 3" in _refused(lambda: six.secagg(1, "share", session="s2", neighbors=[2], **{"enc-pks": [keys[2]["enc-pk"]],
                                                                                                           "mask-pks": [keys[2]["mask-pk"]]}))


def test_a_factory_told_it_masks_alone_refuses_to_mask(six):
    """The unchecked-survivor attack: alive=[target] would make its masked input carry only its self mask."""
    _, routed = six.keyed("alone", threshold=4)
    assert "below the threshold 4" in _refused(lambda: six.train(1, "alone", alive=[1], routed=routed[1]))
    assert "below the threshold 4" in _refused(lambda: six.train(1, "alone", alive=[1, 2], routed=routed[1]))


def test_masking_twice_and_unmasking_out_of_order_are_refused(six):
    _, routed = six.keyed("once", threshold=4)
    alive = sorted(six.stubs)
    assert six.train(1, "once", alive, routed[1]).HasField("masked")
    assert "already made" in _refused(lambda: six.train(1, "once", alive, routed[1]))  # two inputs under the same masks
    assert "before this factory made its masked input" in _refused(lambda: six.secagg(2, "unmask", session="once", survivors=alive, dropped=[]))
    six.secagg(1, "unmask", session="once", survivors=alive, dropped=[])
    assert "already answered" in _refused(lambda: six.secagg(1, "unmask", session="once", survivors=alive, dropped=[]))


def test_survivors_must_be_factories_it_masked_with(six):
    _, routed = six.keyed("subset", threshold=4)
    six.train(1, "subset", [1, 2, 3, 4, 5], routed[1])  # not told slot 6 is alive
    assert "did not mask with them" in _refused(lambda: six.secagg(1, "unmask", session="subset", survivors=[1, 2, 3, 4, 6], dropped=[5]))
    assert "did not mask with them" in _refused(lambda: six.secagg(1, "unmask", session="subset", survivors=[1, 2, 3, 4], dropped=[6]))


def test_split_view_cannot_recover_both_secrets_of_one_factory(six):
    """t = 4 of 6 (the lowest the factories accept): the server tells the target and two others that the target survived (seed
    shares) and the other three that it dropped (mask-key shares). Each factory answers once, so 3 + 3 shares < 4 + 4."""
    keys, routed = six.keyed("split", threshold=4)
    alive = sorted(six.stubs)
    for u in alive:
        assert six.train(u, "split", alive, routed[u]).HasField("masked")
    seed_shares, key_shares = [], []
    for u in (1, 2, 3):  # "slot 1 survived"
        out = six.secagg(u, "unmask", session="split", survivors=[1, 2, 3, 4, 5], dropped=[6])
        seed_shares += [(i, s) for v, i, s in zip(out["seed-slots"], out["seed-index"], out["seed-shares"]) if v == 1]
    for u in (4, 5, 6):  # "slot 1 dropped"
        out = six.secagg(u, "unmask", session="split", survivors=[2, 3, 4, 5, 6], dropped=[1])
        key_shares += [(i, s) for v, i, s in zip(out["key-slots"], out["key-index"], out["key-shares"]) if v == 1]
    assert len(seed_shares) == 3 and len(key_shares) == 3  # neither reaches the threshold
    try:  # below t: not the secret (usually not even a 32-byte value)
        assert seed_commitment(recover_secret(seed_shares), b"split", 1) != keys[1]["seed-commit"]
    except ValueError:
        pass
    server = SecureSum(b"split", alive, 4, 5)
    server.seed_commits[1] = keys[1]["seed-commit"]
    with pytest.raises(SecAggAborted, match="only 3 well-formed shares"):
        server._recover(1, seed_shares, "self-mask seed", lambda s: True)


def test_a_factory_sharing_the_dp_noise_counts_only_the_honest_inputs_it_checked_itself(tmp_path):
    """--dp-secure-sum: a factory adds 1/(threshold - colluders) of the sum's noise variance, from the session whose threshold it
    checked against its own policy; noise settings in the server's config change nothing; a session whose keys were never shared
    is refused before anything is charged; outside a secure sum it adds all of the noise."""
    agents = Agents(tmp_path, 6, dp=True, dp_secure_sum=True, dp_planned_rounds=4, secagg_colluders=1, require_secure_aggregation=False)
    try:
        _, routed = agents.keyed("shared", threshold=5)  # 5 > 6/2 + 1 colluder: accepted; at least 5 - 1 honest inputs in any unmasked sum
        reply = agents.train(1, "shared", alive=list(agents.stubs), routed=routed[1], **{"noise-multiplier": 0.01, "dp-noise-holders": 100})
        assert reply.metrics["dp-noise-holders"] == 4 and reply.metrics["epsilon-alone"] > reply.metrics["epsilon-spent"] > 0
        ledger = agents.agents[0].trainer.ledger
        (release, charge) = ledger.charges()  # the class counts' one release (its own noise), then the round
        assert (release.noise_holders, charge.noise_holders, charge.sample_rate, charge.steps) == (1, 4, 1.0, 1)

        agents.secagg(2, "advertise", session="unshared", slot=2, threshold=5)  # keys never shared: its threshold was never checked
        assert "keys were never shared" in _refused(lambda: agents.train(2, "unshared", alive=list(agents.stubs)))
        assert agents.agents[1].trainer.ledger.charges() == []

        plain = agents.train(3, None)  # no secure sum: the whole noise, and the reply says so
        assert plain.metrics["dp-noise-holders"] == 1 and plain.metrics["epsilon-alone"] == pytest.approx(plain.metrics["epsilon-spent"])
        assert not {"train-loss", "train-accuracy", "update-norm"} & set(plain.metrics)  # no statistic of its images made without noise

        # a weight cap below its image count would scale its update (and its share of the noise) apart from the others': refused
        _, routed = agents.keyed("capped", threshold=5)
        details = _refused(lambda: agents.train(4, "capped", alive=list(agents.stubs), routed=routed[4], max_weight=10),
                           grpc.StatusCode.FAILED_PRECONDITION)
        assert "raise max-weight" in details
    finally:
        agents.close()


def test_the_servers_clip_never_acts_on_an_update_that_carries_only_a_share_of_the_noise(tmp_path):
    """Clipping one factory's update alone (its noise is a share) would act on a vector that is not private by itself: a factory
    sharing the sum's noise takes no clip from the server, whatever it sends; one with its own noise (local DP-SGD) keeps it."""
    from client.agent import EdgeAgentServicer
    from client.trainer import FactoryTrainer, LocalRound
    from common.secagg.messages import MaskedInput

    secure = MaskedInput("s", [1, 2, 3], 1e-9, float(quantize.DEFAULT_SCALE), 1000, [], [], SecureLayout.of({ARCH: 4}))
    local = LocalRound(OrderedDict(), 36, None, None, {}, {"epsilon-spent": 1.0})
    shared = EdgeAgentServicer(FactoryTrainer(AgentConfig(factory_id="a", dp=True, dp_secure_sum=True, train_size=40, state_dir=str(tmp_path / "a"))))
    alone = EdgeAgentServicer(FactoryTrainer(AgentConfig(factory_id="b", dp=True, train_size=40, state_dir=str(tmp_path / "b"))))
    assert shared._clip_for(secure, local) == float("inf") and alone._clip_for(secure, local) == 1e-9


def test_a_factory_that_requires_secure_aggregation_never_answers_in_plaintext(six):
    details = _refused(lambda: six.train(1, None), grpc.StatusCode.FAILED_PRECONDITION)
    assert "requires secure aggregation" in details
    config = struct_pb2.Struct()
    config.update(CONFIG)
    details = _refused(lambda: six.stubs[1].Evaluate(edge_pb2.EvaluateRequest(weights=to_tensors(six.weights), config=config)),
                       grpc.StatusCode.FAILED_PRECONDITION)
    assert "requires secure aggregation" in details


def test_low_order_keys_and_malformed_boxes_make_a_dropout_never_a_crash(six):
    session = "garbage"
    keys = {u: six.secagg(u, "advertise", session=session, slot=u, threshold=4) for u in six.stubs}
    keys[6] = {"enc-pk": bytes(32), "mask-pk": bytes(32)}  # slot 6's keys replaced by a low-order point
    routed: dict[int, dict[int, bytes]] = {u: {} for u in six.stubs}
    for u in range(1, 6):
        others = [v for v in six.stubs if v != u]
        out = six.secagg(u, "share", session=session, neighbors=others, **{"enc-pks": [keys[v]["enc-pk"] for v in others],
                                                                          "mask-pks": [keys[v]["mask-pk"] for v in others]})
        assert 6 not in out["to"]  # no share sealed to a key nobody can trust
        for v, box in zip(out["to"], out["boxes"]):
            routed[v][u] = box
    routed[1][2] = b"\x00" * 7  # a malformed box
    routed[1][3] = routed[1][3][:-1] + bytes([routed[1][3][-1] ^ 1])  # a tampered one
    reply = six.train(1, session, [1, 2, 3, 4, 5], routed[1])
    assert reply.HasField("masked")  # still masks with 2..5; the missing shares only cost redundancy
    exchange = KeyExchange.of(session.encode(), [1, 2, 3, 4, 5, 6], 4, 5)  # the server's side, from the same wire answers
    exchange.add_public_keys(keys)
    assert 6 not in exchange.secure.mask_pks and set(exchange.secure.mask_pks) == {1, 2, 3, 4, 5}  # it leaves slot 6 out too


def test_a_forged_share_never_silently_corrupts_the_sum():
    rng = np.random.default_rng(7)
    session, slots = b"forge", [1, 2, 3, 4, 5]
    inputs = {u: rng.normal(size=32) for u in slots}
    server = SecureSum(session, slots, 3, 4)
    clients = {u: SecAggClient(session, u, 3) for u in slots}
    plan = server.add_public_keys({u: clients[u].advertise() for u in slots})
    routed = server.add_share_boxes({u: clients[u].share_keys(*plan[u]) for u in slots if u != 5})  # 5 drops after advertising
    for u in (1, 2, 3, 4):
        clients[u].receive_boxes(routed[u])
        server.add_masked_input(u, clients[u].mask(quantize.encode(inputs[u]), server.u2, TERMS))
    survivors, dropped = server.unmask_request()
    answers = {u: clients[u].unmask(survivors, dropped) for u in survivors}
    seeds, forged_keys = answers[2]
    index, share = seeds[1]
    answers[2] = ({**seeds, 1: (index, bytes(b ^ 0x5A for b in share))}, forged_keys)  # a forged share of slot 1's seed
    total = quantize.decode(server.result(answers, TERMS))
    np.testing.assert_allclose(total, sum(inputs[u] for u in survivors), atol=quantize.error_bound(4))
    # with only t shares left, one of them forged: the round aborts instead of decoding a wrong sum
    lean = {u: answers[u] for u in (1, 2, 3)}
    with pytest.raises(SecAggAborted, match="forged shares"):
        server.result(lean, TERMS)


def test_unusable_answers_from_one_factory_are_a_dropout(tmp_path):
    from flwr.app import ConfigRecord, Message, RecordDict

    from server.secure_round import _unmask_answers

    class Names:
        def name(self, node):
            return f"factory-{node}"

    good = Message(RecordDict({"secagg": ConfigRecord({"seed-slots": [1], "seed-index": [1], "seed-shares": [b"x" * 32],
                                                         "key-slots": [], "key-index": [], "key-shares": []})}), dst_node_id=1, message_type="query.secagg_unmask")
    bad = Message(RecordDict({"secagg": ConfigRecord({"seed-slots": [1, 2], "seed-index": [1]})}), dst_node_id=2, message_type="query.secagg_unmask")
    failures: dict[str, str] = {}
    out = _unmask_answers({1: good, 2: bad}, failures, Names(), {1: 1, 2: 2})
    assert list(out) == [1] and "malformed unmask answer" in failures["factory-2"]


def test_a_malformed_vector_never_leaves_a_group_member_alone_in_the_sum(tmp_path):
    """Two cnn-medium factories share a group slot; one sends a malformed masked vector after masking. It is left out *before*
    the group-of-one rule, so the other member counts as alone and is not unmasked: its update is never published."""
    from client import app as client_app  # noqa: F401 - the handlers the scripted SuperNodes run
    from common.training import TrainConfig
    from server.config import FederationConfig
    from server.federation import Federation
    from server.registry.service import Registry
    from tests.test_server_rounds import ScriptedGrid, agent_node

    agents = [serve(AgentConfig(factory_id=f"f{i}", listen=f"127.0.0.1:{free_port()}", factory_index=i % 3, num_factories=3, train_size=40,
                                architecture=arch, state_dir=str(tmp_path / f"f{i}")))
              for i, arch in enumerate(["cnn-small", "cnn-small", "cnn-small", "cnn-medium", "cnn-medium"])]
    try:
        handlers = {i + 1: agent_node(a, {}) for i, a in enumerate(agents)}
        honest = handlers[5]

        def corrupt(msg):  # f4 (cnn-medium) masks honestly, then sends a truncated vector
            reply = honest(msg)
            if msg.metadata.message_type == "train" and reply is not None and "arrays" in reply.content:
                from flwr.app import Array, ArrayRecord
                masked = reply.content["arrays"]["masked"].numpy()
                reply.content["arrays"] = ArrayRecord(OrderedDict(masked=Array(masked[:-3].copy())))
            return reply
        handlers[5] = corrupt
        cfg = FederationConfig(architecture="cnn-small",  # 64 px images, the CNNs' size (the pretrained default reads 128)
                               num_server_rounds=1, test_size=60, wait_for_factories=5, round_timeout=60, secagg_timeout=60, min_factories=2,
                               registry_dir=str(tmp_path / "registry"), secagg_threshold=3, federated_evaluation=False,
                               training=TrainConfig(epochs=1, personal_epochs=0))
        Federation(ScriptedGrid(handlers), cfg, flwr_run_id="77").run()
    finally:
        for a in agents:
            a.stop(0)
    registry = Registry.at(tmp_path / "registry")
    (round1,) = registry.rounds("run-77")
    assert "malformed masked input" in round1.failures["f4"]
    assert "the only cnn-medium factory left" in round1.failures["f3"]  # its lone update is not unmasked
    assert [v.kind for v in registry.versions("run-77") if v.architecture == "cnn-medium"] == ["initial"]
    assert round1.status == "completed" and [v.kind for v in registry.versions("run-77") if v.architecture == "cnn-small"] == ["initial", "fedavg"]
