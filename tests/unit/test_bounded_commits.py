"""Work that an outsider can make large is cut into transactions of bounded rows.

A late data message completing many parked triggers, and a group commit of many
large batches, must never hold the single LMDB writer for one huge transaction:
a batch queued behind it waits for one chunk only.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from storage.errors import EarlyTriggersFull
from storage.lmdb import parked
from storage.lmdb.store import Store
from storage.lmdb.writer import GroupCommitter


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "lmdb") as s:
        yield s


def _run(store: Store, op: Any) -> Any:
    with store.write() as txn:
        return op(txn)


def _park(store: Store, data_id: str, triggers: int, vins_each: int, **limits: Any) -> None:
    for n in range(triggers):
        vins = [f"V{n:03d}{i:05d}" for i in range(vins_each)]
        _run(
            store,
            functools.partial(
                parked.store_trigger,
                t=store.tables,
                data_id=data_id,
                vins=vins,
                request_id=f"task_ota_{n}",
                now_ms=1,
                early_max=10_000,
                **limits,
            ),
        )


def _early_rows(store: Store) -> int:
    with store.write() as txn:
        return parked._count_early_rows(txn, store.tables, 0)


def test_late_data_completes_parked_triggers_in_bounded_chunks(store: Store) -> None:
    """Storing the data completes at most max_rows rows; each further chunk as many; all land."""
    _park(store, "d1", triggers=7, vins_each=300)
    data = _run(
        store, functools.partial(parked.store_data, t=store.tables, data_id="d1", blob=b"x", now_ms=2, max_rows=1000)
    )
    assert data.more and sum(b.rows for b in data.completed) == 900
    chunks = [data.completed]
    while True:
        chunk = _run(
            store, functools.partial(parked.complete_early, t=store.tables, data_id="d1", now_ms=3, max_rows=1000)
        )
        chunks.append(chunk.completed)
        if not chunk.more:
            break
    assert [sum(b.rows for b in c) for c in chunks] == [900, 900, 300]
    assert store.stats().rows == 2100 and store.stats().early_triggers == 0
    assert _early_rows(store) == 0


def test_one_trigger_larger_than_the_chunk_still_completes(store: Store) -> None:
    """A chunk always takes at least one trigger, so completion never stalls."""
    _park(store, "d1", triggers=2, vins_each=50)
    data = _run(
        store, functools.partial(parked.store_data, t=store.tables, data_id="d1", blob=b"x", now_ms=2, max_rows=10)
    )
    assert [b.rows for b in data.completed] == [50] and data.more


def test_parked_rows_are_bounded(store: Store) -> None:
    """Triggers naming more parked rows than early_max_rows are refused early_triggers_full."""
    _park(store, "d1", triggers=3, vins_each=100, early_max_rows=300)
    with pytest.raises(EarlyTriggersFull, match="early_max_rows"):
        _park(store, "d2", triggers=1, vins_each=1, early_max_rows=300)
    _run(store, functools.partial(parked.expire_early, t=store.tables, now_ms=10_000, ttl_ms=1, limit=10))
    assert _early_rows(store) == 0
    _park(store, "d2", triggers=1, vins_each=300, early_max_rows=300)


def test_triggers_left_waiting_by_a_cut_are_found_again(store: Store) -> None:
    """After a crash between chunks, the data_ids whose triggers still wait for stored data are found."""
    _park(store, "d1", triggers=3, vins_each=100)
    _park(store, "d2", triggers=1, vins_each=10)  # its data never came: not a leftover
    _run(store, functools.partial(parked.store_data, t=store.tables, data_id="d1", blob=b"x", now_ms=2, max_rows=100))
    with store.read() as txn:
        assert parked.waiting_data_ids(txn, store.tables) == ["d1"]


def test_group_commit_stops_gathering_at_max_rows(store: Store) -> None:
    """Queued ops of 4,000 rows each share transactions of at most max_rows (+ one op) rows."""
    committer = GroupCommitter(store, max_rows=10_000)
    gate = threading.Event()
    groups: dict[int, list[int]] = {}
    try:
        first = committer.submit(lambda txn: gate.wait(10))
        futures = [
            # Ops of one group see the same count of finished commits.
            committer.submit(lambda txn, n=n: groups.setdefault(committer.commits, []).append(n), rows=4_000)
            for n in range(6)
        ]
        gate.set()
        first.result(10)
        for f in futures:
            f.result(10)
    finally:
        committer.close()
    sizes = sorted(len(g) for g in groups.values())
    assert sum(sizes) == 6 and len(sizes) >= 2
    assert max(sizes) * 4_000 <= 10_000 + 4_000


def test_a_solo_op_never_joins_a_group_others_started(store: Store) -> None:
    """A cancel's chunk (solo) queued between two batches: the batch before it commits without
    waiting for the chunk's work; the chunk starts the next group, which the batch behind it
    may join."""
    committer = GroupCommitter(store)
    gate = threading.Event()
    seen: dict[str, int] = {}
    try:
        first = committer.submit(lambda txn: gate.wait(10))
        before = committer.submit(lambda txn: seen.setdefault("before", committer.commits))
        chunk = committer.submit(lambda txn: seen.setdefault("chunk", committer.commits), rows=500, solo=True)
        after = committer.submit(lambda txn: seen.setdefault("after", committer.commits))
        gate.set()
        for f in (first, before, chunk, after):
            f.result(10)
    finally:
        committer.close()
    assert seen["before"] < seen["chunk"] == seen["after"]
