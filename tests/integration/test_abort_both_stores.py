"""Automatic abort over either store: the Ingestor, the expiry sweep, the cancel walk and the abort
watch wired as a server wires them, on LMDB and on a real PostgreSQL (the same bodies): a crossed
criterion cancels the rest once, refuses the request's batches until a new policy, respects
min_finished, and failed answers are counted in the answer's own transaction."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from exhook_server.abort import Aborts
from exhook_server.batch import Kind
from exhook_server.config import Config
from exhook_server.dispatch.gates import Gates
from exhook_server.expiry import ExpirySweep
from exhook_server.ingest import Ingestor
from exhook_server.status import StatusPublisher
from storage.lmdb import batches as lmdb_batches
from storage.lmdb.reads import LmdbReads
from storage.lmdb.store import Store
from storage.lmdb.writer import GroupCommitter
from storage.lmdb.writes import LmdbWrites
from storage.model import Outcome, now_ms, sha1_of
from storage.port import GcSettings, Reads, Writes
from storage.postgres import batches as pg_batches
from storage.postgres import migrate
from storage.postgres.reads import PgReads
from storage.postgres.writes import PgWrites
from testkit.pg_cluster import PgCluster
from tests.integration.test_ingest_both_stores import Heard, batch, publish

_names = itertools.count()
POLICY = "$SDV-FANOUT/policy"
#: An answer's end: (VIN, request id, sha1, response).
Answer = Callable[[str, str, bytes, bytes], Awaitable[bool]]


@dataclass
class Handle:
    writes: Writes
    reads: Reads
    answer: Answer


@asynccontextmanager
async def lmdb_store(tmp: Path) -> AsyncIterator[Handle]:
    store = Store(tmp / "lmdb")
    committer = GroupCommitter(store)
    writes = LmdbWrites(store, committer, 4.0)

    async def answer(vin: str, rid: str, sha1: bytes, response: bytes) -> bool:
        op = lmdb_batches.delete_row_if
        return bool(
            await writes._commit(
                op, vin=vin, request_id=rid, sha1=sha1, now_ms=now_ms(), outcome=Outcome.RESPONDED, response=response
            )
        )

    try:
        yield Handle(writes, LmdbReads(store, committer), answer)
    finally:
        await asyncio.to_thread(committer.close)
        store.close()


@asynccontextmanager
async def pg_store(dsn: str) -> AsyncIterator[Handle]:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    assert pool is not None

    async def answer(vin: str, rid: str, sha1: bytes, response: bytes) -> bool:
        async with pool.acquire() as conn:
            return await pg_batches.delete_row_if(conn, vin, rid, sha1, now_ms(), Outcome.RESPONDED, 1, response)

    try:
        async with pool.acquire() as conn:
            await migrate.migrate(conn)
        yield Handle(PgWrites(pool, 4.0), PgReads(pool, 4.0), answer)
    finally:
        await pool.close()


Opener = Callable[[], Any]


@pytest.fixture
def opener(request: pytest.FixtureRequest, each_store: str, tmp_path: Path) -> Opener:
    if each_store == "lmdb":
        return lambda: lmdb_store(tmp_path)
    cluster: PgCluster = request.getfixturevalue("pg_cluster")
    dsn = cluster.new_database(f"abort_{next(_names)}")
    return lambda: pg_store(dsn)


class Clock:
    def __init__(self) -> None:
        self.ms = now_ms()

    def __call__(self) -> int:
        return self.ms


@dataclass
class Proc:
    """What one server process wires for aborts: ingest, gates, the watch, the expiry sweep."""

    ingestor: Ingestor
    gates: Gates
    aborts: Aborts
    expiry: ExpirySweep
    heard: Heard


def process(cfg: Config, handle: Handle, clock: Clock, *, watch: bool = True) -> Proc:
    heard = Heard()
    ingestor = Ingestor(cfg, handle.writes, status=StatusPublisher(cfg, lambda: heard, clock), clock=clock)
    gates = Gates(clock)
    aborts = Aborts(cfg, handle.reads, handle.writes, gates, ingestor.cancels, ingestor.status, clock, settle_s=0.05)
    ingestor.campaigns.gates = gates
    ingestor.campaigns.aborts = aborts if watch else None
    expiry = ExpirySweep(cfg, handle.writes, clock)
    if watch:
        expiry.outcome_listeners.append(aborts.outcome)
        ingestor.cancels.outcome_listeners.append(aborts.outcome)
    return Proc(ingestor, gates, aborts, expiry, heard)


def run(opener: Opener, body: Callable[[Handle, Config, Clock], Awaitable[None]], **settings: Any) -> None:
    async def go() -> None:
        async with opener() as handle:
            await body(handle, Config(**settings), Clock())

    asyncio.run(go())


async def until(predicate: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    """predicate()'s first truthy value, polled on the loop within a deadline."""
    async with asyncio.timeout(timeout_s):
        while not (value := predicate()):
            await asyncio.sleep(0.01)
    return value


