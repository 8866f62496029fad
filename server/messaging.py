"""Pushing messages to factories and pulling their replies over Flower's Grid, with short polls.

``Grid.send_and_receive`` sleeps 3 s between polls; a FedForge round polls every 50 ms so the server
sees a reply as soon as the SuperLink has it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from flwr.app import Message
from flwr.serverapp import Grid

POLL_SECONDS = 0.05


def push_and_collect(grid: Grid, messages: Iterable[Message], timeout: float) -> tuple[dict[int, Message], list[int]]:
    """Send ``messages``; return (replies by destination node id, node ids that did not answer in time)."""
    messages = list(messages)
    ids = [mid for mid in grid.push_messages(messages) if mid]
    node_of = {mid: m.metadata.dst_node_id for mid, m in zip(ids, messages)}
    pending = set(ids)
    replies: dict[int, Message] = {}
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for reply in grid.pull_messages(list(pending)):
            mid = reply.metadata.reply_to_message_id
            if mid in pending:
                pending.discard(mid)
                replies[node_of[mid]] = reply
        if pending:
            time.sleep(POLL_SECONDS)
    return replies, sorted(node_of[mid] for mid in pending)
