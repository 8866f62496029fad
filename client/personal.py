"""A factory's personal model: the latest global model fine-tuned on this factory's own images.

Every round a factory trains the global model on its data; that result is kept on disk per
architecture, with its accuracy on the factory's held-out split and that of the global model it
started from. Inspection (`client.inspection`) serves whichever of the approved global model and
this personal model scores better on the held-out split, and says which and by how much. The
personal model never leaves the factory.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from client.data import DataRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PersonalRecord:
    architecture: str
    server_round: int
    accuracy: float  # the personal model on the held-out split
    global_accuracy: float  # the global model it was fine-tuned from, on the same split
    classes: tuple[str, ...]
    image_size: int
    channels: int

    @property
    def request(self) -> DataRequest:
        return DataRequest(tuple(self.classes), self.image_size, self.channels)


class PersonalModels:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def offer(self, architecture: str, request: DataRequest, weights: OrderedDict[str, np.ndarray], accuracy: float,
              global_accuracy: float, server_round: int) -> PersonalRecord:
        """Keep this round's fine-tuned model (written atomically: weights first, then the record naming them)."""
        self.root.mkdir(parents=True, exist_ok=True)
        record = PersonalRecord(architecture, server_round, float(accuracy), float(global_accuracy), tuple(request.classes),
                                request.image_size, request.channels)
        tmp = self.root / f".{architecture}.tmp.npz"
        with open(tmp, "wb") as f:
            np.savez(f, **weights)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.root / f"{architecture}.npz")
        meta = self.root / f".{architecture}.tmp.json"
        meta.write_text(json.dumps(asdict(record)))
        meta.replace(self.root / f"{architecture}.json")
        return record

    def get(self, architecture: str) -> tuple[OrderedDict[str, np.ndarray], PersonalRecord] | None:
        weights_path, meta_path = self.root / f"{architecture}.npz", self.root / f"{architecture}.json"
        if not (weights_path.exists() and meta_path.exists()):
            return None
        try:
            record = PersonalRecord(**{**json.loads(meta_path.read_text()), "classes": tuple(json.loads(meta_path.read_text())["classes"])})
            with np.load(weights_path, allow_pickle=False) as npz:
                weights = OrderedDict((k, npz[k]) for k in npz.files)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("personal model %s is unreadable (%s); serving the global model only", weights_path, exc)
            return None
        return weights, record
