"""Rounds through the SecAgg+ secure sum: the server learns sums only, never one factory's contribution.

A secure phase is one masked message per factory (train, or the final evaluate) and one unmask
message. Its session's keys are exchanged in two phases of their own (advertise, share) unless the
previous phase already carried them: the next session's key advertisement rides on this phase's
masked message and its share distribution on the unmask message (pipelining), so a steady-state
secure round costs two message phases where a plain one costs one.

What the sum holds is laid out by `common.secagg.layout`: every group's weighted update and example
count, the distillation ensemble's sums, each group's confusion matrix of the model its factories
received, and example-weighted training metrics. A group of one would have its member revealed by
its slot, so such a factory sends predictions only (or nothing) and its group gets no slots.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from common.distill import ensemble_of
from common.secagg.layout import SecureLayout, SumNotValid, Sums, apply_group_sum
from common.secagg.messages import RECORD, MaskedInput, MessageError, Shares, Unmask, split_next, with_next
from common.secagg.primitives import session_id
from common.secagg.terms import round_terms
from common.tensors import check_like
from common.wire import weights_record
from server.config import FederationConfig
from server.groups import RoundPlan, RoundResult
from server.messaging import Messenger
from server.plain_round import RoundAborted
from server.reduce import privacy_of, secure_means, shared_of
from server.secure_sum import KeyedSession, KeyExchange, SecAggAborted, auto_degree, default_threshold

log = logging.getLogger("fedforge.server")

AHEAD = "keyed-ahead"  # session-id use for a phase's session keyed during the previous phase (a fresh exchange uses its own id)


class SecureRounds:
    """Secure phases of one run, and the session keyed ahead for the next one."""

    def __init__(self, messenger: Messenger, cfg: FederationConfig, run_id: str) -> None:
        self.messenger, self.cfg, self.run_id = messenger, cfg, run_id
        self._pipelined: KeyedSession | None = None  # the next phase's session, keyed during this one

    def degree(self, n: int) -> int:
        """Neighbours per factory for a session of ``n``: the configured degree, or the automatic one (0: complete graph)."""
        return self.cfg.secagg_degree or auto_degree(n)

    def threshold(self, n: int) -> int:
        """Shares needed to recover a secret: two thirds of a factory's neighbourhood (itself and its neighbours), which
        the factories' own floor (more than half of it) accepts; with a sparse graph the neighbourhood, not the round, counts."""
        degree = self.degree(n)
        neighbourhood = min(degree, n - 1) + 1 if degree else n
        return self.cfg.secagg_threshold or default_threshold(neighbourhood)

    # a training round -------------------------------------------------------------------------
    def train(self, plan: RoundPlan, failures: dict[str, str], key_next: bool) -> RoundResult:
        """Every group's FedAvg, the prediction ensemble and the federated figures through one session."""
        cfg = self.cfg
        members = plan.members()
        sends_weights = {m: cfg.distill != "only" and len(members[plan.architecture_of[m]]) >= 2 for m in plan.nodes}
        for arch, group in members.items():
            if len(group) == 1 and cfg.distill != "only":
                log.warning("round %d: %s is the only factory training %s; under secure aggregation it %s", plan.server_round,
                            self.messenger.name(group[0]), arch, "contributes predictions only" if plan.distilling else "cannot contribute this round")
        layout = SecureLayout.of(
            {a: plan.lines[a].num_parameters for a, g in members.items() if any(sends_weights[m] for m in g)},
            len(plan.proxy) * plan.num_classes if plan.distilling and plan.proxy is not None else 0, plan.num_classes,
            confusion=self._evaluated_groups(members), metrics=True)
        if not layout.groups and not layout.predictions:
            raise RoundAborted("no factory can contribute under secure aggregation (groups of one, no distillation)", failures, [])
        arrays = {arch: weights_record(line.weights) for arch, line in plan.lines.items()}  # once per group, not per factory

        def content(node: int) -> RecordDict:
            arch = plan.architecture_of[node]
            return RecordDict({"arrays": arrays[arch], "config": plan.message_config(arch, sends_weights[node])})

        sums, participants, reports, received, phases = self._phase(plan, MessageType.TRAIN, layout, content, cfg.round_timeout, failures, key_next)
        return self._result(plan, layout, sums, participants, reports, received, phases, failures)

    # the evaluate-only phase after the last round --------------------------------------------
    def evaluate(self, plan: RoundPlan, failures: dict[str, str]) -> RoundResult:
        members = plan.members()
        layout = SecureLayout.of({}, 0, plan.num_classes, confusion=self._evaluated_groups(members))
        if not layout.confusion:
            raise RoundAborted("no group has two factories to evaluate its model securely", failures, [])
        arrays = {arch: weights_record(line.weights) for arch, line in plan.lines.items()}

        def content(node: int) -> RecordDict:
            arch = plan.architecture_of[node]
            return RecordDict({"arrays": arrays[arch], "config": plan.message_config(arch, False)})

        sums, participants, reports, received, phases = self._phase(plan, MessageType.EVALUATE, layout, content, self.cfg.round_timeout, failures,
                                                                    key_next=False)
        result = RoundResult(participants=participants, failures=failures, confusion=sums.confusion)
        result.shared = {self.messenger.name(n): s for n, m in reports.items() if (s := shared_of(m))}
        result.metrics = {"secagg-phases": float(phases), "bytes-received": float(received)}
        return result

    def _evaluated_groups(self, members: dict[str, list[int]]) -> list[str]:
        return [a for a, g in members.items() if len(g) >= 2] if self.cfg.federated_evaluation else []

    # one secure phase ---------------------------------------------------------------------------
    def _phase(self, plan: RoundPlan, message_type: str, layout: SecureLayout, content: Callable[[int], RecordDict], timeout: float,
               failures: dict[str, str], key_next: bool) -> tuple[Sums, list[str], dict[int, dict[str, float]], int, int]:
        """Masked messages and the unmask: (sums, participants, the metrics that travelled beside, bytes received, message phases)."""
        cfg, m = self.cfg, self.messenger
        nodes, members = plan.nodes, plan.members()
        keyed = self._take_pipelined(plan.server_round, nodes)
        threshold = keyed.secure.threshold if keyed else self.threshold(len(nodes))
        if len(nodes) < max(threshold, cfg.min_factories):
            raise RoundAborted(f"{len(nodes)} factories connected, secure aggregation needs {max(threshold, cfg.min_factories)}", failures, [])
        phases = 2 if keyed else 4
        try:
            if keyed is None:
                keyed = self._exchange_keys(plan.server_round, nodes, threshold, failures)
            secure, node_of, slot_of = keyed.secure, keyed.node_of, keyed.slot_of
            session = secure.session.decode()
            ahead = self._open_next_session(plan.server_round, nodes) if key_next else None
            # what every factory computes its input under: their pairwise masks cancel only if each received exactly this
            terms = round_terms(dict(content(nodes[0])["config"]), float(cfg.update_clip), float(cfg.secagg_scale), int(cfg.max_weight), layout)

            def masked_message(node: int) -> RecordDict:
                record = content(node)
                boxes = keyed.routed[slot_of[node]]
                fields = MaskedInput(session, secure.u2, float(cfg.update_clip), float(cfg.secagg_scale), int(cfg.max_weight),
                                     list(boxes), list(boxes.values()), layout).to_fields()
                if ahead is not None:  # the next phase's key advertisement rides on this message
                    fields = with_next(fields, {"stage": "advertise", **ahead.advertise_request(node)})
                record[RECORD] = ConfigRecord(fields)
                return record

            present = set(nodes)  # a session member that has disconnected is not sent anything: it counts as dropped
            targets = [node_of[s] for s in secure.u2 if node_of[s] in present]
            replies = m.exchange(targets, message_type, plan.server_round, masked_message, timeout, failures)
            if ahead is not None:
                try:
                    ahead.add_public_keys(_ahead_fields(replies))
                except SecAggAborted as exc:  # never fails this phase: the next one exchanges its own keys
                    log.info("round %d: the next phase will exchange its own keys: %s", plan.server_round, exc)
                    ahead = None
            masked_inputs: dict[int, np.ndarray] = {}
            reports: dict[int, dict[str, float]] = {}
            for node, reply in replies.items():
                try:
                    reports[node] = {k: float(v) for k, v in reply.content["metrics"].items()}
                    masked_inputs[node] = reply.content["arrays"]["masked"].numpy()
                except (KeyError, TypeError, ValueError) as exc:
                    failures[m.name(node)] = f"malformed masked input: {exc}"
            # Malformed vectors are left out first, so that the rule below sees who really contributes.
            for node, masked in list(masked_inputs.items()):
                if masked.dtype != np.uint64 or masked.ndim != 1 or len(masked) != layout.length:
                    failures[m.name(node)] = f"malformed masked input ({masked.dtype}, {masked.shape}; expected uint64 of {layout.length})"
                    del masked_inputs[node]
            # An honest server never unmasks a group's slot (update or confusion matrix) that holds a single factory's values.
            slotted = set(dict(layout.groups)) | set(layout.confusion)
            for arch, group in members.items():
                senders = [n for n in group if n in masked_inputs]
                if arch in slotted and len(senders) == 1:
                    failures[m.name(senders[0])] = f"the only {arch} factory left in the round: its values would be revealed, so it is treated as dropped"
                    del masked_inputs[senders[0]]
            for node, masked in masked_inputs.items():
                try:
                    secure.add_masked_input(slot_of[node], masked)
                except ValueError as exc:
                    failures[m.name(node)] = f"malformed masked input: {exc}"
            survivors, dropped = secure.unmask_request()
            participants = sorted(m.name(node_of[s]) for s in survivors)
            if len(survivors) < cfg.min_factories:
                raise RoundAborted(f"{len(survivors)} masked inputs, {cfg.min_factories} required", failures, participants)

            def unmask_message(node: int) -> RecordDict:
                slot = slot_of[node]  # each factory answers only for its own neighbourhood (SecAgg+ on a sparse graph)
                around = set(secure.graph.get(slot, ())) | {slot}
                fields = Unmask(session, [s for s in survivors if s in around], [d for d in dropped if d in around]).to_fields()
                share = ahead.share_request(node) if ahead is not None else None
                if share is not None:  # the next phase's share distribution rides on this message
                    fields = with_next(fields, {"stage": "share", **share})
                return RecordDict({RECORD: ConfigRecord(fields)})

            replies = m.exchange([node_of[s] for s in survivors], "query.secagg_unmask", plan.server_round, unmask_message, cfg.secagg_timeout, failures)
            if ahead is not None:
                try:
                    self._pipelined = ahead.finish(_ahead_fields(replies))
                except SecAggAborted as exc:
                    log.info("round %d: the next phase will exchange its own keys: %s", plan.server_round, exc)
            total = secure.result(_unmask_answers({slot_of[node]: r for node, r in replies.items()}, failures, m, node_of), terms)
            if cfg.secagg_audit_dir:
                _audit(Path(cfg.secagg_audit_dir), plan.server_round, message_type, total, participants)
            sums = layout.decode(total, cfg.secagg_scale)
        except (SecAggAborted, SumNotValid) as exc:
            raise RoundAborted(str(exc), failures, []) from exc
        received = sum(masked_inputs[node_of[s]].nbytes for s in survivors)
        return sums, participants, {node_of[s]: reports.get(node_of[s], {}) for s in survivors}, received, phases

    def _result(self, plan: RoundPlan, layout: SecureLayout, sums: Sums, participants: list[str], reports: dict[int, dict[str, float]],
                received: int, phases: int, failures: dict[str, str]) -> RoundResult:
        """Turn the one vector the server may see (the sum) into group models, the ensemble and the figures."""
        result = RoundResult(participants=participants, failures=failures, confusion=sums.confusion)
        for arch, (weighted_sum, total_weight) in sums.groups.items():
            if total_weight <= 0:
                continue
            new = apply_group_sum(plan.lines[arch].weights, weighted_sum, total_weight)
            check_like(plan.lines[arch].weights, new, source=f"securely aggregated {arch} model")
            result.group_weights[arch], result.group_examples[arch] = new, total_weight
        if sums.ensemble is not None:
            weighted_sum, count_sum = sums.ensemble
            if count_sum.sum() > 0:  # decoded fixed point is always finite
                result.ensemble, result.ensemble_size = ensemble_of(weighted_sum, count_sum), len(participants)
        names = self.messenger.name
        result.privacy = {names(node): privacy_of(m) for node, m in reports.items() if "epsilon-spent" in m}
        result.shared = {names(node): s for node, m in reports.items() if (s := shared_of(m))}
        result.metrics = {**secure_means(sums.metrics), "total-examples": float(sum(result.group_examples.values())),
                          "bytes-received": float(received), "uplink-bytes-per-factory": float(received) / max(1, len(participants)),
                          "secagg-phases": float(phases)}
        return result

    # keys ---------------------------------------------------------------------------------------
    def _exchange_keys(self, server_round: int, nodes: list[int], threshold: int, failures: dict[str, str]) -> KeyedSession:
        """The two key phases of a session: advertise the public keys, then route the sealed share boxes."""
        exchange = KeyExchange.of(session_id(self.run_id, server_round), nodes, threshold, self.degree(len(nodes)))

        def stage(name: str, request: Any) -> dict[int, dict[str, Any]]:
            requests = {n: fields for n in nodes if (fields := request(n)) is not None}
            replies = self.messenger.exchange(list(requests), f"query.secagg_{name}", server_round,
                                              lambda node: RecordDict({RECORD: ConfigRecord(requests[node])}), self.cfg.secagg_timeout, failures)
            return {node: dict(r.content[RECORD]) for node, r in replies.items() if RECORD in r.content}

        exchange.add_public_keys(stage("advertise", exchange.advertise_request))
        return exchange.finish(stage("share", exchange.share_request))

    def _open_next_session(self, server_round: int, nodes: list[int]) -> KeyExchange:
        """The next phase's session (the next round's, or the final evaluation's), keyed during this one."""
        return KeyExchange.of(session_id(self.run_id, server_round + 1, AHEAD), nodes, self.threshold(len(nodes)), self.degree(len(nodes)))

    def _take_pipelined(self, server_round: int, nodes: list[int]) -> KeyedSession | None:
        """This phase's session if the previous phase keyed it for every node taking part now."""
        keyed, self._pipelined = self._pipelined, None
        if keyed is None or keyed.secure.session != session_id(self.run_id, server_round, AHEAD):
            return None
        if not keyed.covers(nodes):
            log.info("round %d: factories without shares in the prepared session; exchanging keys afresh", server_round)
            return None
        return keyed

    def forget(self) -> None:
        """Drop the prepared session (after an aborted round the next one keys afresh)."""
        self._pipelined = None


