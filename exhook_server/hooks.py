"""The ExHook `HookProvider` servicer: EMQX's side of the wire ends here.

One servicer answers both `emqx.exhook.v2` (EMQX 5.0-5.8) and `emqx.exhook.v3`
(5.9+, 6.x). v3 messages are a superset of v2 on the wire (same numbers, a few
added fields), so both services parse with the v3 classes and answer with
byte-identical responses. Every RPC answers: EmptySuccess for notify hooks,
IGNORE for valued ones unless the product has an opinion.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, NoReturn

import grpc
import structlog
from google.protobuf import message_factory

from exhook_server import decoding, metrics
from exhook_server._proto import exhook_v2_pb2, exhook_v3_pb2
from exhook_server.admission import IngestBudget
from exhook_server.config import Config
from exhook_server.dispatch.commands import EndReason, Session
from exhook_server.dispatch.port import Dispatch
from exhook_server.errors import StorageError
from exhook_server.hookset import HookSetWatch, hook_of
from exhook_server.ingest import Ingestor
from exhook_server.topics import RequestTopics, TopicTemplate
from storage.model import now_ms, sha1_of

pb = exhook_v3_pb2

log = structlog.get_logger("sdv_fanout.hooks")

SERVICE_NAMES = ("emqx.exhook.v2.HookProvider", "emqx.exhook.v3.HookProvider")

#: The 19 hook points EMQX 5/6 knows. One other name in OnProviderLoaded's answer
#: and EMQX refuses the whole server (`unknown_hookpoint`).
VALID_HOOKS = frozenset(
    {
        "client.connect",
        "client.connack",
        "client.connected",
        "client.disconnected",
        "client.authenticate",
        "client.authorize",
        "client.subscribe",
        "client.unsubscribe",
        "session.created",
        "session.subscribed",
        "session.unsubscribed",
        "session.resumed",
        "session.discarded",
        "session.takenover",
        "session.terminated",
        "message.publish",
        "message.delivered",
        "message.acked",
        "message.dropped",
    }
)

#: The four hooks for which EMQX honours HookSpec.topics.
MESSAGE_HOOKS = frozenset({"message.publish", "message.delivered", "message.acked", "message.dropped"})


def hook_specs(cfg: Config) -> list[tuple[str, list[str]]]:
    """The hooks this server asks EMQX for, with topic filters so only our topics cost a call.

    `client.authenticate` / `client.authorize` are never registered: an
    all-IGNORE answer to them has refused every client on a real EMQX 5.1.
    """
    # Over MQTT (vehicle_events), heartbeats and answers reach us through our shared
    # subscription (`events`) and PUBACKs through the ack rule: no call of EMQX's for them.
    heartbeats, responses = ([], []) if cfg.events_over_mqtt else vehicle_event_filters(cfg)
    specs = [
        # Presence: who is connected, subscribed, resumed, gone.
        ("client.connected", []),
        ("client.disconnected", []),
        ("session.subscribed", []),
        ("session.resumed", []),
        ("session.discarded", []),
        ("session.takenover", []),
        ("session.terminated", []),
        (
            "message.publish",
            # `<prefix>/#` rather than `/+`: a malformed multi-level data_id reaches us
            # and is rejected with a reason instead of being silently routed.
            [
                cfg.batch_topic,
                cfg.data_topic_prefix + "/#",
                cfg.trigger_topic,
                cfg.cancel_topic,
                cfg.policy_topic,
                *heartbeats,
                *responses,
            ],
        ),
    ]
    if not cfg.rule_ack_topic_prefix:  # else an EMQX rule republishes them to the delivery client (acks.py)
        # PUBACKs of deliveries only.
        specs.append(("message.acked", [RequestTopics(cfg.request_topic_prefix).filter]))
    return specs


def vehicle_event_filters(cfg: Config) -> tuple[list[str], list[str]]:
    """The topic filters of vehicles' heartbeats and of their answers (none when responses are off)."""
    heartbeats = [TopicTemplate(t).filter for t in cfg.heartbeat_topics]
    responses = [RequestTopics(cfg.response_topic_prefix).filter] if cfg.response_topic_prefix else []
    return heartbeats, responses


