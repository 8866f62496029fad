"""FedForge ClientApp: thin by design. It imports no torch and forwards each message to the agent.

SuperNode starts this in a fresh process per message, so anything heavy here is paid every round.
With ``agent-address`` in the node config (``--node-config "agent-address='127.0.0.1:50061'"``) the
message goes over local gRPC to the warm edge agent. Under Flower's Simulation Engine (``fedforge
simulate``: a ``partition-id`` and no agent) each virtual factory's servicer runs in-process
(``client.simulation``); otherwise, without an agent, one servicer built from the node config does (tests).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import grpc
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from google.protobuf import struct_pb2

from client import simulation
from common.rpc.fedforge.v1 import edge_pb2, edge_pb2_grpc
from common.secagg.messages import RECORD, STAGES, split_next, with_next
from common.secagg.wire import from_values, to_values
from common.tensors import from_tensor, to_tensor
from common.wire import record_of_tensors, tensors_of_record

app = ClientApp()
log = logging.getLogger("fedforge.client")

_GRPC_OPTIONS = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]
_in_process: Any = None


class AgentUnavailable(RuntimeError):
    """The factory's edge agent did not answer; the server counts this factory as failed."""


def _agent(context: Context) -> Any:
    """A stub for the configured agent, or the in-process servicer (same methods) when none is set."""
    address = str(context.node_config.get("agent-address", ""))
    if address:
        return edge_pb2_grpc.EdgeAgentStub(grpc.insecure_channel(address, options=_GRPC_OPTIONS))
    if simulation.is_virtual(dict(context.node_config)):
        return _InProcess(simulation.servicer(dict(context.node_config), dict(context.run_config)))
    global _in_process
    if _in_process is None:
        from client.agent import EdgeAgentServicer  # torch is only imported on this path
        from client.config import AgentConfig
        from client.trainer import FactoryTrainer

        fields = {k.replace("-", "_"): v for k, v in context.node_config.items()}
        _in_process = _InProcess(EdgeAgentServicer(FactoryTrainer(AgentConfig(**fields))))
    return _in_process


class _InProcess:
    """Calls the servicer directly with the same request messages a remote agent would get."""

    def __init__(self, servicer: Any) -> None:
        self.servicer = servicer

    def __getattr__(self, rpc: str) -> Any:
        method = getattr(self.servicer, rpc)
        return lambda request, timeout=None: method(request, _RaisingContext())


class _RaisingContext:
    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RuntimeError(f"{code.name}: {details}")


def _request_parts(msg: Message) -> tuple[list[edge_pb2.Tensor], struct_pb2.Struct, int]:
    tensors = tensors_of_record(msg.content["arrays"], "the server's model")  # checked again by the agent
    config = dict(msg.content["config"]) if "config" in msg.content else {}
    struct = struct_pb2.Struct()
    struct.update(config)
    return tensors, struct, int(config.get("server-round", 0))


def _call(context: Context, rpc: str, request: Any) -> Any:
    timeout = float(context.run_config.get("agent-timeout", 600.0))
    try:
        return getattr(_agent(context), rpc)(request, timeout=timeout)
    except grpc.RpcError as err:
        address = context.node_config.get("agent-address", "")
        factory = context.node_config.get("factory-id", "?")
        raise AgentUnavailable(f"factory {factory}: edge agent at {address} failed {rpc}: {err.code().name}: {err.details()}") from err


def _drop_if_simulated(context: Context, server_round: int, stage: str) -> None:
    """Under ``fedforge simulate --dropout``: this virtual factory fails at ``stage`` if the simulation says so."""
    if simulation.is_virtual(dict(context.node_config)):
        simulation.check_dropout(dict(context.node_config), dict(context.run_config), server_round, stage)


def _round_of(msg: Message) -> int:
    return int(msg.metadata.group_id) if msg.metadata.group_id.isdigit() else 0


def _secagg(context: Context, stage: str, fields: dict[str, Any], server_round: int) -> edge_pb2.SecAggReply:
    _drop_if_simulated(context, server_round, stage)
    request = edge_pb2.SecAggRequest(run_id=str(context.run_id), stage=stage, fields=to_values(fields))
    return _call(context, "SecAgg", request)


_AHEAD_STAGES = ("advertise", "share")


def _secagg_fields(msg: Message) -> dict[str, Any]:
    """This phase's secure-aggregation fields, without the next session's stage that may ride along."""
    return split_next(dict(msg.content[RECORD]))[0] if RECORD in msg.content else {}