def _audit(directory: Path, server_round: int, message_type: str, total: np.ndarray, participants: list[str]) -> None:
    """The unmasked sum (field elements) and who is in it: what the server learns anyway, kept for checking a simulation."""
    directory.mkdir(parents=True, exist_ok=True)
    np.savez(directory / f"round-{server_round}-{message_type}-sum.npz", total=total, participants=np.array(participants))


def _unmask_answers(replies: dict[int, Message], failures: dict[str, str], messenger: Messenger, node_of: dict[int, int]) -> dict[int, Any]:
    """Each responder's (seed shares, key shares) by slot; a malformed answer is a non-answer, noted by factory name."""
    out = {}
    for slot, reply in replies.items():
        try:
            shares = Shares.from_fields(dict(reply.content[RECORD]))
            out[slot] = (shares.seeds(), shares.keys())
        except (KeyError, MessageError) as exc:
            failures[messenger.name(node_of[slot])] = f"malformed unmask answer: {exc}"
    return out


def _ahead_fields(replies: dict[int, Message]) -> dict[int, dict[str, Any]]:
    """The next session's stage answers that rode on these replies (in their ``info`` record), by node."""
    riding = {node: split_next(dict(r.content["info"]))[1] for node, r in replies.items() if "info" in r.content}
    return {node: fields for node, fields in riding.items() if fields}
