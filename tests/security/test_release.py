"""Models on the line: only versions with an approval signed by the release key are served, never an older
release without a newer signed statement, and nobody without the registry token downloads anything.

The attacker here controls the central host's registry database and service (not the release key):
they write action rows directly, sign with the keys that live on the central host, replay old
statements and cut the history, against a real edge agent following a real ModelRegistry over gRPC.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import grpc
import pytest

from client.agent import serve
from client.config import AgentConfig
from common.models import build_model
from common.procs import free_port
from common.release import new_statement, sign_statement
from common.signing import create_keypair, load_private
from server.registry.grpc_service import serve_registry
from server.registry.schema import Action, utcnow
from server.registry.service import NewVersion, Registry, ReleaseKeyError

TOKEN = "release-test-token"


def _wait(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _add(registry: Registry, seed: int):
    weights = OrderedDict((k, v.numpy()) for k, v in build_model("cnn-small", 6, seed=seed).state_dict().items())
    return registry.add_version(NewVersion(run_id="r", server_round=seed, parent_id=None, kind="fedavg", architecture="cnn-small",
                                           weights=weights, metrics={}, participants=["a"]))


def _inject(registry: Registry, version_id: str, action: str, statement: str = "", signature: str = "") -> None:
    """What an attacker with write access to the registry database does: an action row, no release key involved."""
    with registry.session.begin() as s:
        s.add(Action(version_id=version_id, action=action, actor="mallory", note="", at=utcnow(), statement=statement, signature=signature))


class Line:
    """A registry service and one factory's edge agent following it (restartable with the same state)."""

    def __init__(self, registry: Registry, root, keys) -> None:
        self.registry, self.root, self.keys = registry, root, keys
        self.address = f"127.0.0.1:{free_port()}"
        self.server, self.stop_event = serve_registry(registry, self.address, TOKEN)
        self.agent = None

    def start_agent(self):
        self.agent = serve(AgentConfig(factory_id="line-7", listen=f"127.0.0.1:{free_port()}", inspection_listen=f"127.0.0.1:{free_port()}",
                                       train_size=32, registry=self.address,
                                       registry_token=TOKEN, registry_public_key=str(self.keys / "signing.pub"),
                                       release_public_key=str(self.keys / "release.pub"), state_dir=str(self.root / "factory")))
        return self.agent

    @property
    def follower(self):
        return self.agent.follower

    def stop_agent(self) -> None:
        self.agent.stop(grace=None)

    def close(self) -> None:
        if self.agent is not None:
            self.stop_agent()
        self.stop_event.set()
        self.server.stop(grace=None).wait()


@pytest.fixture
def line(tmp_path):
    registry = Registry.at(tmp_path / "registry", create_key=True)
    site = Line(registry, tmp_path, tmp_path / "registry" / "keys")
    site.start_agent()
    yield site
    site.close()


def test_an_approval_not_signed_by_the_release_key_is_never_served(line):
    registry = line.registry
    v1, v2 = _add(registry, 1), _add(registry, 2)
    registry.approve(v1.id, actor="qa")
    _wait(lambda: line.follower.serving.version == v1.id)

    # 1. a bare action row, as a registry with database access writes it
    _inject(registry, v2.id, "approve")
    # 2. a statement signed with the key that does live on the central host (the signing key)
    on_host = load_private(line.keys / "signing.key")
    data, envelope = sign_statement(new_statement(99, v2.id, v2.sha256, v2.architecture, "approve", "mallory", utcnow()), on_host)
    _inject(registry, v2.id, "approve", data, envelope)
    # 3. the real statement of v1 presented as an approval of v2
    real = registry.actions(version_id=v1.id)[-1]
    _inject(registry, v2.id, "approve", real.statement, real.signature)
    _wait(lambda: len(line.follower.refused_statements) == 3)
    reasons = list(line.follower.refused_statements.values())
    assert "no signed release statement" in reasons[0]
    assert "pins key" in reasons[1]  # WrongKeyError: not the release key
    assert f"says approve {v1.id}" in reasons[2]
    assert line.follower.serving.version == v1.id


