"""The `sdv.fanout.v1.Admin` service: what an operator asks a running server, through grpcurl.

Read-only views of the store (stats, a vehicle's queue and outcomes, each request's
generations) and of the dispatch state, plus two actions (GC now, requeue one vehicle). It runs
on the event loop that owns the dispatch state, so reads need no locks; the store is read through
its `Reads` port (LMDB or PostgreSQL; LMDB's scans run in a thread, off that loop); with several
server processes, the state other processes own is asked for over local IPC.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import orjson
from google.protobuf import message_factory

from exhook_server._proto import admin_pb2 as apb
from exhook_server.batch import Cancel, Kind, PolicyDoc
from exhook_server.config import Config
from exhook_server.dispatch.commands import Session
from exhook_server.dispatch.port import Dispatch
from exhook_server.errors import BatchRejected, Reason, StorageError
from exhook_server.forecast import PendingVins, count_online, forecast
from exhook_server.housekeeping import run_gc
from exhook_server.ingest import Ingestor
from exhook_server.lanes import in_delivery_order
from exhook_server.policy import Policy
from storage.latency import latency_ms
from storage.lmdb import outcomes
from storage.model import now_ms
from storage.port import Reads

SERVICE_NAME = "sdv.fanout.v1.Admin"
_MAX_PAGE = 10_000
_DEFAULT_OUTCOMES = 20
_MAX_OUTCOMES = 1000


def _session(s: Session) -> apb.Session:
    return apb.Session(node=s.node, clientid=s.clientid, peerhost=s.peerhost, peerport=s.peerport)


def generation_message(g: outcomes.Generation) -> apb.Generation:
    """A stored generation as the Admin API shows it (`sdv-fanout request` shows the same)."""
    return apb.Generation(
        request_id=g.request_id,
        sha1=g.sha1.hex(),
        counts=apb.Counts(**g.counts),
        first_ms=g.first_ms,
        last_ms=g.last_ms,
    )


def outcome_message(o: outcomes.OutcomeRecord) -> apb.Outcome:
    return apb.Outcome(
        request_id=o.request_id,
        sha1=o.sha1.hex(),
        outcome=o.outcome.label,
        ts_ms=o.ts_ms,
        stored_ms=o.stored_ms,
        attempts=o.attempts,
        response=o.response,
    )


def page_token(place: outcomes.PageKey) -> str:
    """`ListRequests`' token: the place of the last generation shown (its last change and key),
    so the next page starts right after it whatever was added or collected in between."""
    return f"{place[0]}.{place[1].hex()}"


def page_place(token: str) -> outcomes.PageKey:
    """The place a `page_token` names; ValueError when it is not one."""
    ms, _, key = token.partition(".")
    return int(ms), bytes.fromhex(key)


class AdminServicer:
    """Implements sdv.fanout.v1.Admin over the running server's parts."""

    def __init__(
        self,
        cfg: Config,
        reads: Reads,
        dispatcher: Dispatch,
        mqtt_connected: Callable[[], bool],
        ingestor: Ingestor | None = None,
        pending_vins: PendingVins | None = None,
        clock: Callable[[], int] = now_ms,
    ) -> None:
        self._cfg = cfg
        self._reads = reads
        self._dispatch = dispatcher
        self._mqtt_connected = mqtt_connected
        self._ingestor = ingestor
        #: R's pending VINs (Writes.pending_vins), for the forecast's walk on LMDB; None: none.
        self._pending_vins = pending_vins
        self._clock = clock

    async def GetStats(self, request: apb.GetStatsRequest, context: grpc.aio.ServicerContext) -> apb.Stats:
        stats = await self._reads.stats()
        online, in_flight, backlog = await self._dispatch.group_totals()
        return apb.Stats(
            rows=stats.rows,
            blobs=stats.blobs,
            blob_bytes=stats.blob_bytes,
            logical_bytes=stats.logical_bytes,
            dedup_ratio=stats.dedup_ratio,
            aliases=stats.aliases,
            early_triggers=stats.early_triggers,
            map_size_bytes=stats.map_size_bytes,
            map_used_bytes=stats.map_used_bytes,
            schema_version=stats.schema_version,
            online_vehicles=online,
            in_flight=in_flight,
            dispatch_backlog=backlog,
            mqtt_connected=self._mqtt_connected(),
        )

    async def GetVehicle(self, request: apb.GetVehicleRequest, context: grpc.aio.ServicerContext) -> apb.Vehicle:
        vin = request.vin
        out = apb.Vehicle(vin=vin, worker=self._dispatch.ring.owner(vin))
        # With several server processes, the owning one holds presence and in-flight state.
        session, entry = await self._dispatch.vehicle_state(vin)
        if session is not None:
            out.online = True
            out.session.CopyFrom(_session(session))
        if entry is not None:
            now = time.monotonic()
            out.in_flight.CopyFrom(
                apb.InFlight(
                    request_id=entry.request_id,
                    sha1=entry.sha1.hex(),
                    session=_session(entry.session),
                    age_ms=int((now - entry.sent_at) * 1000),
                    attempts=entry.attempts,
                    await_response=entry.await_response,
                    acked_age_ms=0 if entry.acked_at is None else max(1, int((now - entry.acked_at) * 1000)),
                    cancelled=entry.cancelled,
                )
            )
        rows, ended = await self._reads.vehicle(vin, min(request.outcomes_limit or _DEFAULT_OUTCOMES, _MAX_OUTCOMES))
        for row, high in await in_delivery_order(self._reads, rows):
            out.pending.add(
                request_id=row.request_id,
                ts_ms=row.ts_ms,
                sha1=row.sha1.hex(),
                size=row.size,
                expires_at_ms=row.expires_ms,
                await_response=row.await_response,
                priority="high" if high else "normal",
            )
        out.outcomes.extend(outcome_message(o) for o in ended)
        out.backlog = len(rows)
        bound = self._cfg.max_pending_per_vehicle
        out.at_backlog_bound = bool(bound) and len(rows) >= bound
        return out

    async def ListOnline(
        self, request: apb.ListOnlineRequest, context: grpc.aio.ServicerContext
    ) -> apb.ListOnlineResponse:
        size = min(request.page_size or 100, _MAX_PAGE)
        vins = await self._dispatch.group_online()
        start = bisect.bisect_right(vins, request.page_token) if request.page_token else 0
        page = vins[start : start + size]
        more = start + size < len(vins)
        return apb.ListOnlineResponse(vins=page, next_page_token=page[-1] if more and page else "", total=len(vins))

    async def TriggerGC(self, request: apb.TriggerGCRequest, context: grpc.aio.ServicerContext) -> apb.GCReport:
        report = await run_gc(self._cfg, self._reads, dry_run=request.dry_run)
        return apb.GCReport(**report.as_dict())

    async def Requeue(self, request: apb.RequeueRequest, context: grpc.aio.ServicerContext) -> apb.RequeueResponse:
        session, entry = await self._dispatch.vehicle_state(request.vin)
        answer = apb.RequeueResponse(was_in_flight=entry is not None, online=session is not None)
        self._dispatch.requeue(request.vin)
        return answer

    async def GetRequest(self, request: apb.GetRequestRequest, context: grpc.aio.ServicerContext) -> apb.RequestStatus:
        found = await self._reads.generations(request.request_id)
        if not found:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no generation of request {request.request_id!r} is stored")
        latency = await self._reads.latency(request.request_id)
        shown = []
        for g in found:
            message = generation_message(g)
            for stage, values in latency_ms(latency.get(g.sha1, {})).items():
                getattr(message.latency_ms, stage).CopyFrom(apb.Percentiles(**values))
            shown.append(message)
        return apb.RequestStatus(request_id=request.request_id, generations=shown)

    async def ListRequests(
        self, request: apb.ListRequestsRequest, context: grpc.aio.ServicerContext
    ) -> apb.ListRequestsResponse:
        size = min(request.page_size or 100, _MAX_PAGE)
        try:
            after = page_place(request.page_token) if request.page_token else None
        except ValueError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "page_token is not one this server gave")
        page, last, total = await self._reads.generations_page(size, after)
        return apb.ListRequestsResponse(
            generations=map(generation_message, page),
            next_page_token=page_token(last) if last else "",
            total=total,
        )

    async def Cancel(self, request: apb.CancelRequest, context: grpc.aio.ServicerContext) -> apb.CancelResponse:
        """The cancel topic's job, for an operator: validated the same way, answered when done."""
        if self._ingestor is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server cannot cancel")
        assert self._ingestor is not None
        doc: dict[str, Any] = {"request_id": request.request_id}
        if request.vins:
            doc["ids"] = list(request.vins)
        try:
            parsed = self._ingestor.parser.parse(Kind.CANCEL, self._cfg.cancel_topic, orjson.dumps(doc))
        except BatchRejected as rej:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(rej))
        assert isinstance(parsed, Cancel)
        # Like GetRequest: an id nothing was ever stored under is an answer (NOT_FOUND), not "0 cancelled".
        if not await self._reads.generations(parsed.request_id):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no generation of request {parsed.request_id!r} is stored")
        try:
            task = await self._ingestor.cancels.cancel(parsed.request_id, parsed.vins)
            result = await task
        except StorageError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cancel not finished: {exc}")
        return apb.CancelResponse(cancelled=result.cancelled, in_flight=result.in_flight)

    async def SetPolicy(self, request: apb.SetPolicyRequest, context: grpc.aio.ServicerContext) -> apb.Policy:
        """The policy topic's job, for an operator: validated the same way, answered when durable."""
        if self._ingestor is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server cannot set policies")
        assert self._ingestor is not None
        try:
            fields = orjson.loads(request.policy or "{}")
        except orjson.JSONDecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{Reason.INVALID_JSON.value}: {exc}")
        if not isinstance(fields, dict):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{Reason.WRONG_TYPE.value}: policy must be an object"
            )
        doc = {**fields, "request_id": request.request_id}
        try:
            parsed = self._ingestor.parser.parse(Kind.POLICY, self._cfg.policy_topic, orjson.dumps(doc))
            assert isinstance(parsed, PolicyDoc)
            await self._ingestor.campaigns.apply(parsed, self._ingestor.status)
        except BatchRejected as rej:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if rej.reason is Reason.POLICIES_FULL else None
            await context.abort(code or grpc.StatusCode.INVALID_ARGUMENT, str(rej))
        except StorageError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"policy not stored: {exc}")
        return await self._policy_message(request.request_id)

    async def GetPolicy(self, request: apb.GetPolicyRequest, context: grpc.aio.ServicerContext) -> apb.Policy:
        answer = await self._policy_message(request.request_id)
        if not answer.set_ms:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request {request.request_id!r} has no policy in force")
        return answer

    async def Forecast(self, request: apb.ForecastRequest, context: grpc.aio.ServicerContext) -> apb.ForecastReply:
        """When R's rows of vehicles online now will all have been sent under its policy."""
        rid = request.request_id
        walk = None
        if self._pending_vins is not None:
            pending_vins = self._pending_vins

            async def walk() -> int:
                return await count_online(rid, pending_vins, self._dispatch.online_among)

        now = self._clock()
        found = await forecast(self._reads, rid, now, walk)
        if found is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no generation of request {rid!r} is stored")
        assert found is not None
        return apb.ForecastReply(
            request_id=rid,
            pending=found.pending,
            online_now=found.pending if found.online_now is None else found.online_now,
            completes_at_ms=found.completes_at_ms or 0,
            policy=found.policy.decode(),
            set_ms=found.set_ms,
            now_ms=now,
        )

    async def _policy_message(self, request_id: str) -> apb.Policy:
        stored = await self._reads.policy(request_id)
        if stored is None:
            return apb.Policy(request_id=request_id)
        aborted = "" if stored.aborted is None else stored.aborted.decode()
        pacing = ""
        if _paces(stored.doc):
            out, started, scope = await self._dispatch.pacing_of(request_id)
            pacing = orjson.dumps({"in_flight": out, "started_last_minute": started, "scope": scope}).decode()
        return apb.Policy(
            request_id=request_id, policy=stored.doc.decode(), set_ms=stored.set_ms, aborted=aborted, pacing=pacing
        )


def _paces(doc: bytes) -> bool:
    """Whether a stored policy bounds its request's rate or concurrency (one this build cannot
    read bounds nothing here)."""
    try:
        return Policy.decode(doc).paces
    except Exception:
        return False


def method_handlers(servicer: AdminServicer) -> dict[str, grpc.RpcMethodHandler]:
    service = apb.DESCRIPTOR.services_by_name["Admin"]
    methods: dict[str, Any] = {}
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        fn: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]] = getattr(servicer, method.name)
        methods[method.name] = grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=request_cls.FromString, response_serializer=response_cls.SerializeToString
        )
    return methods
