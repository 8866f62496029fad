"""Inspection on the edge agent: verified models only, same predictions as in-process, lossless hot swap."""

from __future__ import annotations

import io
import threading
import time
from collections import OrderedDict

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from client.agent import serve
from client.config import AgentConfig
from client.inspection import decode_image
from common.data import datasets
from common.models import build_model
from common.procs import free_port
from common.rpc.fedforge.v1 import edge_pb2, edge_pb2_grpc
from server.certs import create_ca, create_server_cert
from server.registry.grpc_service import serve_registry
from server.registry.service import NewVersion


def _weights(seed: int) -> OrderedDict:
    return OrderedDict((k, v.numpy()) for k, v in build_model("cnn-small", 6, seed=seed).state_dict().items())


def _png(img: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray((img[0] * 255).astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _wait(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


STATION_TOKEN = "station-token"


@pytest.fixture
def site(registry_factory, tmp_path):
    """A registry and one factory's agent following it, with Inspection as a station reaches it off loopback: its own
    port, TLS and a token (bound to 127.0.0.1 here)."""
    registry = registry_factory()
    reg_address = f"127.0.0.1:{free_port()}"
    reg_server, stop = serve_registry(registry, reg_address, "inspection-token")
    ca, _ = create_ca(tmp_path / "pki")
    cert, key = create_server_cert(tmp_path / "pki", ["line-3.factory.example"])
    agent_address, inspection_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    agent = serve(AgentConfig(factory_id="line-3", listen=agent_address, train_size=32, registry=reg_address, registry_token="inspection-token",
                              registry_public_key=str(registry_factory.public_key), release_public_key=str(registry_factory.release_public_key),
                              state_dir=str(tmp_path / "factory"), inspection_listen=inspection_address, inspection_token=STATION_TOKEN,
                              inspection_tls_cert=str(cert), inspection_tls_key=str(key)))
    agent.addresses = {"control": agent_address, "inspection": inspection_address, "ca": ca.read_bytes()}
    channel = grpc.secure_channel(inspection_address, _station_credentials(ca.read_bytes(), STATION_TOKEN))
    yield registry, edge_pb2_grpc.InspectionStub(channel), agent
    channel.close()
    agent.stop(grace=None)
    stop.set()
    reg_server.stop(grace=None).wait()


def _station_credentials(ca: bytes, token: str) -> grpc.ChannelCredentials:
    return grpc.composite_channel_credentials(grpc.ssl_channel_credentials(ca), grpc.access_token_call_credentials(token))


def _add(registry, seed: int, round_: int = 1):
    return registry.add_version(NewVersion(run_id="r", server_round=round_, parent_id=None, kind="fedavg", architecture="cnn-small",
                                           weights=_weights(seed), metrics={}, participants=["a"]))


def test_inspect_matches_the_model_in_process_and_swaps_on_approval(site):
    registry, stub, agent = site
    images = datasets.test_dataset(datasets.SyntheticSpec(), 12).images
    with pytest.raises(grpc.RpcError) as err:
        stub.Inspect(edge_pb2.InspectRequest(image=_png(images[0])))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # nothing approved yet

    v1 = _add(registry, seed=1)
    registry.approve(v1.id, actor="qa")
    _wait(lambda: agent.follower.serving.version == v1.id)
    model = build_model("cnn-small", 6)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in _weights(1).items()})
    model.eval()
    for img in images:
        reply = stub.Inspect(edge_pb2.InspectRequest(image=_png(img), request_id="x"))
        with torch.no_grad():
            expected = torch.softmax(model(torch.from_numpy(decode_image(_png(img))[None])), 1)[0].numpy()
        assert reply.model_version == v1.id and reply.request_id == "x"
        np.testing.assert_allclose(reply.probabilities, expected, atol=1e-5)
        assert reply.class_index == int(expected.argmax())

    replies = list(stub.InspectStream(iter([edge_pb2.InspectRequest(image=_png(i), request_id=str(k)) for k, i in enumerate(images)])))
    assert [r.request_id for r in replies] == [str(k) for k in range(len(images))]


def test_a_line_scan_strip_is_fed_to_each_version_as_its_training_images_were_read(site):
    """Strips are folded since decoding 4. A version recorded before that (no ``decoding`` in its input record) was
    trained on strips letterboxed as they are, and is fed them so; a version recorded since, folded."""
    from common.data.images import DECODE_VERSION, FOLDING_DECODE, decode_image_bytes

    registry, stub, agent = site
    strip = np.full((32, 128), 60, np.uint8)
    strip[8:20, 4:16], strip[12:24, 100:112] = 250, 250
    buf = io.BytesIO()
    Image.fromarray(strip).save(buf, format="PNG")
    data = buf.getvalue()
    unfolded = decode_image_bytes(data, 64, 1, decoding=FOLDING_DECODE - 1)
    folded = decode_image_bytes(data, 64, 1, decoding=DECODE_VERSION)
    assert np.abs(folded - unfolded).max() > 0.5
    model = build_model("cnn-small", 6)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in _weights(1).items()})
    model.eval()
    recorded = {"classes": list(datasets.synth.CLASSES), "image_size": 64, "channels": 1, "decoding": DECODE_VERSION}
    for round_, model_input, expected_input in ((1, None, unfolded), (2, recorded, folded)):
        version = registry.add_version(NewVersion(run_id="r", server_round=round_, parent_id=None, kind="fedavg", architecture="cnn-small",
                                                  weights=_weights(1), metrics={}, participants=["a"], model_input=model_input))
        registry.approve(version.id, actor="qa")
        _wait(lambda version_id=version.id: agent.follower.serving.version == version_id)
        with torch.no_grad():
            expected = torch.softmax(model(torch.from_numpy(expected_input[None])), 1)[0].numpy()
        np.testing.assert_allclose(stub.Inspect(edge_pb2.InspectRequest(image=data)).probabilities, expected, atol=1e-5)


