"""Every (VIN, generation) is pending or has one outcome, and a generation's counts say how many are which."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from storage.lmdb import batches, gc, keys, outcomes
from storage.lmdb.batches import sha1_of
from storage.lmdb.outcomes import Outcome
from storage.lmdb.store import SCHEMA_VERSION, Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "lmdb") as s:
        yield s


def run(store: Store, op: Any, **kw: Any) -> Any:
    with store.write() as txn:
        return op(txn, t=store.tables, **kw)


def batch(store: Store, vins: list[str], rid: str, blob: bytes, now: int = 1_000) -> batches.BatchWritten:
    return run(store, batches.store_batch, vins=vins, request_id=rid, blob=blob, now_ms=now)  # type: ignore[no-any-return]


def counts(store: Store, rid: str, blob: bytes) -> dict[str, int]:
    with store.read() as txn:
        gen = outcomes.generation(txn, store.tables, rid, sha1_of(blob))
    assert gen is not None
    return {k: v for k, v in gen.counts.items() if v}


def end(store: Store, vin: str, rid: str, blob: bytes, outcome: Outcome = Outcome.DELIVERED) -> bool:
    return run(store, batches.delete_row_if, vin=vin, request_id=rid, sha1=sha1_of(blob), now_ms=2_000, outcome=outcome)  # type: ignore[no-any-return]


def assert_recount(store: Store) -> None:
    with store.read() as txn:
        recounted = outcomes.recount(txn, store.tables)
        stored = {(g.request_id, g.sha1): g.counts for g in outcomes.all_generations(txn, store.tables)}
    assert {k: v for k, v in stored.items() if v["total"]} == recounted


def test_a_batch_makes_one_pending_pair_per_vin(store: Store) -> None:
    """Three VINs, one generation: total 3, pending 3."""
    batch(store, ["V1", "V2", "V3"], "task_ota_1", b"fw1")
    assert counts(store, "task_ota_1", b"fw1") == {"total": 3, "pending": 3}


def test_a_newer_payload_supersedes_the_pending_row(store: Store) -> None:
    """The same request id with new data: the old pair ends superseded, the new generation counts it."""
    batch(store, ["V1", "V2"], "task_ota_1", b"fw1")
    written = batch(store, ["V2"], "task_ota_1", b"fw2", now=1_001)
    assert written.superseded == frozenset({sha1_of(b"fw1")})
    assert counts(store, "task_ota_1", b"fw1") == {"total": 2, "pending": 1, "superseded": 1}
    assert counts(store, "task_ota_1", b"fw2") == {"total": 1, "pending": 1}
    assert_recount(store)


def test_the_same_batch_again_changes_no_count(store: Store) -> None:
    """A pending pair sent again stays one pending pair."""
    batch(store, ["V1"], "task_ota_1", b"fw1")
    batch(store, ["V1"], "task_ota_1", b"fw1", now=1_001)
    assert counts(store, "task_ota_1", b"fw1") == {"total": 1, "pending": 1}


def test_an_ack_ends_the_pair_delivered_with_its_record(store: Store) -> None:
    """The row goes; the outcome record says delivered, when and after how many attempts."""
    batch(store, ["V1", "V2"], "task_ota_1", b"fw1")
    with store.write() as txn:
        assert batches.delete_row_if(
            txn, store.tables, "V1", "task_ota_1", sha1_of(b"fw1"), 2_000, Outcome.DELIVERED, 3
        )
    assert counts(store, "task_ota_1", b"fw1") == {"total": 2, "pending": 1, "delivered": 1}
    with store.read() as txn:
        [record] = outcomes.vehicle_outcomes(txn, store.tables, "V1")
    assert (record.outcome, record.ts_ms, record.attempts) == (Outcome.DELIVERED, 2_000, 3)


def test_a_delivered_generation_sent_again_is_pending_again_not_twice_counted(store: Store) -> None:
    """Delivered, then the same generation again to the same VIN: pending once more, total unchanged."""
    batch(store, ["V1"], "task_ota_1", b"fw1")
    end(store, "V1", "task_ota_1", b"fw1")
    batch(store, ["V1"], "task_ota_1", b"fw1", now=3_000)
    assert counts(store, "task_ota_1", b"fw1") == {"total": 1, "pending": 1}
    assert_recount(store)


def test_retention_ends_rows_expired(store: Store) -> None:
    """A row removed by retention counts as expired."""
    batch(store, ["V1", "V2"], "task_ota_1", b"fw1", now=1_000)
    with store.write() as txn:
        assert gc.expire_rows(txn, store.tables, cutoff_ms=5_000, limit=10) == 2
    assert counts(store, "task_ota_1", b"fw1") == {"total": 2, "expired": 2}
    assert_recount(store)


def test_counts_equal_a_recount_after_random_work(store: Store) -> None:
    """Random batches, replacements, acks and failures: stored counts always equal the recount."""
    rng = random.Random(5)
    for n in range(400):
        vins = [f"V{rng.randrange(30)}" for _ in range(rng.randint(1, 6))]
        rid = f"task_t_{rng.randrange(5)}"
        blob = bytes([rng.randrange(3)])
        if rng.random() < 0.6:
            batch(store, vins, rid, blob, now=1_000 + n)
        else:
            end(store, vins[0], rid, blob, rng.choice(list(Outcome)))
    assert_recount(store)


def test_a_version_1_store_is_upgraded_with_its_rows_pending(tmp_path: Path) -> None:
    """Opening a version-1 store for writing builds the counts of the rows it holds."""
    path = tmp_path / "lmdb"
    with Store(path) as s:
        batch(s, ["V1", "V2"], "task_ota_1", b"fw1")
        with s.write() as txn:
            txn.drop(s.tables.gens, delete=False)
            txn.put(b"schema_version", b"1", db=s.tables.meta)
    with Store(path) as s:
        assert s.schema_version == SCHEMA_VERSION
        assert counts(s, "task_ota_1", b"fw1") == {"total": 2, "pending": 2}
        assert_recount(s)


def test_generation_keys_round_trip() -> None:
    """Request ids and VINs come back from their keys whole."""
    sha1 = sha1_of(b"x")
    assert keys.split_gen_key(keys.gen_key("task_ü_1", sha1)) == ("task_ü_1", sha1)
    assert keys.split_outcome_key(keys.outcome_key("V1", "task_1", sha1)) == ("V1", "task_1", sha1)


def test_generations_are_listed_newest_first(store: Store) -> None:
    """A reused request id lists its newest generation first."""
    batch(store, ["V1"], "task_ota_1", b"old", now=1_000)
    batch(store, ["V2"], "task_ota_1", b"new", now=2_000)
    with store.read() as txn:
        gens = outcomes.generations(txn, store.tables, "task_ota_1")
    assert [g.sha1 for g in gens] == [sha1_of(b"new"), sha1_of(b"old")]