def policy(request_id: str, **fields: Any) -> bytes:
    return json.dumps({"request_id": request_id, **fields}).encode()


EXPIRED_HALF = [{"outcome": "expired", "ratio": 0.5, "min_finished": 10}]


async def seed(p: Proc, clock: Clock, rid: str, expiring: int, rest: int) -> None:
    """`expiring` rows of `rid` that expire in 10 s and `rest` that never do."""
    soon = batch([f"E{i:04d}" for i in range(expiring)], rid, "fw", expires_at=clock.ms + 10_000)
    assert await publish(p.ingestor, Kind.BATCH, "$SDV-FANOUT", soon)
    assert await publish(p.ingestor, Kind.BATCH, "$SDV-FANOUT", batch([f"P{i:04d}" for i in range(rest)], rid, "fw"))


def test_a_crossed_criterion_cancels_the_rest_once_and_refuses_until_a_new_policy(opener: Opener) -> None:
    """20 of 20 finished expired (ratio 0.5, min 10): R is aborted, its 300 other rows end cancelled
    with reason aborted (in chunks), one `aborted` event; another process judging the same counts
    records nothing; R's batches (and their previews) are refused `aborted` until a new policy."""

    async def body(handle: Handle, cfg: Config, clock: Clock) -> None:
        p = process(cfg, handle, clock)
        other = process(cfg, handle, clock, watch=False)
        try:
            assert await publish(p.ingestor, Kind.POLICY, POLICY, policy("task_ota_1", abort=EXPIRED_HALF))
            await seed(p, clock, "task_ota_1", 20, 300)
            clock.ms += 11_000
            assert await p.expiry.sweep() == 20
            [cancelled] = await until(lambda: p.heard.of("cancelled"))
            [aborted] = p.heard.of("aborted")
            assert aborted["criterion"] == EXPIRED_HALF[0]
            counts = aborted["counts"]
            assert (counts["finished"], counts["expired"], counts["pending"], counts["total"]) == (20, 20, 300, 320)
            assert (cancelled["cancelled"], cancelled["reason"]) == (300, "aborted")
            [gen] = await handle.reads.generations("task_ota_1")
            assert (gen.counts["cancelled"], gen.counts["pending"]) == (300, 0)

            # Another process crossing the same criterion meanwhile: the store records one abort.
            assert await handle.writes.abort("task_ota_1", b"{}", clock.ms, 100) is None
            [stored] = await handle.writes.policies()
            assert stored.aborted is not None and json.loads(stored.aborted)["criterion"] == EXPIRED_HALF[0]

            for proc in (p, other):  # every process refuses, whatever it knows
                assert not await publish(proc.ingestor, Kind.BATCH, "$SDV-FANOUT", batch(["V9"], "task_ota_1", "x"))
                [rejected] = proc.heard.of("rejected")
                assert (rejected["reason"], rejected["request_id"]) == ("aborted", "task_ota_1")
            assert await publish(p.ingestor, Kind.BATCH, "$SDV-FANOUT", batch(["V9"], "task_other_1", "x"))
            preview = batch(["V9"], "task_ota_1", "x", dry_run=True)  # says what the batch would get
            assert not await publish(p.ingestor, Kind.BATCH, "$SDV-FANOUT", preview)
            dry = p.heard.of("rejected")[-1]
            assert (dry["reason"], dry["dry_run"]) == ("aborted", True)

            assert await publish(other.ingestor, Kind.POLICY, POLICY, policy("task_ota_1", max_in_flight=5))
            assert (await handle.writes.policies())[0].aborted is None
            assert await publish(p.ingestor, Kind.BATCH, "$SDV-FANOUT", batch(["V9"], "task_ota_1", "x"))
            assert len(p.heard.of("aborted")) == 1
        finally:
            await p.aborts.stop()
            await p.ingestor.stop()
            await other.ingestor.stop()

    run(opener, body, cancel_chunk_rows=100)


