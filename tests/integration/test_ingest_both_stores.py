"""The Ingestor (parse, store, receipts, cancel, expiry, parked triggers) over either store.

The same test bodies run on the embedded LMDB store (LmdbWrites over the group committer) and on
a real PostgreSQL (PgWrites over an asyncpg pool on the session's throwaway cluster): what the
platform hears back must not depend on the engine behind storage/port.Writes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from exhook_server.batch import Kind
from exhook_server.config import Config
from exhook_server.expiry import ExpirySweep
from exhook_server.ingest import Ingestor
from exhook_server.status import StatusPublisher
from storage.lmdb.store import Store
from storage.lmdb.writer import GroupCommitter
from storage.lmdb.writes import LmdbWrites
from storage.model import BatchWritten, Duplicate
from storage.port import Writes
from storage.postgres import migrate
from storage.postgres.writes import PgWrites
from testkit.pg_cluster import PgCluster

_names = itertools.count()


class Heard:
    """The status link: every status message, decoded."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        #: What the store returned for each batch, when the test wraps it.
        self.stored: Stored | None = None

    def publish_status(self, topic: str, payload: bytes, on_puback: Callable[[int], None]) -> bool:
        self.events.append(json.loads(payload))
        on_puback(0)  # the broker has it
        return True

    def of(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]


Opener = Callable[[], Any]


@asynccontextmanager
async def lmdb_writes(tmp: Path) -> AsyncIterator[Writes]:
    store = Store(tmp / "lmdb")
    committer = GroupCommitter(store)
    try:
        yield LmdbWrites(store, committer, 4.0)
    finally:
        await asyncio.to_thread(committer.close)
        store.close()


@asynccontextmanager
async def pg_writes(dsn: str) -> AsyncIterator[Writes]:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    assert pool is not None
    try:
        async with pool.acquire() as conn:
            await migrate.migrate(conn)
        yield PgWrites(pool, 4.0)
    finally:
        await pool.close()


@pytest.fixture
def opener(request: pytest.FixtureRequest, each_store: str, tmp_path: Path) -> Opener:
    if each_store == "lmdb":
        return lambda: lmdb_writes(tmp_path)
    cluster: PgCluster = request.getfixturevalue("pg_cluster")
    dsn = cluster.new_database(f"ingest_{next(_names)}")
    return lambda: pg_writes(dsn)


class Stored:
    """The store's Writes, keeping what each store_batch returned (what a preview must match)."""

    def __init__(self, writes: Writes) -> None:
        self._writes = writes
        self.results: list[BatchWritten | Duplicate] = []

    async def store_batch(self, *args: Any, dry_run: bool = False) -> BatchWritten | Duplicate:
        written = await self._writes.store_batch(*args, dry_run=dry_run)
        if not dry_run:
            self.results.append(written)
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writes, name)


def run(opener: Opener, body: Callable[[Ingestor, Heard], Awaitable[None]], **settings: Any) -> None:
    cfg = Config(**settings)

    async def go() -> None:
        async with opener() as writes:
            heard = Heard()
            heard.stored = Stored(writes)
            ingestor = Ingestor(cfg, heard.stored, status=StatusPublisher(cfg, lambda: heard))
            try:
                await body(ingestor, heard)
            finally:
                await ingestor.stop()

    asyncio.run(go())


def batch(vins: list[str], request_id: str, data: str, **extra: Any) -> bytes:
    return json.dumps({"ids": vins, "request_id": request_id, "data": data, **extra}).encode()


async def publish(ingestor: Ingestor, kind: Kind, topic: str, payload: bytes) -> bool:
    return await ingestor.ingest(kind, topic, payload, "sdv-platform", "platform")


def test_receipts_say_what_was_stored_refused_and_retried(opener: Opener) -> None:
    """accepted with its refusals at the backlog bound; a retried batch_id: duplicate, same refusals."""

    async def body(ingestor: Ingestor, heard: Heard) -> None:
        assert await publish(ingestor, Kind.BATCH, "$SDV-FANOUT", batch(["V1"], "task_a_1", "a"))
        retry = batch(["V1", "V2"], "task_b_1", "b", batch_id="b-1", correlation_id="c-1")
        assert await publish(ingestor, Kind.BATCH, "$SDV-FANOUT", retry)
        assert await publish(ingestor, Kind.BATCH, "$SDV-FANOUT", retry)
        first, dup = heard.of("accepted")[1:]
        assert first["refused"] == [{"vin": "V1", "reason": "vehicle_backlog_full"}] and first["vins"] == 1
        assert dup["duplicate"] is True and dup["refused"] == first["refused"]
        assert dup["correlation_id"] == "c-1"

    run(opener, body, max_pending_per_vehicle=1)


