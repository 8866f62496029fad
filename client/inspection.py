"""Inspection serving on the edge: the approved, verified model answers `fedforge.v1.Inspection`.

`ServingModel` swaps models atomically: a request takes a reference to the current (version, model)
pair once and finishes on it, so a hot swap never loses or mixes a request. `ApprovalFollower` tracks
the registry's WatchApproved stream and acts only on release statements signed by the release key it
pins, each numbered above the last one it applied (kept in its state directory across restarts); it
pulls and verifies the version a statement approves (signing key and the statement's sha256), and only
then swaps. A forged, replayed or mismatched statement and a version that fails verification are
refused with a log line and never loaded; a signed revocation swaps back to the newest version still
approved by an earlier signed statement.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from client.data import DataRequest
from client.models import ModelClient
from common.data.images import DECODE_VERSION, DEFAULT_BIT_DEPTH, FOLDING_DECODE, ImageError, decode_image_bytes
from common.data.synth import CLASSES, DEFAULT_SIZE
from common.models import PRETRAINED_ARCHITECTURES, build_model, load_weights
from common.release import Statement, verify_statement
from common.rpc.fedforge.v1 import edge_pb2, edge_pb2_grpc
from common.signing import VerificationError

log = logging.getLogger(__name__)

MAX_IMAGE_BYTES = 8 << 20
InvalidImage = ImageError


def decode_image(data: bytes, size: int = DEFAULT_SIZE, channels: int = 1, bit_depth: int = DEFAULT_BIT_DEPTH,
                 decoding: int = DECODE_VERSION) -> np.ndarray:
    """Encoded image bytes -> float32 (channels, size, size), resized (and 16-bit grey scaled by this factory's ``bit_depth``)
    as the served model's training images were (``decoding``: `decoding_of` its version); raises `InvalidImage` with the reason."""
    return decode_image_bytes(data, size, channels, MAX_IMAGE_BYTES, bit_depth, decoding)


def decoding_of(manifest: dict[str, Any]) -> int:
    """How a version's training images were decoded (`common.data.images.DECODE_VERSION` when it was made); versions from
    before it was recorded were trained on strips letterboxed as they are, so they are fed them unfolded."""
    return int((manifest.get("model_input") or {}).get("decoding") or FOLDING_DECODE - 1)


def input_of(manifest: dict[str, Any]) -> DataRequest:
    """The input contract a version was trained for (versions from before it was recorded: the built-in one)."""
    spec = manifest.get("model_input") or {}
    return DataRequest(tuple(spec.get("classes") or CLASSES), int(spec.get("image_size") or DEFAULT_SIZE), int(spec.get("channels") or 1))


@dataclass(frozen=True)
class Served:
    """What answers inspection requests: a model, what it expects, and where it came from."""

    version: str  # the approved global version being followed
    model: torch.nn.Module
    request: DataRequest
    label: str  # reported as model_version: the version id, or "personal@<version>" (the personal model of that version)
    description: str = ""
    decoding: int = DECODE_VERSION  # how its training images were decoded, and so how requests are (`decoding_of`)


class ServingModel:
    def __init__(self) -> None:
        self._current: Served | None = None
        self._history: list[str] = []

    @property
    def version(self) -> str | None:
        return self._current.version if self._current else None

    @property
    def description(self) -> str:
        return self._current.description if self._current else ""

    def clear(self, reason: str) -> None:
        if self._current is not None:
            log.warning("inspection stops serving model %s: %s", self._current.label, reason)
        self._current = None

    def swap(self, version_id: str, model: torch.nn.Module, request: DataRequest | None = None, label: str = "", description: str = "",
             decoding: int = DECODE_VERSION) -> None:
        model.eval()
        self._current = Served(version_id, model, request or DataRequest(), label or version_id, description, decoding)  # one assignment: atomic for readers
        self._history.append(label or version_id)
        log.info("inspection now serves %s%s", label or version_id, f" ({description})" if description else "")

    def current(self) -> Served:
        current = self._current
        if current is None:
            raise LookupError("no approved model has been verified and loaded yet")
        return current

    def predict(self, images: np.ndarray, served: Served | None = None) -> tuple[str, np.ndarray]:
        current = served or self.current()
        with torch.no_grad():
            probs = torch.softmax(current.model(torch.from_numpy(images)), dim=1).numpy()
        return current.label, probs


def load_verified(path: Any, manifest: dict[str, Any]) -> torch.nn.Module:
    """A whole model from a verified version: its architecture, its input contract, its (federated) weights.

    A version that sits on a backbone other than the one pinned here, or on features computed
    differently (another centre, other taps), is refused: its head was trained on different features.
    """
    arch = manifest["architecture"]
    backbone = (manifest.get("model_input") or {}).get("backbone")
    spec = PRETRAINED_ARCHITECTURES.get(arch)
    if backbone and (spec is None or backbone.get("sha256") != spec.sha256 or backbone.get("features", spec.ident) != spec.ident):
        raise VerificationError(f"version {manifest['id']} sits on backbone {backbone}, not the one pinned on this factory "
                                f"({spec.ident if spec else 'none for ' + arch})")
    request = input_of(manifest)
    with np.load(path, allow_pickle=False) as npz:
        weights = {k: npz[k] for k in npz.files}
    return load_weights(build_model(arch, num_classes=len(request.classes), in_channels=request.channels), weights)


class InspectionServicer(edge_pb2_grpc.InspectionServicer):
    def __init__(self, serving: ServingModel, bit_depth: int = DEFAULT_BIT_DEPTH) -> None:
        self.serving = serving
        self.bit_depth = bit_depth  # the factory's cameras', as its training images are read (`AgentConfig.bit_depth`)

    def _one(self, request: Any, context: grpc.ServicerContext) -> edge_pb2.InspectReply:
        try:
            served = self.serving.current()  # one model for the whole request, even across a hot swap
            image = decode_image(request.image, served.request.image_size, served.request.channels, self.bit_depth, served.decoding)
            version, probs = self.serving.predict(image[None], served)
        except InvalidImage as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except LookupError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        k = int(probs[0].argmax())
        return edge_pb2.InspectReply(request_id=request.request_id, label=served.request.classes[k], class_index=k, score=float(probs[0, k]),
                                     probabilities=probs[0].tolist(), model_version=version)

    def Inspect(self, request: Any, context: grpc.ServicerContext) -> edge_pb2.InspectReply:
        return self._one(request, context)

    def InspectStream(self, request_iterator: Any, context: grpc.ServicerContext):  # type: ignore[no-untyped-def]
        for request in request_iterator:
            yield self._one(request, context)


Chooser = Callable[[str, str, DataRequest, torch.nn.Module], tuple[str, torch.nn.Module, str]]


@dataclass(frozen=True)
class SignedStatement:
    statement: Statement
    data: str  # the exact signed bytes (canonical JSON), kept to re-verify after a restart
    signature: str


class ApprovalFollower(threading.Thread):
    """Follows WatchApproved; keeps `serving` on the newest version approved by a valid signed statement.

    With a ``chooser`` (personalisation, `client.agent.personal_chooser`), the factory's personal model of the
    approved version is served unless the approved model validates clearly better on the factory's held-out
    split; `reconsider` repeats that choice after a round (its settings may have changed). With a ``state_path`` the
    applied release number and approvals survive restarts, so a registry that later replays an older
    history cannot move this line backwards.
    """

    def __init__(self, client: ModelClient, serving: ServingModel, release_key: Any, architecture: str = "", chooser: Chooser | None = None,
                 state_path: Path | None = None) -> None:
        super().__init__(daemon=True, name="fedforge-approval-follower")
        self.client, self.serving, self.release_key, self.architecture, self.chooser = client, serving, release_key, architecture, chooser
        self.state_path = state_path
        self._global: tuple[str, dict[str, Any], torch.nn.Module] | None = None  # (version, manifest, model) being followed
        self.stop_event = threading.Event()
        self.approved: list[SignedStatement] = []  # signed approvals in release order, revoked ones removed
        self.refused: dict[str, str] = {}  # version id -> why it was not loaded
        self.refused_statements: dict[int, str] = {}  # action id -> why the statement was not acted on
        self.release = 0  # the highest release number applied
        self.last_action = 0
        self._load_state()

    # durable state -------------------------------------------------------------------------
    def _load_state(self) -> None:
        if self.state_path is None or not self.state_path.exists():
            return
        saved = json.loads(self.state_path.read_text())
        for item in saved.get("approved", []):  # re-verified: a file edited on disk is no shortcut around the release key
            statement = verify_statement(item["statement"].encode(), item["signature"], self.release_key)
            self.approved.append(SignedStatement(statement, item["statement"], item["signature"]))
        self.release, self.last_action = int(saved["release"]), int(saved["last_action"])

    def _save_state(self) -> None:
        if self.state_path is None:
            return
        state = {"release": self.release, "last_action": self.last_action,
                 "approved": [{"statement": a.data, "signature": a.signature} for a in self.approved]}
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state_path)

    # the stream ------------------------------------------------------------------------------
    def run(self) -> None:
        if self.approved:
            self._serve_best()
        while not self.stop_event.is_set():
            try:
                self._stream = self.client.watch(self.architecture, self.last_action)
                for event in self._stream:
                    self.last_action = event.action_id
                    self._apply(event)
            except grpc.RpcError as err:
                if self.stop_event.is_set():
                    return
                log.warning("registry watch interrupted (%s); reconnecting", err.code().name)
                time.sleep(1.0)

    def _verified(self, event: Any) -> Statement:
        statement = verify_statement(event.statement, event.signature, self.release_key)
        if (statement.version_id, statement.action) != (event.version_id, event.action):
            raise VerificationError(f"the statement says {statement.action} {statement.version_id}, the registry said {event.action} {event.version_id}")
        if self.architecture and statement.architecture != self.architecture:
            raise VerificationError(f"the statement is for architecture {statement.architecture}, this line serves {self.architecture}")
        if statement.release <= self.release:
            raise VerificationError(f"release {statement.release} is not above release {self.release} already applied here "
                                    "(a replayed or reordered statement; going back needs a newer signed rollback)")
        return statement

    def _apply(self, event: Any) -> None:
        try:
            statement = self._verified(event)
        except VerificationError as exc:
            self.refused_statements[event.action_id] = str(exc)
            log.error("registry action %d (%s %s) refused: %s", event.action_id, event.action, event.version_id, exc)
            return
        self.release = statement.release
        self.approved = [a for a in self.approved if a.statement.version_id != statement.version_id]
        if statement.status == "approved":
            self.approved.append(SignedStatement(statement, event.statement.decode(), event.signature))
        self._save_state()
        self._serve_best()

    def _serve_best(self) -> None:
        for approval in reversed(self.approved):
            statement = approval.statement
            version_id = statement.version_id
            if version_id == self.serving.version:
                return
            if version_id in self.refused:
                continue
            try:
                pulled = self.client.pull(version_id)
                if pulled.manifest.get("sha256") != statement.sha256:
                    raise VerificationError(f"the approved sha256 {statement.sha256} is not the version's {pulled.manifest.get('sha256')}")
                self._serve(version_id, pulled.manifest, load_verified(pulled.weights_path, pulled.manifest))
                return
            except (VerificationError, grpc.RpcError, ValueError, KeyError, RuntimeError) as exc:
                reason = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
                self.refused[version_id] = f"{type(exc).__name__}: {reason}"
                log.error("model %s refused and not loaded: %s", version_id, self.refused[version_id])
        if self.serving.version is not None and self.serving.version not in {a.statement.version_id for a in self.approved}:
            self._global = None
            self.serving.clear("it is no longer approved and no other approved version verifies")

    def _serve(self, version_id: str, manifest: dict[str, Any], model: torch.nn.Module) -> None:
        request = input_of(manifest)
        self._global = (version_id, manifest, model)
        label, served, why = version_id, model, ""
        if self.chooser is not None:
            try:
                label, served, why = self.chooser(version_id, manifest["architecture"], request, model)
            except Exception as exc:  # noqa: BLE001 - the global model is always a safe answer
                log.warning("could not compare %s with the personal model (%s); serving the global model", version_id, exc)
        # the global model is fed requests as its version was trained; a personal model is trained here, on today's decoding
        decoding = decoding_of(manifest) if served is model else DECODE_VERSION
        self.serving.swap(version_id, served, request, label, why, decoding)

    def reconsider(self) -> None:
        """Choose again between the followed global version and the (new) personal model."""
        if self._global is not None and self.chooser is not None:
            self._serve(*self._global)

    def stop(self) -> None:
        self.stop_event.set()
        stream = getattr(self, "_stream", None)
        if stream is not None:
            stream.cancel()
