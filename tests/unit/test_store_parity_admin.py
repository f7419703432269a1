"""The Admin API, progress reporting, GC and the level gauges over either store: the same test
bodies with the store behind `LmdbReads` or `PgReads` (the engines of test_store_parity_reads.py).

The Admin API is served by a real gRPC server on loopback and called over a real channel; its
dispatch side (presence, in flight) is a Dispatcher over the in-memory rows of the dispatch tests,
since it is not what these tests look at. Background loops are polled with a deadline, never slept on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY

from exhook_server import admin, housekeeping, metrics
from exhook_server._proto import admin_pb2 as apb
from exhook_server.backends.lmdb.pool import Dispatcher
from exhook_server.config import Config
from exhook_server.progress import ProgressReporter
from exhook_server.status import StatusPublisher
from storage.lmdb.batches import sha1_of as sha1
from storage.lmdb.outcomes import Outcome
from storage.lmdb.store import now_ms
from storage.port import Reads
from tests.dispatch_fakes import MemoryRows, RecordingPublisher
from tests.integration.test_ingest_both_stores import Heard
from tests.unit import test_store_parity_reads as parity_reads
from tests.unit.test_store_parity_reads import Engine, Opener, eventually, place, run

opener = parity_reads.opener  # each store in turn, behind its ports

DAY_S = 24 * 3600.0
Call = Callable[[str, Any, Any], Awaitable[Any]]


def dispatcher() -> Dispatcher:
    """A running dispatcher with nothing online (the Admin API's other half)."""
    d = Dispatcher(MemoryRows(), RecordingPublisher(), workers=1, inflight_timeout_s=60)
    d.start()
    return d


async def stop(*tasks: asyncio.Task[None]) -> None:
    """Cancel background loops and wait until they are gone."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


@asynccontextmanager
async def admin_api(cfg: Config, reads: Reads) -> AsyncIterator[Call]:
    """The Admin API over `reads` on a loopback port; yields call(method, request, reply type)."""
    d = dispatcher()
    server = grpc.aio.server()
    server.add_registered_method_handlers(
        admin.SERVICE_NAME, admin.method_handlers(admin.AdminServicer(cfg, reads, d, lambda: False))
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")

    async def call(method: str, request: Any, reply: Any) -> Any:
        stub = channel.unary_unary(
            f"/{admin.SERVICE_NAME}/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=reply.FromString,
        )
        return await stub(request, timeout=10)

    try:
        yield call
    finally:
        await channel.close()
        await server.stop(None)
        await d.stop()


async def code_of(answer: Awaitable[Any]) -> grpc.StatusCode:
    """The status code an RPC fails with."""
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await answer
    return failed.value.code()


def test_admin_api_answers_from_either_store(opener: Opener) -> None:
    """GetStats, GetVehicle (queue, outcomes, backlog bound), GetRequest (and NOT_FOUND),
    ListRequests paged by token (and a bad token refused) and a dry-run TriggerGC, over the port."""

    async def body(e: Engine) -> None:
        await e.writes.store_batch(["V1", "V2"], "task_x", b"x1", 1_000)
        await e.writes.store_batch(["V1"], "task_x", b"x2", 1_100)
        assert await e.ack("V1", "task_x", sha1(b"x2"), 1_200, Outcome.DELIVERED, 1)
        for n, rid in enumerate(("task_a", "task_b", "task_c")):
            await e.writes.store_batch(["V1"], rid, rid.encode(), 2_000 + n)
        async with admin_api(Config(max_pending_per_vehicle=3), e.reads) as call:
            stats = await call("GetStats", apb.GetStatsRequest(), apb.Stats)
            assert (stats.rows, stats.blobs, stats.schema_version) == (4, 5, e.schema_version)

            v1 = await call("GetVehicle", apb.GetVehicleRequest(vin="V1", outcomes_limit=1), apb.Vehicle)
            assert [p.request_id for p in v1.pending] == ["task_a", "task_b", "task_c"]
            assert (v1.backlog, v1.at_backlog_bound) == (3, True)
            assert [(o.request_id, o.outcome, o.sha1) for o in v1.outcomes] == [
                ("task_x", "delivered", sha1(b"x2").hex())
            ]

            found = await call("GetRequest", apb.GetRequestRequest(request_id="task_x"), apb.RequestStatus)
            assert [(g.sha1, g.counts.pending, g.counts.superseded) for g in found.generations] == [
                (sha1(b"x2").hex(), 0, 0),
                (sha1(b"x1").hex(), 1, 1),
            ]
            missing = call("GetRequest", apb.GetRequestRequest(request_id="task_none"), apb.RequestStatus)
            assert await code_of(missing) == grpc.StatusCode.NOT_FOUND

            expected = sorted(await e.reads.all_generations(), key=place, reverse=True)
            shown, token = [], ""
            while True:
                ask = apb.ListRequestsRequest(page_size=2, page_token=token)
                page = await call("ListRequests", ask, apb.ListRequestsResponse)
                assert page.total == 5
                shown += [(g.request_id, g.sha1) for g in page.generations]
                token = page.next_page_token
                if not token:
                    break
                assert token == admin.page_token(place(expected[len(shown) - 1]))
            assert shown == [(g.request_id, g.sha1.hex()) for g in expected]
            bad = call("ListRequests", apb.ListRequestsRequest(page_token="not-a-token"), apb.ListRequestsResponse)
            assert await code_of(bad) == grpc.StatusCode.INVALID_ARGUMENT

            # Rows stored at 1970 times are far past retention: a dry run counts them all, keeps them.
            report = await call("TriggerGC", apb.TriggerGCRequest(dry_run=True), apb.GCReport)
            assert (report.dry_run, report.rows_expired) == (True, 4)
        assert await e.reads.row_count() == 4

    run(opener, body)


def test_progress_reports_a_campaign_to_completed_from_either_store(opener: Opener) -> None:
    """The reporter's loop reads the counts through the port: a change is `progress`, the last
    pending pair ending is `completed`, once."""

    async def body(e: Engine) -> None:
        heard = Heard()
        reporter = ProgressReporter(e.reads, StatusPublisher(Config(), lambda: heard))
        await e.writes.store_batch(["V1", "V2"], "task_ota_1", b"fw", 1_000)
        reporter.report(await e.reads.all_generations())  # the first look only remembers
        task = asyncio.create_task(reporter.run(0.01))
        try:
            assert await e.ack("V1", "task_ota_1", sha1(b"fw"), 1_100, Outcome.DELIVERED, 1)

            async def progressed() -> bool:
                return any(p["counts"]["pending"] == 1 for p in heard.of("progress"))

            await eventually(progressed)
            assert await e.ack("V2", "task_ota_1", sha1(b"fw"), 1_200, Outcome.DELIVERED, 1)

            async def completed() -> list[dict[str, Any]]:
                return heard.of("completed")

            [done] = await eventually(completed)
            assert (done["request_id"], done["sha1"], done["counts"]["delivered"]) == (
                "task_ota_1",
                sha1(b"fw").hex(),
                2,
            )
        finally:
            await stop(task)
        assert len(heard.of("completed")) == 1

    run(opener, body)


def test_gc_loop_collects_rows_past_retention_on_either_store(opener: Opener) -> None:
    """The GC loop, configured by the settings, expires rows older than retention_s through the port."""

    async def body(e: Engine) -> None:
        now = now_ms()
        await e.writes.store_batch(["V1", "V2"], "task_old", b"old", now - int(10 * DAY_S * 1000))
        await e.writes.store_batch(["V1"], "task_new", b"new", now)
        cfg = Config(retention_s=DAY_S, gc_interval_s=0.01)
        task = asyncio.create_task(housekeeping.gc_loop(cfg, e.reads))
        try:

            async def one_row_left() -> bool:
                return await e.reads.row_count() == 1

            await eventually(one_row_left)
        finally:
            await stop(task)
        assert (await e.reads.vehicle("V1", 10))[0][0].request_id == "task_new"

    run(opener, body)


def _sample(name: str) -> float | None:
    return REGISTRY.get_sample_value(name)


def test_level_gauges_come_from_either_store(opener: Opener) -> None:
    """The tick loop sets pending rows (and LMDB's map usage; PostgreSQL leaves that gauge alone);
    the backlog loop counts the vehicles at max_pending_per_vehicle."""

    async def body(e: Engine) -> None:
        for n in range(3):
            await e.writes.store_batch(["V1"], f"task_{n}", b"p", 1_000 + n)
        await e.writes.store_batch(["V2"], "task_0", b"p", 1_000)
        metrics.PENDING_ROWS.set(-1)
        metrics.MAP_USAGE.set(-1)
        metrics.VEHICLES_AT_BOUND.set(-1)
        d = dispatcher()
        tasks = [
            asyncio.create_task(housekeeping.tick_loop(d, e.reads, 0.01)),
            asyncio.create_task(housekeeping.backlog_gauge_loop(Config(max_pending_per_vehicle=3), e.reads, 0.01)),
        ]
        try:

            async def gauges_set() -> bool:
                return _sample("sdv_fanout_pending_rows") == 4 and _sample("sdv_fanout_vehicles_at_backlog_bound") == 1

            await eventually(gauges_set)
        finally:
            await stop(*tasks)
            await d.stop()
        usage = _sample("sdv_fanout_lmdb_map_usage_ratio")
        assert usage is not None and ((0 < usage <= 1) if e.has_map else usage == -1)

    run(opener, body)