def test_a_parked_trigger_gets_its_receipt_when_its_data_arrives(opener: Opener) -> None:
    async def body(ingestor: Ingestor, heard: Heard) -> None:
        trigger = json.dumps({"ids": ["V1", "V2"], "request_id": "task_cfg_1", "data_id": "d1"}).encode()
        assert await publish(ingestor, Kind.TRIGGER, "$SDV-FANOUT/trigger", trigger)
        assert heard.of("accepted") == []
        assert await publish(ingestor, Kind.DATA, "$SDV-FANOUT/data/d1", b"config")
        [receipt] = heard.of("accepted")
        assert (receipt["request_id"], receipt["vins"]) == ("task_cfg_1", 2)

    run(opener, body)


def test_a_cancel_of_every_vehicle_in_chunks_reports_its_total(opener: Opener) -> None:
    async def body(ingestor: Ingestor, heard: Heard) -> None:
        for part in range(0, 12, 4):
            vins = [f"V{n:02}" for n in range(part, part + 4)]
            await publish(ingestor, Kind.BATCH, "$SDV-FANOUT", batch(vins, "task_ota_1", "fw"))
        task = await ingestor.cancels.cancel("task_ota_1", None)
        result = await task
        assert (result.cancelled, result.in_flight) == (12, 0)
        [event] = heard.of("cancelled")
        assert event["cancelled"] == 12
        assert await ingestor.cancels.resume() == []  # nothing left half done

    run(opener, body, max_ids_per_batch=4, max_rows_per_commit=4)


def test_a_cancel_with_ids_null_cancels_nothing_and_its_refusal_names_the_cancel(opener: Opener) -> None:
    """`"ids": null` on the cancel topic is wrong_type: no vehicle's row ends. Its `rejected` event
    (on the request's own topic) says `"of": "cancel"`, a rejected batch's says `"of": "batch"`."""

    async def body(ingestor: Ingestor, heard: Heard) -> None:
        assert await publish(ingestor, Kind.BATCH, "$SDV-FANOUT", batch(["V1", "V2"], "task_ota_1", "fw"))
        null_ids = json.dumps({"request_id": "task_ota_1", "ids": None, "correlation_id": "c-9"}).encode()
        assert not await publish(ingestor, Kind.CANCEL, "$SDV-FANOUT/cancel", null_ids)
        assert not await publish(ingestor, Kind.BATCH, "$SDV-FANOUT", batch([], "task_ota_1", "fw"))
        assert heard.of("cancelled") == []
        refused, rejected_batch = heard.of("rejected")
        assert refused["request_id"] == "task_ota_1" and refused["correlation_id"] == "c-9"
        assert (refused["reason"], refused["of"]) == ("wrong_type", "cancel")
        assert (rejected_batch["reason"], rejected_batch["of"]) == ("empty_ids", "batch")
        result = await (await ingestor.cancels.cancel("task_ota_1", None))
        assert result.cancelled == 2  # both rows were still pending

    run(opener, body)


def test_the_expiry_sweep_ends_rows_past_their_time(opener: Opener) -> None:
    async def body(ingestor: Ingestor, heard: Heard) -> None:
        clock = [1_000_000]
        ingestor._clock = lambda: clock[0]  # the ingest clock only: the parser checks against it too
        ingestor.parser._clock = ingestor._clock
        expiry = ExpirySweep(Config(), ingestor._writes, clock=ingestor._clock)
        doc = batch(["V1", "V2"], "task_unlock_1", "u", expires_at=1_000_500)
        assert await publish(ingestor, Kind.BATCH, "$SDV-FANOUT", doc)
        assert await expiry.sweep() == 0
        clock[0] = 1_000_600
        assert await expiry.sweep() == 2
        assert await expiry.sweep() == 0

    run(opener, body)