def _serving_the_second_of_two(line):
    """Two versions approved in turn (releases 1 and 2); the edge serves the second."""
    registry = line.registry
    v1, v2 = _add(registry, 1), _add(registry, 2)
    registry.approve(v1.id, actor="qa")
    registry.approve(v2.id, actor="qa")
    _wait(lambda: line.follower.serving.version == v2.id)
    return registry, v1, v2


def test_a_replayed_approval_cannot_roll_the_line_back(line):
    registry, v1, v2 = _serving_the_second_of_two(line)
    old = registry.actions(version_id=v1.id)[-1]  # a genuine, validly signed statement: release 1
    _inject(registry, v1.id, "approve", old.statement, old.signature)
    _wait(lambda: line.follower.refused_statements)
    (reason,) = line.follower.refused_statements.values()
    assert "release 1 is not above release 2" in reason and line.follower.serving.version == v2.id
    # going back is possible, with a newer signed statement
    registry.rollback(v1.id, actor="qa")
    _wait(lambda: line.follower.serving.version == v1.id)


def test_a_restarted_edge_keeps_its_release_when_the_history_is_cut(line):
    registry, v1, v2 = _serving_the_second_of_two(line)
    line.stop_agent()
    with registry.session.begin() as s:  # the registry forgets v2's approval and replays a history ending at v1
        s.query(Action).filter(Action.version_id == v2.id).delete()
    old = registry.actions(version_id=v1.id)[-1]
    for _ in range(2):  # (SQLite reuses the deleted row id, which the edge has already seen: the second copy is new to it)
        _inject(registry, v1.id, "approve", old.statement, old.signature)
    line.start_agent()
    _wait(lambda: line.follower.serving.version == v2.id)  # from its own verified state, not the registry's word
    _wait(lambda: line.follower.refused_statements)
    assert all("not above release 2" in r for r in line.follower.refused_statements.values())


def test_the_state_file_is_no_shortcut_around_the_release_key(line):
    registry = line.registry
    v1 = _add(registry, 1)
    registry.approve(v1.id, actor="qa")
    _wait(lambda: line.follower.serving.version == v1.id)
    line.stop_agent()
    state = line.root / "factory" / "releases.json"
    state.write_text(state.read_text().replace('\\"release\\":1', '\\"release\\":7'))  # edited on disk: the signature no longer matches
    with pytest.raises(Exception, match="release statement signature is invalid"):
        line.start_agent()


def test_status_changes_need_the_release_key(tmp_path):
    """With the release key kept off the central host, the registry cannot approve; another key is refused."""
    directory = tmp_path / "registry"
    Registry.at(directory, create_key=True)
    offline = tmp_path / "usb"
    offline.mkdir()
    (directory / "keys" / "release.key").rename(offline / "release.key")
    registry = Registry.at(directory)
    v = _add(registry, 1)
    with pytest.raises(ReleaseKeyError, match="--release-key"):
        registry.approve(v.id, actor="qa")
    stranger, _ = create_keypair(tmp_path / "other", "release")
    with pytest.raises(ReleaseKeyError, match="not the federation's release key"):
        registry.approve(v.id, actor="qa", release_key=load_private(stranger))
    assert registry.get_version(v.id).status == "candidate" and not registry.actions()
    registry.approve(v.id, actor="qa", release_key=load_private(offline / "release.key"))
    assert registry.actions()[-1].release == 1


def test_the_registry_refuses_plaintext_off_loopback_and_callers_without_the_token(tmp_path):
    registry = Registry.at(tmp_path / "registry", create_key=True)
    with pytest.raises(ValueError, match="faces the network"):
        serve_registry(registry, f"0.0.0.0:{free_port()}", TOKEN)
    with pytest.raises(ValueError, match="requires a client token"):
        serve_registry(registry, f"127.0.0.1:{free_port()}", "")
    address = f"127.0.0.1:{free_port()}"
    server, stop = serve_registry(registry, address, TOKEN)
    try:
        from client.models import ModelClient
        from common.signing import load_public

        intruder = ModelClient(address, load_public(tmp_path / "registry" / "keys" / "signing.pub"), tmp_path / "edge", token="guessed")
        with pytest.raises(grpc.RpcError) as err:
            intruder.list()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            next(intruder.watch())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        stop.set()
        server.stop(grace=None).wait()
