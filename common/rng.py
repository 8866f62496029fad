"""Torch's global random stream, shared safely by the threads of one process.

torch keeps one global CPU generator per process, not per thread. A seeded build (``manual_seed`` then
drawing initial weights) that runs while another thread draws from, re-seeds or restores that stream
gets someone else's numbers: an edge agent's background personal-model job, its gRPC handlers and, in
tests and simulation, the server all build models in one process. So every draw from the global stream
happens under one process-wide lock, inside ``fork_rng`` so the caller's stream is left as it was.
Code that needs randomness while training passes its own ``torch.Generator`` instead.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_GLOBAL_STREAM = threading.RLock()


@contextmanager
def global_torch_rng(seed: int | None = None) -> Iterator[None]:
    """Hold torch's global CPU stream for this block (seeded with ``seed`` when given), then restore it."""
    with _GLOBAL_STREAM, torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        yield