def test_with_the_catchup_session_the_same_message_twice_is_stored_once(opener: Opener) -> None:
    """With the catch-up session on (mqtt_url set), a batch or trigger without batch_id seen twice
    (by the hook and by the session) is stored once, the second sighting a duplicate; no receipt
    shows the implied id. The session's sighting carries no publisher, and is not refused for it."""

    async def body(ingestor: Ingestor, heard: Heard) -> None:
        plain = batch(["V1"], "task_p_1", "p")
        assert await publish(ingestor, Kind.BATCH, "$SDV-FANOUT", plain)
        assert await ingestor.ingest(Kind.BATCH, "$SDV-FANOUT", plain, "", "", via="catchup")
        trigger = json.dumps({"ids": ["V2"], "request_id": "task_t_1", "data_id": "d1"}).encode()
        assert await publish(ingestor, Kind.TRIGGER, "$SDV-FANOUT/trigger", trigger)  # parked
        assert await ingestor.ingest(Kind.TRIGGER, "$SDV-FANOUT/trigger", trigger, "", "", via="catchup")
        assert await publish(ingestor, Kind.DATA, "$SDV-FANOUT/data/d1", b"payload")
        accepted = heard.of("accepted")
        assert [(a["request_id"], a.get("duplicate", False)) for a in accepted] == [
            ("task_p_1", False),
            ("task_p_1", True),
            ("task_t_1", False),
        ]
        assert all(a.get("batch_id") is None for a in accepted)
        # The hook's sighting names its publisher, and the allowlist applies there.
        assert not await ingestor.ingest(Kind.BATCH, "$SDV-FANOUT", batch(["V3"], "task_x_1", "x"), "intruder", "")

    run(opener, body, publisher_allowlist=("sdv-platform",))


def test_without_the_catchup_session_a_message_without_batch_id_is_stored_each_time(opener: Opener) -> None:
    """catchup_enabled = false: no implied id, each sighting stores (as before the session existed)."""

    async def body(ingestor: Ingestor, heard: Heard) -> None:
        plain = batch(["V1"], "task_q_1", "q")
        for _ in range(2):
            assert await publish(ingestor, Kind.BATCH, "$SDV-FANOUT", plain)
        assert [a.get("duplicate", False) for a in heard.of("accepted")] == [False, False]

    run(opener, body, catchup_enabled=False)


async def preview_then_ingest(ingestor: Ingestor, heard: Heard, payload: bytes) -> tuple[dict[str, Any], Any]:
    """The preview of `payload` (sent with "dry_run": true, twice: the first wrote nothing), then
    what the same batch without dry_run did, in the preview's terms."""
    dry = json.dumps({**json.loads(payload), "dry_run": True}).encode()
    assert await publish(ingestor, Kind.BATCH, "$SDV-FANOUT", dry)
    assert await publish(ingestor, Kind.BATCH, "$SDV-FANOUT", dry)
    first, preview = heard.of("preview")[-2:]
    assert first == {**preview, "ts_ms": first["ts_ms"]}
    heard.events.clear()
    if not await publish(ingestor, Kind.BATCH, "$SDV-FANOUT", payload):
        [rejected] = heard.events
        return preview, ("rejected", rejected["reason"])
    [receipt] = heard.events
    if receipt.get("duplicate"):
        return preview, ("duplicate", receipt["vins"])
    assert heard.stored is not None
    written = heard.stored.results[-1]
    assert isinstance(written, BatchWritten) and receipt["vins"] == written.rows
    return preview, (written.rows, written.replaced, receipt["refused"])


