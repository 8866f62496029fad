"""A round without secure aggregation: every factory's update arrives in the clear and is checked.

Each reply is validated on its own (names, shapes, dtypes, finiteness, example count; predictions and
the confusion matrix likewise); a bad one is left out with the reason under the factory's name, and
the rest are averaged within their architecture group (FedAvg, weighted by example count).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from flwr.app import Message, MessageType, RecordDict

from common.distill import check_predictions, ensemble_of
from common.evaluation import check_confusion
from common.tensors import UpdateError
from common.wire import weights_of_record, weights_record
from server.aggregate import FactoryUpdate, fedavg, validate_update
from server.groups import RoundPlan, RoundResult
from server.messaging import Messenger
from server.reduce import privacy_of, shared_of, weighted_means


class RoundAborted(RuntimeError):
    """The round cannot produce a model; the global models stay as they were."""

    def __init__(self, reason: str, failures: dict[str, str], participants: list[str]) -> None:
        super().__init__(reason)
        self.failures, self.participants = failures, participants


def parse_update(messenger: Messenger, node_id: int, reply: Message, like: OrderedDict[str, np.ndarray] | None) -> FactoryUpdate:
    content = reply.content
    factory_id = messenger.name(node_id)
    metrics = {k: float(v) for k, v in content["metrics"].items()}
    update = FactoryUpdate(
        factory_id=factory_id, node_id=node_id,
        weights=weights_of_record(content["arrays"], f"factory {factory_id}") if like is not None else OrderedDict(),
        num_examples=int(metrics.pop("num-examples", 0)), metrics=metrics,
    )
    if like is not None:
        validate_update(like, update)
    elif update.num_examples <= 0:
        raise UpdateError(f"factory {factory_id}: reported {update.num_examples} training examples")
    return update


def parse_predictions(reply: Message, factory_id: str, proxy_size: int, num_classes: int, max_weight: int) -> tuple[np.ndarray, np.ndarray]:
    """A factory's balanced proxy-set predictions and class counts, checked (raises naming the factory)."""
    if "predictions" not in reply.content:
        raise UpdateError(f"factory {factory_id}: no predictions in a distillation round")
    record = reply.content["predictions"]
    q = check_predictions(record["probabilities"].numpy(), proxy_size, num_classes, f"factory {factory_id}")
    counts = np.asarray(record["class-counts"].numpy(), dtype=np.float64)
    if counts.shape != (num_classes,) or not np.isfinite(counts).all() or (counts < 0).any() or counts.sum() <= 0:
        raise UpdateError(f"factory {factory_id}: class counts {counts.tolist()} are not {num_classes} non-negative numbers")
    return q, np.minimum(counts, float(max_weight))


def parse_confusion(reply: Message, factory_id: str, num_classes: int) -> np.ndarray | None:
    if "evaluation" not in reply.content:
        return None
    return check_confusion(reply.content["evaluation"]["confusion"].numpy(), num_classes, f"factory {factory_id}")


def plain_round(messenger: Messenger, plan: RoundPlan, send_weights: bool, min_factories: int, timeout: float, max_weight: int,
                failures: dict[str, str]) -> RoundResult:
    contents = {arch: RecordDict({"arrays": weights_record(line.weights), "config": plan.message_config(arch, send_weights)})
                for arch, line in plan.lines.items()}
    replies = messenger.exchange(plan.nodes, MessageType.TRAIN, plan.server_round, lambda n: contents[plan.architecture_of[n]], timeout, failures)
    updates: dict[str, list[FactoryUpdate]] = {}
    predictions: list[tuple[np.ndarray, np.ndarray]] = []
    confusion: dict[str, np.ndarray] = {}
    good: list[FactoryUpdate] = []
    for node_id, reply in replies.items():
        arch = plan.architecture_of[node_id]
        try:
            update = parse_update(messenger, node_id, reply, plan.lines[arch].weights if send_weights else None)
            if plan.distilling and plan.proxy is not None:
                predictions.append(parse_predictions(reply, update.factory_id, len(plan.proxy), plan.num_classes, max_weight))
            matrix = parse_confusion(reply, update.factory_id, plan.num_classes)
        except (UpdateError, KeyError, TypeError, ValueError) as exc:
            failures[messenger.name(node_id)] = str(exc)
            continue
        good.append(update)
        if matrix is not None:
            confusion[arch] = confusion.get(arch, 0) + matrix
        if send_weights:
            updates.setdefault(arch, []).append(update)
    participants = sorted(u.factory_id for u in good)
    if len(good) < min_factories:
        raise RoundAborted(f"{len(good)} good updates, {min_factories} required", failures, participants)
    result = RoundResult(participants=participants, failures=failures, confusion=confusion)
    result.privacy = {u.factory_id: privacy_of(u.metrics) for u in good if "epsilon-spent" in u.metrics}
    result.shared = {u.factory_id: s for u in good if (s := shared_of(u.metrics))}
    for arch, group in updates.items():
        result.group_weights[arch] = fedavg(group, like=plan.lines[arch].weights)
        result.group_examples[arch] = float(sum(u.num_examples for u in group))
    if predictions:
        weighted_sum = sum(counts[None, :] * q for q, counts in predictions)
        result.ensemble, result.ensemble_size = ensemble_of(weighted_sum, sum(c for _, c in predictions)), len(predictions)
    received = sum(a.nbytes for u in good for a in u.weights.values()) + sum(q.size * 4 + c.size * 8 for q, c in predictions)
    result.metrics = {**weighted_means((min(u.num_examples, max_weight), u.metrics) for u in good), "bytes-received": float(received),
                      "uplink-bytes-per-factory": float(received) / len(good)}
    return result


def plain_evaluation(messenger: Messenger, plan: RoundPlan, timeout: float, failures: dict[str, str]) -> RoundResult:
    """The evaluate-only phase after the last round, in the clear: each factory's confusion counts, summed per group."""
    contents = {arch: RecordDict({"arrays": weights_record(line.weights), "config": plan.message_config(arch, False)})
                for arch, line in plan.lines.items()}
    replies = messenger.exchange(plan.nodes, MessageType.EVALUATE, plan.server_round, lambda n: contents[plan.architecture_of[n]], timeout, failures)
    result = RoundResult(failures=failures)
    for node_id, reply in replies.items():
        try:
            matrix = parse_confusion(reply, messenger.name(node_id), plan.num_classes)
            if matrix is None:
                raise UpdateError("no confusion matrix in the evaluation reply")
        except (UpdateError, KeyError, TypeError, ValueError) as exc:
            failures[messenger.name(node_id)] = str(exc)
            continue
        arch = plan.architecture_of[node_id]
        result.confusion[arch] = result.confusion.get(arch, 0) + matrix
        result.participants.append(messenger.name(node_id))
        if shared := shared_of({k: float(v) for k, v in reply.content["metrics"].items()}):
            result.shared[messenger.name(node_id)] = shared
    result.participants.sort()
    return result
