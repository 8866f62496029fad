"""Content-addressed weight files: ``<root>/<sha256[:2]>/<sha256>.npz``, written atomically.

The format is numpy's .npz without pickles (``allow_pickle=False`` on load), so a weights file can
never execute code. A file is written to a temporary name, fsync'd and renamed: a crash mid-write
leaves no half file under the final name.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np


class ArtifactError(RuntimeError):
    """A weights file is missing, unreadable or does not match its sha256."""


def encode_weights(weights: OrderedDict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **weights)
    return buf.getvalue()


def decode_weights(blob: bytes) -> OrderedDict[str, np.ndarray]:
    try:
        with np.load(io.BytesIO(blob), allow_pickle=False) as npz:
            return OrderedDict((k, npz[k]) for k in npz.files)
    except Exception as exc:
        raise ArtifactError(f"weights file is not a valid .npz archive: {exc}") from exc


class ArtifactStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path_for(self, sha256: str) -> Path:
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise ArtifactError(f"not a sha256 hex digest: {sha256!r}")
        return self.root / sha256[:2] / f"{sha256}.npz"

    def put(self, blob: bytes) -> str:
        digest = hashlib.sha256(blob).hexdigest()
        final = self.path_for(digest)
        if final.exists():
            return digest
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=".tmp-", suffix=".npz")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return digest

    def get(self, sha256: str) -> bytes:
        path = self.path_for(sha256)
        try:
            blob = path.read_bytes()
        except FileNotFoundError as exc:
            raise ArtifactError(f"weights file {path} is missing") from exc
        actual = hashlib.sha256(blob).hexdigest()
        if actual != sha256:
            raise ArtifactError(f"weights file {path} is corrupt: sha256 {actual} != {sha256}")
        return blob