def test_an_aborted_event_is_recorded_as_sent_and_one_a_crash_kept_back_goes_once(opener: Opener) -> None:
    """The recorder's `aborted` event, once the broker took it, is recorded in the abort
    (`announced_ms`); an abort whose recorder died before its event (recorded, never emitted)
    is emitted by the leader from the record: at its start at once, later only past the grace,
    and once; an announced one never again."""

    async def body(handle: Handle, cfg: Config, clock: Clock) -> None:
        p = process(cfg, handle, clock)
        leader = process(cfg, handle, clock, watch=False)
        try:
            for rid in ("task_ota_5", "task_ota_6", "task_ota_7"):
                assert await publish(p.ingestor, Kind.POLICY, POLICY, policy(rid, abort=EXPIRED_HALF))
            await seed(p, clock, "task_ota_5", 20, 10)
            clock.ms += 11_000
            assert await p.expiry.sweep() == 20
            [sent] = await until(lambda: p.heard.of("aborted"))

            async def records() -> dict[str, dict[str, Any]]:
                return {s.request_id: json.loads(s.aborted) for s in await handle.writes.policies() if s.aborted}

            async with asyncio.timeout(30):
                while "announced_ms" not in (await records()).get("task_ota_5", {}):
                    await asyncio.sleep(0.01)
            # Recorded by processes that died before their event: one just now, one 11 s ago.
            died = {"criterion": EXPIRED_HALF[0], "counts": sent["counts"]}
            fresh, old = (json.dumps({**died, "at_ms": clock.ms - ago}).encode() for ago in (0, 11_000))
            assert await handle.writes.abort("task_ota_6", fresh, clock.ms, 9)
            assert await handle.writes.abort("task_ota_7", old, clock.ms, 9)
            found = await handle.writes.policies()
            assert leader.aborts.announce_due(found, grace_ms=10_000) == 1  # the old one only
            assert leader.aborts.announce_due(found, grace_ms=None) == 1  # at a start: every one
            assert leader.aborts.announce_due(await handle.writes.policies(), grace_ms=None) == 0  # once
            late = {e["request_id"]: e for e in leader.heard.of("aborted")}
            assert sorted(late) == ["task_ota_6", "task_ota_7"]
            assert late["task_ota_6"]["criterion"] == EXPIRED_HALF[0] and late["task_ota_6"]["counts"] == sent["counts"]
            async with asyncio.timeout(30):
                while not all("announced_ms" in r for r in (await records()).values()):
                    await asyncio.sleep(0.01)
            restarted = process(cfg, handle, clock, watch=False)
            assert restarted.aborts.announce_due(await handle.writes.policies(), grace_ms=None) == 0
            await restarted.ingestor.stop()
        finally:
            await p.aborts.stop()
            await leader.aborts.stop()
            await p.ingestor.stop()
            await leader.ingestor.stop()

    run(opener, body, cancel_chunk_rows=100)