def test_a_preview_says_what_the_same_batch_then_does(opener: Opener) -> None:
    """new, replacing, refused at the bound, duplicate, bad VINs: the preview (stored nothing)
    equals what the batch does right after it, on either store."""
    online = {"V2", "V3"}

    async def count_online(vins: Sequence[str]) -> int:
        return sum(1 for v in vins if v in online)

    async def body(ingestor: Ingestor, heard: Heard) -> None:
        ingestor.online_among = count_online
        preview, did = await preview_then_ingest(ingestor, heard, batch(["V1", "V2"], "R1", "a", batch_id="b1"))
        assert did == (2, 0, []) and preview["already_pending"] == 0
        assert (preview["would_store"], preview["online_now"], preview["batch_id"]) == (2, 1, "b1")

        preview, did = await preview_then_ingest(ingestor, heard, batch(["V2", "V3", "V4"], "R1", "b"))
        assert did == (3, 1, []) and (preview["would_store"], preview["already_pending"]) == (3, 1)
        assert preview["online_now"] == 2

        # The bound is 2: V2 holds R1 and R2 then; R3 is refused for it, replaces nothing new.
        await publish(ingestor, Kind.BATCH, "$SDV-FANOUT", batch(["V2"], "R2", "c"))
        preview, did = await preview_then_ingest(ingestor, heard, batch(["V2", "V5"], "R3", "d"))
        refused = [{"vin": "V2", "reason": "vehicle_backlog_full"}]
        assert did == (1, 0, refused) and preview["refused"] == refused
        assert (preview["would_store"], preview["online_now"]) == (1, 0)

        preview, did = await preview_then_ingest(ingestor, heard, batch(["V9"], "R1", "e", batch_id="b1"))
        assert did == ("duplicate", 2)
        assert (preview["duplicate"], preview["would_store"], preview["already_pending"]) == (True, 0, 0)

        bad = batch(["V1", "no vin", "V2", "a/b", "no vin"], "R1", "f")
        preview, did = await preview_then_ingest(ingestor, heard, bad)
        assert did == ("rejected", "bad_vin")
        assert preview["rejected_vins"] == ["no vin", "a/b"] and preview["reason"] == "bad_vin"
        assert preview["would_store"] == 0

    run(opener, body, max_pending_per_vehicle=2)


def test_a_trigger_preview_says_what_the_same_trigger_then_does(opener: Opener) -> None:
    """A trigger with "dry_run": true gets the batch form's `preview` receipt and stores nothing:
    before its data it would be parked (no row now, and none parked: the data completes nothing),
    after it the rows it would store and replace, as the trigger right after it does."""

    async def body(ingestor: Ingestor, heard: Heard) -> None:
        doc = {"ids": ["V1", "V2"], "request_id": "R1", "data_id": "d1", "batch_id": "t1"}
        trigger, dry = (json.dumps({**doc, **extra}).encode() for extra in ({}, {"dry_run": True}))
        assert await publish(ingestor, Kind.TRIGGER, "$SDV-FANOUT/trigger", dry)
        [early] = heard.of("preview")
        assert (early["parked"], early["would_store"], early["batch_id"]) == (True, 0, "t1")
        assert await publish(ingestor, Kind.DATA, "$SDV-FANOUT/data/d1", b"config")
        assert await publish(ingestor, Kind.BATCH, "$SDV-FANOUT", batch(["V2"], "R1", "old"))
        assert [a["vins"] for a in heard.of("accepted")] == [1]  # the batch's only: nothing was parked
        heard.events.clear()
        assert await publish(ingestor, Kind.TRIGGER, "$SDV-FANOUT/trigger", dry)
        [preview] = heard.of("preview")
        assert (preview["would_store"], preview["already_pending"], preview["refused"]) == (2, 1, [])
        assert "parked" not in preview
        assert await publish(ingestor, Kind.TRIGGER, "$SDV-FANOUT/trigger", trigger)
        [accepted] = heard.of("accepted")
        assert (accepted["vins"], accepted.get("duplicate")) == (2, None)  # the preview stored no batch_id
        heard.events.clear()
        assert await publish(ingestor, Kind.TRIGGER, "$SDV-FANOUT/trigger", dry)
        [again] = heard.of("preview")
        assert (again["duplicate"], again["would_store"]) == (True, 0)

    run(opener, body)


def test_a_preview_refused_for_another_reason_is_a_rejected_dry_run(opener: Opener) -> None:
    """A dry run the batch's own checks refuse gets the batch's `rejected`, marked dry_run."""

    async def body(ingestor: Ingestor, heard: Heard) -> None:
        payload = json.dumps({"ids": ["V1"], "request_id": "R1", "dry_run": True}).encode()
        assert not await publish(ingestor, Kind.BATCH, "$SDV-FANOUT", payload)
        [rejected] = heard.of("rejected")
        assert (rejected["reason"], rejected["dry_run"], rejected["request_id"]) == ("missing_field", True, "R1")
        assert heard.of("preview") == []

    run(opener, body)