def test_a_cut_out_is_fed_to_each_version_as_its_training_images_were_read():
    """Transparency is flattened onto white since decoding 5; a version recorded with decoding 4 was trained on the colour
    Pillow's ``convert`` shows under transparent pixels, and is fed that (the agent picks the decoding per version as in the
    strip test above)."""
    from common.data.images import DECODE_VERSION, FLATTENING_DECODE, decode_image_bytes

    rgba = np.zeros((32, 32, 4), np.uint8)
    rgba[8:24, 8:24] = (120, 120, 120, 255)  # an opaque square on transparent black
    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, format="PNG")
    old = decode_image_bytes(buf.getvalue(), 32, 1, decoding=FLATTENING_DECODE - 1)
    new = decode_image_bytes(buf.getvalue(), 32, 1, decoding=DECODE_VERSION)
    assert old[0, 0, 0] == 0.0 and new[0, 0, 0] == 1.0
    assert old[0, 16, 16] == new[0, 16, 16] == pytest.approx(120 / 255)


def test_a_deep_colour_tiff_is_fed_to_each_version_as_its_training_images_were_read():
    """Colour TIFFs of more than 8 bits per sample are read by tifffile since decoding 6; a version recorded with decoding 5
    was trained on Pillow's reading of them (for a planar file, 8-bit planes cut out of the 16-bit data), and is fed that."""
    import tifffile

    from common.data.images import DECODE_VERSION, DEEP_COLOUR_DECODE, decode_image_bytes

    rgb = np.zeros((32, 32, 3), np.uint16)
    rgb[8:24, 8:24, 0] = 60000  # a red square on black
    buf = io.BytesIO()
    tifffile.imwrite(buf, np.moveaxis(rgb, -1, 0), photometric="rgb", planarconfig="separate")
    old = decode_image_bytes(buf.getvalue(), 32, 3, decoding=DEEP_COLOUR_DECODE - 1)
    new = decode_image_bytes(buf.getvalue(), 32, 3, decoding=DECODE_VERSION)
    assert new[:, 16, 16] == pytest.approx([60000 / 65535, 0.0, 0.0])
    pillow = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"), np.float32).transpose(2, 0, 1) / 255
    np.testing.assert_allclose(old, pillow, atol=1e-6)
    assert np.abs(old - new).max() > 0.2