def test_no_abort_before_min_finished(opener: Opener) -> None:
    """Every finished pair expired, but fewer than min_finished: nothing happens until enough finished."""

    async def body(handle: Handle, cfg: Config, clock: Clock) -> None:
        p = process(cfg, handle, clock, watch=False)
        try:
            criteria = [{"outcome": "expired", "ratio": 0.5, "min_finished": 30}]
            assert await publish(p.ingestor, Kind.POLICY, POLICY, policy("task_ota_2", abort=criteria))
            await seed(p, clock, "task_ota_2", 20, 50)
            clock.ms += 11_000
            assert await p.expiry.sweep() == 20
            assert not await p.aborts.check("task_ota_2")
            soon = batch([f"F{i:04d}" for i in range(10)], "task_ota_2", "fw2", expires_at=clock.ms + 1_000)
            assert await publish(p.ingestor, Kind.BATCH, "$SDV-FANOUT", soon)
            clock.ms += 2_000
            assert await p.expiry.sweep() == 10
            assert await p.aborts.check("task_ota_2")
            [aborted] = p.heard.of("aborted")
            assert (aborted["counts"]["finished"], aborted["counts"]["expired"]) == (30, 30)
            await until(lambda: p.heard.of("cancelled"))
        finally:
            await p.ingestor.stop()

    run(opener, body)


def test_failed_answers_are_counted_with_the_answer_and_judged(opener: Opener) -> None:
    """An answer whose JSON "status" is failed or rejected counts for its request (in the answer's
    transaction, so it is read back); other answers, malformed or cut ones do not; the
    `answer_failed` criterion aborts on that count; GC drops it with the request's last generation."""

    async def body(handle: Handle, cfg: Config, clock: Clock) -> None:
        p = process(cfg, handle, clock, watch=False)
        try:
            criteria = [{"outcome": "answer_failed", "ratio": 0.3, "min_finished": 4}]
            assert await publish(p.ingestor, Kind.POLICY, POLICY, policy("task_cmd_1", abort=criteria))
            vins = [f"A{i:02d}" for i in range(12)]
            assert await publish(p.ingestor, Kind.BATCH, "$SDV-FANOUT", batch(vins, "task_cmd_1", "cmd"))
            sha1 = sha1_of(b"cmd")
            # The same answers through the Python rule (LMDB) and its SQL twin (PostgreSQL).
            answers = [
                b'{"status": "failed"}',
                b' \n{"status":"rejected","code":7}',
                b'{"status": "ok"}',
                b'{"status": "FAILED"}',
                b'{"status": ["failed"]}',
                b'["failed"]',
                b'{"status": "failed"',  # cut at max_response_bytes
                b"\xff{}",
                b"",
            ]
            for vin, response in zip(vins, answers, strict=False):
                assert await handle.answer(vin, "task_cmd_1", sha1, response)
            assert (await handle.reads.outcome_counts("task_cmd_1"))[1] == 2
            assert not await p.aborts.check("task_cmd_1")  # 2 of 9 finished: below 0.3
            assert await handle.answer(vins[9], "task_cmd_1", sha1, b'{"status": "rejected"}')
            assert await p.aborts.check("task_cmd_1")  # 3 of 10
            [aborted] = p.heard.of("aborted")
            assert (aborted["counts"]["answer_failed"], aborted["counts"]["responded"]) == (3, 10)
            [cancelled] = await until(lambda: p.heard.of("cancelled"))
            assert cancelled["cancelled"] == 2
            # GC takes the count with the request's last generation (nothing pending, old enough).
            later = GcSettings(now_ms() + 60_000, 0, 0, 60_000, 10, outcome_retention_ms=1_000)
            await handle.reads.gc(later)
            assert await handle.reads.outcome_counts("task_cmd_1") == ([], 0)
        finally:
            await p.ingestor.stop()

    run(opener, body)