def session_of(info: Any) -> Session:
    """The connection identity in a ClientInfo."""
    return Session(info.node, info.clientid, info.peerhost, info.peerport)


def _publisher(msg: Any) -> Session:
    """The connection that published `msg` (a message carries no peer port)."""
    return Session(msg.node, getattr(msg, "from"), msg.headers.get("peerhost", ""))


def _end_reason(reason: str) -> EndReason:
    if reason == "takenover":
        return EndReason.TAKENOVER
    if reason == "discarded":
        return EndReason.DISCARDED
    return EndReason.OFFLINE


_EMPTY = pb.EmptySuccess()
_IGNORE = pb.ValuedResponse(type=pb.ValuedResponse.IGNORE)


def _rpc_names() -> Iterator[tuple[str, Any, Any]]:
    service = pb.DESCRIPTOR.services_by_name["HookProvider"]
    for method in service.methods:
        yield (
            method.name,
            message_factory.GetMessageClass(method.input_type),
            message_factory.GetMessageClass(method.output_type),
        )


class HookServicer:
    """Answers every ExHook RPC; hands batch messages to the Ingestor."""

    def __init__(
        self, cfg: Config, ingestor: Ingestor, dispatcher: Dispatch, watch: HookSetWatch | None = None
    ) -> None:
        self._cfg = cfg
        self._ingestor = ingestor
        self._dispatch = dispatcher
        self._requests = RequestTopics(cfg.request_topic_prefix)
        self._heartbeats = [TopicTemplate(t) for t in cfg.heartbeat_topics]
        self._responses = RequestTopics(cfg.response_topic_prefix) if cfg.response_topic_prefix else None
        self._delivery_prefix = cfg.mqtt_clientid_prefix
        self._specs = [pb.HookSpec(name=name, topics=topics) for name, topics in hook_specs(cfg)]
        #: Calls for hooks or topics we did not ask for: EMQX holds an older hook list.
        self.watch = watch or HookSetWatch(cfg, dict(hook_specs(cfg)), bytearray(1))
        #: Caps the payload bytes of batch calls in progress (see `admission`).
        self.budget = IngestBudget(cfg.max_ingest_inflight_bytes)
        self._calls = {
            (name, outcome): metrics.HOOK_CALLS.labels(name, outcome)
            for name, _, _ in _rpc_names()
            for outcome in ("ok", "ignored", "stored", "rejected", "refused", "error")
        }

    # -- lifecycle -------------------------------------------------------------
    async def OnProviderLoaded(
        self, request: pb.ProviderLoadedRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadedResponse:
        log.info(
            "provider_loaded",
            broker_version=request.broker.version,
            node=request.meta.node,
            cluster=request.meta.cluster_name,
            hooks=[s.name for s in self._specs],
        )
        uptime_ms, node = request.broker.uptime, request.meta.node
        if uptime_ms > 0 and node:
            try:
                await self._dispatch.node_started(node, now_ms() - uptime_ms)
            except Exception:  # the load must not fail on it: the vehicles' hooks still tell us
                log.exception("node_start_check_failed", node=node)
        self._calls["OnProviderLoaded", "ok"].inc()
        self.watch.confirm()
        return pb.LoadedResponse(hooks=self._specs)

    async def OnProviderUnloaded(
        self, request: pb.ProviderUnloadedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmptySuccess:
        log.info("provider_unloaded", node=request.meta.node, cluster=request.meta.cluster_name)
        self._calls["OnProviderUnloaded", "ok"].inc()
        return _EMPTY

    # -- the batch path ----------------------------------------------------------
    async def OnMessagePublish(
        self, request: pb.MessagePublishRequest | decoding.Overloaded, context: grpc.aio.ServicerContext
    ) -> pb.ValuedResponse:
        if isinstance(request, decoding.Overloaded):  # too large to fit the budget: not even parsed
            self.budget.turn_away(request.size)
            await self._refuse_overloaded(context)
        msg = request.message
        kind = self._ingestor.parser.classify(msg.topic)
        if kind is None:
            # Heartbeats and answers are published on normally (IGNORE); the work happens
            # behind the answer.
            self._vehicle_message(msg)
            self._calls["OnMessagePublish", "ignored"].inc()
            return _IGNORE
        payload = msg.payload
        # An oversize payload (rejected payload_too_large before any parse) is charged the whole
        # budget at most, so an idle server still answers it with that reason code.
        charged = self.budget.charge(len(payload))
        if not self.budget.try_acquire(charged):
            await self._refuse_overloaded(context)
        try:
            stored = await self._ingestor.ingest(
                kind, msg.topic, payload, getattr(msg, "from"), msg.headers.get("username", "")
            )
        except StorageError as exc:
            self._calls["OnMessagePublish", "error"].inc()
            # EMQX counts the failure in its exhook metrics and applies failed_action.
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"batch not stored: {exc}")
            raise  # unreachable: abort raises
        finally:
            self.budget.release(charged)
        self._calls["OnMessagePublish", "stored" if stored else "rejected"].inc()
        # Stopped and not routed either way: batch topics are for us, never for subscribers.
        # EMQX copies topic, qos and payload back from this message, so echo all of it.
        reply = pb.ValuedResponse(type=pb.ValuedResponse.STOP_AND_RETURN, message=msg)
        reply.message.headers["allow_publish"] = "false"
        return reply

    def _vehicle_message(self, msg: Any) -> None:
        """A heartbeat proves presence; an answer on the response topic may end a request."""
        for template in self._heartbeats:
            vin = template.vin(msg.topic)
            if vin is not None:
                metrics.HEARTBEATS.inc()
                self._dispatch.heartbeat(_publisher(msg), vin)
                return
        if self._responses is not None and (parsed := self._responses.parse_delivery(msg.topic)) is not None:
            vin, request_id = parsed
            sender = _publisher(msg)
            payload = msg.payload
            self._dispatch.responded(sender, vin, request_id, payload[: self._cfg.max_response_bytes], len(payload))
            return
        self.watch.unexpected_topic("OnMessagePublish", msg.topic)

    async def _refuse_overloaded(self, context: grpc.aio.ServicerContext) -> NoReturn:
        self._calls["OnMessagePublish", "refused"].inc()
        # At once, not queued: a queue would hold every waiting payload. EMQX counts a failed call.
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"ingest busy: {self.budget.in_use} payload bytes in progress, limit {self.budget.limit_bytes}",
        )
        raise AssertionError("unreachable: abort raises")

    # -- presence and acks: answer at once, work behind the answer ----------------
    async def OnClientConnected(
        self, request: pb.ClientConnectedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmptySuccess:
        self._dispatch.connected(session_of(request.clientinfo))
        self._calls["OnClientConnected", "ok"].inc()
        return _EMPTY

    async def OnClientDisconnected(
        self, request: pb.ClientDisconnectedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmptySuccess:
        self._dispatch.ended(session_of(request.clientinfo), _end_reason(request.reason))
        self._calls["OnClientDisconnected", "ok"].inc()
        return _EMPTY

    async def OnSessionSubscribed(
        self, request: pb.SessionSubscribedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmptySuccess:
        vin = self._requests.subscribed_vin(request.topic)
        if vin is not None:
            self._dispatch.subscribed(session_of(request.clientinfo), vin)
        self._calls["OnSessionSubscribed", "ok"].inc()
        return _EMPTY

    async def OnSessionResumed(
        self, request: pb.SessionResumedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmptySuccess:
        self._dispatch.resumed(session_of(request.clientinfo))
        self._calls["OnSessionResumed", "ok"].inc()
        return _EMPTY

    async def OnSessionDiscarded(
        self, request: pb.SessionDiscardedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmptySuccess:
        self._dispatch.ended(session_of(request.clientinfo), EndReason.DISCARDED)
        self._calls["OnSessionDiscarded", "ok"].inc()
        return _EMPTY

    async def OnSessionTakenover(
        self, request: pb.SessionTakenoverRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmptySuccess:
        self._calls["OnSessionTakenover", "ok"].inc()  # the session lives on: nothing to do
        return _EMPTY

    async def OnSessionTerminated(
        self, request: pb.SessionTerminatedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmptySuccess:
        self._dispatch.ended(session_of(request.clientinfo), EndReason.TERMINATED)
        self._calls["OnSessionTerminated", "ok"].inc()
        return _EMPTY

    async def OnMessageAcked(
        self, request: pb.MessageAckedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmptySuccess:
        msg = request.message
        parsed = self._requests.parse_delivery(msg.topic)
        # Only PUBACKs of our own deliveries count; another publisher on the topic is not ours.
        if parsed is None:
            self.watch.unexpected_topic("OnMessageAcked", msg.topic)
        elif getattr(msg, "from").startswith(self._delivery_prefix):
            vin, request_id = parsed
            self._dispatch.acked(session_of(request.clientinfo), vin, request_id, sha1_of(msg.payload))
        self._calls["OnMessageAcked", "ok"].inc()
        return _EMPTY

    # -- hooks without an opinion ------------------------------------------------
    def handler(self, name: str, response_cls: Any) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
        """The coroutine answering RPC `name`: ours, or a counted EmptySuccess / IGNORE; for a hook
        we did not ask for, the same after reporting the call to `watch`."""
        answer_it = self._handler(name, response_cls)
        if name in ("OnProviderLoaded", "OnProviderUnloaded") or hook_of(name) in self.watch.wanted:
            return answer_it
        watch = self.watch

        async def not_asked_for(request: Any, context: grpc.aio.ServicerContext) -> Any:
            watch.unexpected_call(name)
            return await answer_it(request, context)

        return not_asked_for

    def _handler(self, name: str, response_cls: Any) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
        own: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]] | None = getattr(self, name, None)
        latency = metrics.HOOK_SECONDS.labels(name)
        if own is not None:
            fn = own

            async def timed(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if type(request) is decoding.Malformed:
                    await decoding.refuse(name, request, context)
                started = time.perf_counter()
                try:
                    return await fn(request, context)
                finally:
                    latency.observe(time.perf_counter() - started)

            return timed
        valued = response_cls is pb.ValuedResponse
        counter = self._calls[name, "ignored" if valued else "ok"]
        answer = _IGNORE if valued else _EMPTY

        async def no_opinion(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if type(request) is decoding.Malformed:
                await decoding.refuse(name, request, context)
            counter.inc()
            latency.observe(0.0)
            return answer

        return no_opinion


def method_handlers(servicer: HookServicer) -> dict[str, dict[str, grpc.RpcMethodHandler]]:
    """Service name → method handlers; both services are backed by the same servicer and v3 classes.

    Registered (not generic) handlers: grpc.aio then accepts calls per method, instead of one
    generic call at a time for the whole server, which queued hook calls under load.
    """
    # Importing v2 registers its descriptors, so reflection can describe emqx.exhook.v2.
    assert exhook_v2_pb2.DESCRIPTOR.package == "emqx.exhook.v2"
    methods = {
        name: grpc.unary_unary_rpc_method_handler(
            servicer.handler(name, response_cls),
            request_deserializer=decoding.deserializer(
                request_cls, servicer.budget.fits if name == "OnMessagePublish" else None
            ),
            response_serializer=response_cls.SerializeToString,
        )
        for name, request_cls, response_cls in _rpc_names()
    }
    return {service: methods for service in SERVICE_NAMES}
