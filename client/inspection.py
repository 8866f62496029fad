"""Inspection serving on the edge: the approved, verified model answers `fedforge.v1.Inspection`.

`ServingModel` swaps models atomically: a request takes a reference to the current (version, model)
pair once and finishes on it, so a hot swap never loses or mixes a request. `ApprovalFollower` tracks
the registry's WatchApproved stream, pulls and verifies the version that should be serving, and only
then swaps; a version that fails verification is refused with a log line and never loaded, and a
revocation swaps back to the previous approved version.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch

from client.data import DataRequest
from client.models import ModelClient
from common.data.images import ImageError, decode_image_bytes
from common.data.synth import CLASSES, DEFAULT_SIZE
from common.models import PRETRAINED_ARCHITECTURES, build_model, load_weights
from common.rpc.fedforge.v1 import edge_pb2, edge_pb2_grpc
from common.signing import VerificationError

log = logging.getLogger(__name__)

MAX_IMAGE_BYTES = 8 << 20
InvalidImage = ImageError


def decode_image(data: bytes, size: int = DEFAULT_SIZE, channels: int = 1) -> np.ndarray:
    """Encoded image bytes -> float32 (channels, size, size), resized as in training; raises `InvalidImage` with the reason."""
    return decode_image_bytes(data, size, channels, MAX_IMAGE_BYTES)


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
    label: str  # reported as model_version: the version id, or "personal:<round>@<version>"
    description: str = ""


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

    def swap(self, version_id: str, model: torch.nn.Module, request: DataRequest | None = None, label: str = "", description: str = "") -> None:
        model.eval()
        self._current = Served(version_id, model, request or DataRequest(), label or version_id, description)  # one assignment: atomic for readers
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

    A version that sits on a backbone other than the one pinned here is refused: its head was trained
    on different features.
    """
    arch = manifest["architecture"]
    backbone = (manifest.get("model_input") or {}).get("backbone")
    if backbone and (arch not in PRETRAINED_ARCHITECTURES or backbone.get("sha256") != PRETRAINED_ARCHITECTURES[arch].sha256):
        raise VerificationError(f"version {manifest['id']} sits on backbone {backbone}, not the one pinned on this factory")
    request = input_of(manifest)
    with np.load(path, allow_pickle=False) as npz:
        weights = {k: npz[k] for k in npz.files}
    return load_weights(build_model(arch, num_classes=len(request.classes), in_channels=request.channels), weights)


class InspectionServicer(edge_pb2_grpc.InspectionServicer):
    def __init__(self, serving: ServingModel) -> None:
        self.serving = serving

    def _one(self, request: Any, context: grpc.ServicerContext) -> edge_pb2.InspectReply:
        try:
            served = self.serving.current()  # one model for the whole request, even across a hot swap
            image = decode_image(request.image, served.request.image_size, served.request.channels)
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


class ApprovalFollower(threading.Thread):
    """Follows WatchApproved; keeps `serving` on the newest approved version that verifies.

    With a ``chooser`` (personalisation), the approved global model is served only if it scores at
    least as well on the factory's held-out split as the factory's personal model; `reconsider`
    repeats that choice after a round has produced a new personal model.
    """

    def __init__(self, client: ModelClient, serving: ServingModel, architecture: str = "", chooser: Chooser | None = None) -> None:
        super().__init__(daemon=True, name="fedforge-approval-follower")
        self.client, self.serving, self.architecture, self.chooser = client, serving, architecture, chooser
        self._global: tuple[str, dict[str, Any], torch.nn.Module] | None = None  # (version, manifest, model) being followed
        self.stop_event = threading.Event()
        self.approved: list[str] = []  # approved versions in order of approval, revoked ones removed
        self.refused: dict[str, str] = {}
        self.last_action = 0

    def run(self) -> None:
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

    def _apply(self, event: Any) -> None:
        if event.action in ("approve", "rollback"):
            if event.version_id in self.approved:
                self.approved.remove(event.version_id)
            self.approved.append(event.version_id)
        elif event.action == "revoke" and event.version_id in self.approved:
            self.approved.remove(event.version_id)
        self._serve_best()

    def _serve_best(self) -> None:
        for version_id in reversed(self.approved):
            if version_id == self.serving.version:
                return
            if version_id in self.refused:
                continue
            try:
                pulled = self.client.pull(version_id)
                self._serve(version_id, pulled.manifest, load_verified(pulled.weights_path, pulled.manifest))
                return
            except (VerificationError, grpc.RpcError, ValueError, KeyError, RuntimeError) as exc:
                reason = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
                self.refused[version_id] = f"{type(exc).__name__}: {reason}"
                log.error("model %s refused and not loaded: %s", version_id, self.refused[version_id])
        if self.serving.version is not None and self.serving.version not in self.approved:
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
        self.serving.swap(version_id, served, request, label, why)

    def reconsider(self) -> None:
        """Choose again between the followed global version and the (new) personal model."""
        if self._global is not None and self.chooser is not None:
            self._serve(*self._global)

    def stop(self) -> None:
        self.stop_event.set()
        stream = getattr(self, "_stream", None)
        if stream is not None:
            stream.cancel()
