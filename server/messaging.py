"""Pushing messages to factories and pulling their replies over Flower's Grid, with short polls.

``Grid.send_and_receive`` sleeps 3 s between polls; a FedForge round polls every 50 ms so the server
sees a reply as soon as the SuperLink has it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from flwr.app import ArrayRecord, Message, RecordDict
from flwr.common.constant import HEARTBEAT_PATIENCE
from flwr.serverapp import Grid

from common.flower_waits import object_pull_deadline

POLL_SECONDS = 0.05
FINAL_PULL_SECONDS = 5.0  # the last look for replies once a phase's deadline has passed


def push_and_collect(grid: Grid, messages: Iterable[Message], timeout: float) -> tuple[dict[int, Message], list[int]]:
    """Send ``messages``; return (replies by destination node id, node ids that did not answer in time)."""
    messages = list(messages)
    ids = [mid for mid in grid.push_messages(messages) if mid]
    node_of = {mid: m.metadata.dst_node_id for mid, m in zip(ids, messages)}
    pending = set(ids)
    replies: dict[int, Message] = {}

    def pull(bound: float) -> None:
        with object_pull_deadline(bound):  # a reply whose sender died mid-upload must not hold the others back
            for reply in grid.pull_messages(list(pending)):
                mid = reply.metadata.reply_to_message_id
                if mid in pending:
                    pending.discard(mid)
                    replies[node_of[mid]] = reply

    deadline = time.monotonic() + timeout
    while pending and (remaining := deadline - time.monotonic()) > 0:
        pull(remaining)
        if pending:
            time.sleep(POLL_SECONDS)
    if pending:  # replies that arrived while a broken one was being waited for are not late
        pull(min(FINAL_PULL_SECONDS, timeout))
    return replies, sorted(node_of[mid] for mid in pending)


def _value_bytes(value: object) -> int:
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, list):
        return sum(_value_bytes(v) for v in value)
    return 8  # a number or a bool


def payload_bytes(content: RecordDict) -> int:
    """A message's payload: array data, and the bytes, strings and numbers of its config and metric records
    (Flower's protobuf framing excluded)."""
    total = 0
    for record in content.values():
        if isinstance(record, ArrayRecord):
            total += sum(len(array.data) for array in record.values())
        else:
            total += sum(len(key) + _value_bytes(value) for key, value in record.items())
    return total


def short_reason(reason: str, limit: int = 300) -> str:
    """The ClientApp's own words from an error reply: Flower's simulation wraps them in a Ray traceback
    ("... Exception ClientAppException occurred. Message: <words>'>"), which no failure list should carry."""
    if "Message: " in reason:
        reason = reason.rsplit("Message: ", 1)[1].rstrip("'>\n ")
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


class Messenger:
    """One message per factory and their replies, with factory names for errors and time per message type.

    The round phases (plain, secure, describe, proxy, final evaluation) all speak to factories through
    this; a factory that times out or answers with an error is noted in ``failures`` by name.
    """

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.factory_of_node: dict[int, str] = {}
        self.phase_seconds: dict[str, float] = {}  # wall time per message type in the current round
        self.upload_bytes: dict[int, int] = {}  # payload each factory sent in the current round

    def name(self, node_id: int) -> str:
        return self.factory_of_node.get(node_id, f"node-{node_id}")

    def node_ids(self) -> list[int]:
        return sorted(self.grid.get_node_ids())

    def heard_since(self, since: float) -> list[int]:
        """Nodes whose latest heartbeat reached the SuperLink at or after wall-clock time ``since``.

        The SuperLink keeps a node online until ``last heartbeat + HEARTBEAT_PATIENCE x its interval``; after a SuperLink
        restart it still lists the nodes of its database as online until that runs out, whether or not they have
        reconnected. A Grid that reports no heartbeat interval (not a SuperLink's) counts every listed node."""
        return sorted(n.node_id for n in self.grid.get_nodes()
                      if not n.heartbeat_interval or n.online_until >= since + HEARTBEAT_PATIENCE * n.heartbeat_interval - 1e-3)

    def exchange(self, node_ids: list[int], message_type: str, server_round: int, records: Callable[[int], RecordDict], timeout: float,
                 failures: dict[str, str]) -> dict[int, Message]:
        """Send one message per node (``records(node) -> RecordDict``); return good replies, note failures by name."""
        messages = [Message(records(n), dst_node_id=n, message_type=message_type, group_id=str(server_round)) for n in node_ids]
        started = time.perf_counter()
        replies, timed_out = push_and_collect(self.grid, messages, timeout)
        self.phase_seconds[message_type] = self.phase_seconds.get(message_type, 0.0) + time.perf_counter() - started
        for node_id in timed_out:
            failures[self.name(node_id)] = f"no reply to {message_type} within {timeout:.0f}s"
        good = {}
        for node_id, reply in replies.items():
            if reply.has_content():
                self.upload_bytes[node_id] = self.upload_bytes.get(node_id, 0) + payload_bytes(reply.content)
            if reply.has_error():
                failures[self.name(node_id)] = f"error reply to {message_type}: {short_reason(reply.error.reason)}"
                continue
            if "info" in reply.content and "factory-id" in reply.content["info"]:
                self.factory_of_node[node_id] = str(reply.content["info"]["factory-id"])
            good[node_id] = reply
        return good

    def new_round(self) -> None:
        self.phase_seconds, self.upload_bytes = {}, {}

    def phase_metrics(self) -> dict[str, float]:
        """Where the round's time went, per message type (e.g. seconds/train, seconds/query.secagg_unmask), and what the
        factories sent in it (upload-bytes-per-factory: mean and max over the factories that answered)."""
        out = {f"seconds/{kind}": round(t, 3) for kind, t in self.phase_seconds.items()}
        if self.upload_bytes:
            sent = list(self.upload_bytes.values())
            out |= {"upload-bytes-per-factory": float(sum(sent)) / len(sent), "upload-bytes-per-factory-max": float(max(sent))}
        return out
