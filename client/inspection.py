"""Inspection serving on the edge: the approved, verified model answers `fedforge.v1.Inspection`.

`ServingModel` swaps models atomically: a request takes a reference to the current (version, model)
pair once and finishes on it, so a hot swap never loses or mixes a request. `ApprovalFollower` tracks
the registry's WatchApproved stream, pulls and verifies the version that should be serving, and only
then swaps; a version that fails verification is refused with a log line and never loaded, and a
revocation swaps back to the previous approved version.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from typing import Any

import grpc
import numpy as np
import torch

from client.models import ModelClient
from common.data.synth import CLASSES, DEFAULT_SIZE
from common.models import build_model
from common.rpc.fedforge.v1 import edge_pb2, edge_pb2_grpc
from common.signing import VerificationError

log = logging.getLogger(__name__)

MAX_IMAGE_BYTES = 8 << 20


class InvalidImage(ValueError):
    pass


def decode_image(data: bytes, size: int = DEFAULT_SIZE) -> np.ndarray:
    """Encoded image bytes -> float32 (1, size, size) in [0, 1]; raises `InvalidImage` with the reason."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise InvalidImage("empty image")
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidImage(f"image of {len(data)} bytes exceeds the {MAX_IMAGE_BYTES} byte limit")
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height > 64_000_000:
                raise InvalidImage(f"image of {img.width}x{img.height} pixels is too large")
            img.load()
            grey = img.convert("L").resize((size, size), Image.BILINEAR)
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise InvalidImage(f"cannot decode image: {exc}") from exc
    return (np.asarray(grey, dtype=np.float32) / 255.0)[None]


class ServingModel:
    def __init__(self) -> None:
        self._current: tuple[str, torch.nn.Module] | None = None
        self._history: list[str] = []

    @property
    def version(self) -> str | None:
        return self._current[0] if self._current else None

    def clear(self, reason: str) -> None:
        if self._current is not None:
            log.warning("inspection stops serving model %s: %s", self._current[0], reason)
        self._current = None

    def swap(self, version_id: str, model: torch.nn.Module) -> None:
        model.eval()
        self._current = (version_id, model)  # one reference assignment: atomic for readers
        self._history.append(version_id)
        log.info("inspection now serves model %s", version_id)

    def predict(self, images: np.ndarray) -> tuple[str, np.ndarray]:
        current = self._current
        if current is None:
            raise LookupError("no approved model has been verified and loaded yet")
        version, model = current
        with torch.no_grad():
            probs = torch.softmax(model(torch.from_numpy(images)), dim=1).numpy()
        return version, probs


def load_verified(path: Any, manifest: dict[str, Any]) -> torch.nn.Module:
    with np.load(path, allow_pickle=False) as npz:
        state = {k: torch.from_numpy(npz[k]) for k in npz.files}
    model = build_model(manifest["architecture"], num_classes=len(CLASSES))
    model.load_state_dict(state)
    return model


class InspectionServicer(edge_pb2_grpc.InspectionServicer):
    def __init__(self, serving: ServingModel) -> None:
        self.serving = serving

    def _one(self, request: Any, context: grpc.ServicerContext) -> edge_pb2.InspectReply:
        try:
            image = decode_image(request.image)
            version, probs = self.serving.predict(image[None])
        except InvalidImage as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except LookupError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        k = int(probs[0].argmax())
        return edge_pb2.InspectReply(request_id=request.request_id, label=CLASSES[k], class_index=k, score=float(probs[0, k]),
                                     probabilities=probs[0].tolist(), model_version=version)

    def Inspect(self, request: Any, context: grpc.ServicerContext) -> edge_pb2.InspectReply:
        return self._one(request, context)

    def InspectStream(self, request_iterator: Any, context: grpc.ServicerContext):  # type: ignore[no-untyped-def]
        for request in request_iterator:
            yield self._one(request, context)


class ApprovalFollower(threading.Thread):
    """Follows WatchApproved; keeps `serving` on the newest approved version that verifies."""

    def __init__(self, client: ModelClient, serving: ServingModel, architecture: str = "") -> None:
        super().__init__(daemon=True, name="fedforge-approval-follower")
        self.client, self.serving, self.architecture = client, serving, architecture
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
                model = self.client.pull(version_id)
                self.serving.swap(version_id, load_verified(model.weights_path, model.manifest))
                return
            except (VerificationError, grpc.RpcError, ValueError, KeyError, RuntimeError) as exc:
                reason = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
                self.refused[version_id] = f"{type(exc).__name__}: {reason}"
                log.error("model %s refused and not loaded: %s", version_id, self.refused[version_id])
        if self.serving.version is not None and self.serving.version not in self.approved:
            self.serving.clear("it is no longer approved and no other approved version verifies")

    def stop(self) -> None:
        self.stop_event.set()
        stream = getattr(self, "_stream", None)
        if stream is not None:
            stream.cancel()