def test_an_lzw_deep_colour_tiff_is_fed_to_each_version_as_its_training_images_were_read():
    """Deep TIFFs compressed by LZW (or another codec tifffile reads only with imagecodecs) are read by tifffile since
    decoding 8; a version recorded with decoding 7 was trained on Pillow's reading of them, and is fed that."""
    import tifffile

    from common.data.images import DECODE_VERSION, TIFF_CODECS_DECODE, decode_image_bytes

    rgb = np.zeros((32, 32, 3), np.uint16)
    rgb[8:24, 8:24, 0] = 3000  # a red square on black from a 12-bit camera
    buf = io.BytesIO()
    tifffile.imwrite(buf, rgb, photometric="rgb", compression="lzw")
    old = decode_image_bytes(buf.getvalue(), 32, 3, bit_depth=12, decoding=TIFF_CODECS_DECODE - 1)
    new = decode_image_bytes(buf.getvalue(), 32, 3, bit_depth=12, decoding=DECODE_VERSION)
    assert new[:, 16, 16] == pytest.approx([3000 / 4095, 0.0, 0.0])
    pillow = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"), np.float32).transpose(2, 0, 1) / 255
    np.testing.assert_allclose(old, pillow, atol=1e-6)
    assert old[0, 16, 16] < 0.1  # the high byte of 3000: nearly black


def test_a_colour_managed_deep_tiff_is_fed_to_each_version_as_its_training_images_were_read():
    """A deep colour TIFF's embedded profile is applied since decoding 9; a version recorded with decoding 8 was trained on
    the stored samples, and is fed those."""
    import tifffile

    from common.data.images import DECODE_VERSION, DEEP_COLOUR_MANAGED_DECODE, decode_image_bytes
    from tests.icc import wide_gamut_profile

    red = np.zeros((32, 32, 3), np.uint16)
    red[..., 0] = 50000
    buf = io.BytesIO()
    tifffile.imwrite(buf, red, photometric="rgb", iccprofile=wide_gamut_profile())
    old = decode_image_bytes(buf.getvalue(), 32, 3, bit_depth=16, decoding=DEEP_COLOUR_MANAGED_DECODE - 1)
    new = decode_image_bytes(buf.getvalue(), 32, 3, bit_depth=16, decoding=DECODE_VERSION)
    assert old[:, 16, 16] == pytest.approx([50000 / 65535, 0.0, 0.0], abs=1e-6)
    assert new[0, 16, 16] > old[0, 16, 16] + 0.05  # Adobe RGB's red is more saturated than sRGB's: clipped at sRGB's edge


def test_a_colour_managed_file_is_fed_to_each_version_as_its_training_images_were_read():
    """Embedded colour profiles are applied since decoding 7; a version recorded with decoding 6 was trained on the stored
    values, and is fed those."""
    from common.data.images import COLOUR_MANAGED_DECODE, DECODE_VERSION, decode_image_bytes
    from tests.icc import wide_gamut_profile

    red = np.zeros((32, 32, 3), np.uint8)
    red[..., 0] = 200
    buf = io.BytesIO()
    Image.fromarray(red).save(buf, format="PNG", icc_profile=wide_gamut_profile())
    old = decode_image_bytes(buf.getvalue(), 32, 3, decoding=COLOUR_MANAGED_DECODE - 1)
    new = decode_image_bytes(buf.getvalue(), 32, 3, decoding=DECODE_VERSION)
    assert old[:, 16, 16] == pytest.approx([200 / 255, 0.0, 0.0])
    assert new[0, 16, 16] > old[0, 16, 16] + 0.1  # a deeper red than sRGB's 200 of 255: converted, it reads brighter