def _next_session_stage(msg: Message, context: Context) -> dict[str, Any]:
    """Run the next round's key stage that rides on this message, if any (the server pipelines key exchange);
    its answer, to ride on the reply's ``info`` record.

    A failure here only means this factory is not in the next round's prepared session (the server then
    exchanges keys afresh), so it is logged and never fails the message it rode on.
    """
    fields = split_next(dict(msg.content[RECORD]))[1] if RECORD in msg.content else {}
    if not fields:
        return {}
    stage = str(fields.pop("stage", ""))
    if stage not in _AHEAD_STAGES:
        log.warning("ignored a next-round secure-aggregation stage %r (expected one of %s)", stage, _AHEAD_STAGES)
        return {}
    try:
        reply = _secagg(context, stage, fields, _round_of(msg))
    except RuntimeError as exc:  # AgentUnavailable, or the in-process servicer's refusal
        log.warning("next round's secure-aggregation %s failed; this factory joins the next round's own key exchange: %s", stage, exc)
        return {}
    return with_next({}, from_values(reply.fields))


@app.train()
def train(msg: Message, context: Context) -> Message:
    ahead = _next_session_stage(msg, context)
    tensors, config, server_round = _request_parts(msg)
    _drop_if_simulated(context, server_round, "train")
    secagg = to_values(_secagg_fields(msg))
    request = edge_pb2.TrainRequest(run_id=str(context.run_id), server_round=server_round, weights=tensors, config=config, secagg=secagg)
    reply = _call(context, "Train", request)
    if reply.HasField("masked"):  # secure round: the masked vector is all that leaves the factory
        arrays = ArrayRecord(OrderedDict(masked=Array(from_tensor(reply.masked))))
        metrics = MetricRecord(dict(reply.metrics))
    else:
        arrays = record_of_tensors(reply.weights)
        metrics = MetricRecord({**dict(reply.metrics), "num-examples": int(reply.num_examples)})
    content = RecordDict({"arrays": arrays, "metrics": metrics, "info": ConfigRecord({"factory-id": reply.factory_id, **ahead})})
    if reply.HasField("predictions"):
        content["predictions"] = ArrayRecord(OrderedDict(
            probabilities=Array(from_tensor(reply.predictions)), **{"class-counts": Array(from_tensor(reply.class_counts))}))
    if reply.HasField("confusion"):
        content["evaluation"] = ArrayRecord(OrderedDict(confusion=Array(from_tensor(reply.confusion))))
    return Message(content=content, reply_to=msg)


@app.query("describe")
def describe(msg: Message, context: Context) -> Message:
    """Who this factory is, which model it trains, and whether its classes fit the run's list."""
    config = struct_pb2.Struct()
    config.update(dict(msg.content["config"]) if "config" in msg.content else {})
    reply = _call(context, "Describe", edge_pb2.DescribeRequest(config=config, run_id=str(context.run_id)))
    info = ConfigRecord({"factory-id": reply.factory_id, "architecture": reply.architecture, "fits": bool(reply.fits), "reason": reply.reason,
                         "data-source": reply.data_source, "dp": bool(reply.dp), **({"class-counts": list(reply.class_counts)} if reply.class_counts else {}),
                         **({"personalizes": bool(reply.personalizes)} if reply.HasField("personalizes") else {})})
    return Message(content=RecordDict({"info": info}), reply_to=msg)


@app.query("proxy")
def proxy(msg: Message, context: Context) -> Message:
    """Receive the distillation proxy set by content hash: the images come only if the agent lacks them."""
    request = edge_pb2.ProxyRequest(sha256=str(msg.content["proxy"]["sha256"]))
    if "images" in msg.content:
        request.images.CopyFrom(to_tensor("images", msg.content["images"]["images"].numpy()))
    reply = _call(context, "Proxy", request)
    info = ConfigRecord({"factory-id": reply.factory_id})
    return Message(content=RecordDict({"info": info, "proxy": ConfigRecord({"have": bool(reply.have)})}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    ahead = _next_session_stage(msg, context)
    tensors, config, server_round = _request_parts(msg)
    secagg = to_values(_secagg_fields(msg))
    request = edge_pb2.EvaluateRequest(run_id=str(context.run_id), server_round=server_round, weights=tensors, config=config, secagg=secagg)
    reply = _call(context, "Evaluate", request)
    content = RecordDict({"metrics": MetricRecord({**dict(reply.metrics), "num-examples": int(reply.num_examples)}),
                          "info": ConfigRecord({"factory-id": reply.factory_id, **ahead})})
    if reply.HasField("masked"):
        content["arrays"] = ArrayRecord(OrderedDict(masked=Array(from_tensor(reply.masked))))
    elif reply.HasField("confusion"):
        content["evaluation"] = ArrayRecord(OrderedDict(confusion=Array(from_tensor(reply.confusion))))
    return Message(content=content, reply_to=msg)


def _secagg_stage(stage: str):  # type: ignore[no-untyped-def]
    def handle(msg: Message, context: Context) -> Message:
        reply = _secagg(context, stage, _secagg_fields(msg), _round_of(msg))
        ahead = _next_session_stage(msg, context)
        content = RecordDict({RECORD: ConfigRecord(from_values(reply.fields)), "info": ConfigRecord({"factory-id": reply.factory_id, **ahead})})
        return Message(content=content, reply_to=msg)
    return handle


for _stage in STAGES:
    app.query(f"secagg_{_stage}")(_secagg_stage(_stage))
