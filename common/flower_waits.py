"""Flower 1.42's wait for a message's objects, shortened for FedForge's processes.

A Flower message travels as a head plus content objects, and every hop announces the head before its
objects have all arrived: the SuperNode registers a message (so its ClientApp starts) while it is still
pulling the message's arrays from the SuperLink, and the SuperLink lists a message while its sender
is still pushing them. A reader that asks for an object too early gets "unavailable" and backs off
for 1 s, then 2 s, 4 s... (``flwr.supercore.inflatable.inflatable_utils.pull_objects``, defaults
``PULL_INITIAL_BACKOFF = 1``, ``PULL_BACKOFF_CAP = 10``, no flag or environment variable), although
the object typically lands a few milliseconds later. Measured on loopback with the default head,
these back-offs added 1-3.5 s to single factories' message phases, at random.

`shorten_object_pull_backoff` starts that back-off at 50 ms and caps it at 1 s in the process that
calls it (the SuperNode, the ClientApp processes and the ServerApp call it); the retry limit and the
overall deadline stay Flower's. It applies only to the Flower version it was checked against.

Flower's overall deadline for one message's objects is 2 hours (``PULL_MAX_TIME``). A ServerApp that
pulls replies meets a message whose objects will never come when a factory dies in the middle of
uploading its reply: the SuperLink already lists that reply, and the pull of every reply in the same
call waits for it. `object_pull_deadline` bounds that wait inside a block (the ServerApp bounds it
by the round's own deadline), so the dead factory's reply becomes an error reply and the others are
collected.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

log = logging.getLogger("fedforge.flower")

CHECKED_VERSION = "1.42.0"  # the Flower version every FedForge change to its waits was checked against
INITIAL_BACKOFF_S = 0.05
BACKOFF_CAP_S = 1.0


def checked_flower() -> bool:
    """Whether the installed Flower is the version FedForge's adjustments to its internals were checked against."""
    import flwr

    return getattr(flwr, "__version__", "") == CHECKED_VERSION


def shorten_object_pull_backoff(initial: float = INITIAL_BACKOFF_S, cap: float = BACKOFF_CAP_S) -> bool:
    """Lower the default back-off of Flower's object pulls in this process; returns whether it applied."""
    import flwr

    functions = _pull_functions()
    if not _defaults_settable(functions, "initial_backoff", "backoff_cap"):
        log.warning("Flower %s: object pulls keep Flower's back-off (the change targets %s)", getattr(flwr, "__version__", "?"), CHECKED_VERSION)
        return False
    for fn in functions:
        fn.__kwdefaults__ = {**fn.__kwdefaults__, "initial_backoff": initial, "backoff_cap": cap}
    return True


def _pull_functions() -> tuple[Callable[..., object], ...]:
    """Flower's two object-pull functions whose defaults FedForge adjusts."""
    from flwr.supercore.inflatable import inflatable_utils

    return inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree


def _defaults_settable(functions: tuple[Callable[..., object], ...], *names: str) -> bool:
    """Whether this is the Flower version FedForge checked and each function still takes ``names`` as keyword defaults."""
    return checked_flower() and all(set(names) <= set(fn.__kwdefaults__ or {}) for fn in functions)


@contextlib.contextmanager
def object_pull_deadline(seconds: float) -> Iterator[bool]:
    """Within the block, Flower's object pulls in this process give up after ``seconds`` per message (Flower: 2 h);
    yields whether the bound applied. The bound is a function default, so pulls from other threads during the block
    get it too: the ServerApp pulls from one thread."""
    functions = _pull_functions()
    if not _defaults_settable(functions, "max_time"):
        yield False
        return
    saved = [fn.__kwdefaults__["max_time"] for fn in functions]
    for fn in functions:
        fn.__kwdefaults__ = {**fn.__kwdefaults__, "max_time": max(0.1, seconds)}
    try:
        yield True
    finally:
        for fn, value in zip(functions, saved):
            fn.__kwdefaults__ = {**fn.__kwdefaults__, "max_time": value}