def test_hot_swap_loses_no_request_and_bad_versions_are_never_loaded(site):
    registry, stub, agent = site
    image = _png(datasets.test_dataset(datasets.SyntheticSpec(), 6).images[0])
    v1, v2 = _add(registry, 1), _add(registry, 2, round_=2)
    registry.approve(v1.id, actor="qa")
    _wait(lambda: agent.follower.serving.version == v1.id)

    seen, errors, stop = [], [], threading.Event()

    def hammer():
        while not stop.is_set():
            try:
                seen.append(stub.Inspect(edge_pb2.InspectRequest(image=image)).model_version)
            except grpc.RpcError as exc:  # pragma: no cover - the assertion below reports it
                errors.append(exc)

    threads = [threading.Thread(target=hammer) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    registry.approve(v2.id, actor="qa")
    _wait(lambda: agent.follower.serving.version == v2.id)
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join()
    assert not errors and seen[0] == v1.id and seen[-1] == v2.id and set(seen) == {v1.id, v2.id}

    # a tampered version is refused with its reason and never served
    v3 = _add(registry, 3, round_=3)
    path = registry.artifacts.path_for(v3.sha256)
    blob = bytearray(path.read_bytes())
    blob[-10] ^= 0xFF
    path.write_bytes(bytes(blob))
    registry.approve(v3.id, actor="qa")
    _wait(lambda: v3.id in agent.follower.refused)
    assert "TamperedWeightsError" in agent.follower.refused[v3.id] and agent.follower.serving.version == v2.id

    # revoking the serving version swaps back to the previous approved one
    registry.revoke(v2.id, actor="qa")
    _wait(lambda: agent.follower.serving.version == v1.id)
    assert stub.Inspect(edge_pb2.InspectRequest(image=image)).model_version == v1.id


def test_bad_images_are_rejected(site):
    registry, stub, agent = site
    v1 = _add(registry, 1)
    registry.approve(v1.id, actor="qa")
    _wait(lambda: agent.follower.serving.version == v1.id)
    good = _png(datasets.test_dataset(datasets.SyntheticSpec(), 6).images[0])
    for bad in (b"", b"not an image", good[: len(good) // 2]):
        with pytest.raises(grpc.RpcError) as err:
            stub.Inspect(edge_pb2.InspectRequest(image=bad))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        stub.Inspect(edge_pb2.InspectRequest(image=b"x" * (9 << 20)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit" in err.value.details()


def test_inspection_is_served_apart_from_the_control_plane_with_tls_and_a_token(site):
    """A station reaches Inspection only, only over TLS, only with the token; the control plane answers no Inspection,
    and an agent refuses to put the control plane, or a token-less plaintext Inspection, on the network."""
    registry, stub, agent = site
    images = datasets.test_dataset(datasets.SyntheticSpec(seed=1), 6).images
    version = _add(registry, 1)
    registry.approve(version.id, actor="qa")
    _wait(lambda: agent.follower.serving.version == version.id)
    assert stub.Inspect(edge_pb2.InspectRequest(image=_png(images[0]))).model_version == version.id

    ca, inspection, control = agent.addresses["ca"], agent.addresses["inspection"], agent.addresses["control"]
    with grpc.secure_channel(inspection, _station_credentials(ca, STATION_TOKEN)) as channel:  # Train, SecAgg...: not on this port
        with pytest.raises(grpc.RpcError) as err:
            edge_pb2_grpc.EdgeAgentStub(channel).Health(edge_pb2.HealthRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    for token in ("", "wrong-token"):
        credentials = _station_credentials(ca, token) if token else grpc.ssl_channel_credentials(ca)
        with grpc.secure_channel(inspection, credentials) as channel, pytest.raises(grpc.RpcError) as err:
            edge_pb2_grpc.InspectionStub(channel).Inspect(edge_pb2.InspectRequest(image=_png(images[0])), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, token
    with grpc.insecure_channel(inspection) as channel, pytest.raises(grpc.RpcError) as err:  # plaintext to a TLS port
        edge_pb2_grpc.InspectionStub(channel).Inspect(edge_pb2.InspectRequest(image=_png(images[0])), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(control) as channel:  # the control plane serves the SuperNode, not stations
        assert edge_pb2_grpc.EdgeAgentStub(channel).Health(edge_pb2.HealthRequest(), timeout=10).factory_id == "line-3"
        with pytest.raises(grpc.RpcError) as err:
            edge_pb2_grpc.InspectionStub(channel).Inspect(edge_pb2.InspectRequest(image=_png(images[0])), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED

    following = {"factory_id": "line-4", "registry": "127.0.0.1:1", "registry_token": "t", "registry_public_key": "s.pub",
                 "release_public_key": "r.pub"}
    with pytest.raises(ValueError, match="--agent-listen 0.0.0.0:50061: the agent's training control plane must not face the network"):
        AgentConfig(factory_id="line-4", listen="0.0.0.0:50061")
    with pytest.raises(ValueError, match="needs --inspection-token .* and --inspection-tls-cert and --inspection-tls-key"):
        AgentConfig(**following, inspection_listen="0.0.0.0:50062")
    with pytest.raises(ValueError, match="needs --inspection-tls-cert"):
        AgentConfig(**following, inspection_listen="10.0.0.7:50062", inspection_token="x")
    assert AgentConfig(factory_id="line-4", listen="unix:/run/fedforge/agent.sock").listen.startswith("unix:")
