"""Delivery attempts and the answer-awaited state outlive a restart (LMDB mode).

The rules with the in-memory row source (`MemoryRows.restart` plays a kill -9: a new worker,
the rows and what is kept of their deliveries stay), then the LMDB side: what `StoreRows`
keeps through the group committer, what ends with a row, and the schema upgrade.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import lmdb
import pytest

from exhook_server.backends.lmdb.pool import Dispatcher
from exhook_server.backends.lmdb.rows import StoreRows
from exhook_server.dispatch.commands import Acknowledge, MaybeSend, Responded, Session, Sweep, Trigger
from exhook_server.dispatch.worker import NOTHING_KEPT, Worker
from storage.errors import StorageError
from storage.lmdb import batches, keys
from storage.lmdb.outcomes import Outcome
from storage.lmdb.store import SCHEMA_VERSION, Store
from storage.lmdb.writer import GroupCommitter
from testkit.harness import poll
from tests.dispatch_fakes import ManualClock, MemoryRows, RecordingPublisher, sha1

VIN = "VIN1"
MAX_ATTEMPTS = 4
RESPONSE_TIMEOUT_S = 30.0


def session(port: int) -> Session:
    return Session("emqx@n1", VIN, "10.0.0.1", port)


class Lifetimes:
    """One vehicle's rows across server lifetimes: `restart` starts a new worker on the same rows."""

    def __init__(self) -> None:
        self.rows = MemoryRows(now_ms=lambda: round(self.clock.now * 1000))
        self.pub = RecordingPublisher()
        self.clock = ManualClock()
        self.port = 40000
        self.worker = self._worker()

    def _worker(self) -> Worker:
        return Worker(
            "w0",
            self.rows,
            self.pub,
            inflight_timeout_s=60,
            clock=self.clock,
            max_attempts=MAX_ATTEMPTS,
            response_timeout_s=RESPONSE_TIMEOUT_S,
        )

    def restart(self) -> None:
        self.rows.restart()
        self.worker = self._worker()

    def reconnect(self) -> Session:
        """A new clean connection subscribes (what a vehicle does after our restart)."""
        self.port += 1
        s = session(self.port)
        self.worker.handle(MaybeSend(Trigger.SESSION_SUBSCRIBED, VIN, s))
        return s

    @property
    def sent(self) -> list[str]:
        return [rid for _, rid, _ in self.pub.sent]


def test_a_row_never_acked_ends_failed_after_max_attempts_across_restarts() -> None:
    """Each lifetime publishes the poisoned row once (the vehicle reconnects, never PUBACKs):
    the count goes on across restarts, the row ends failed at max_attempts, the next one goes."""
    life = Lifetimes()
    life.rows.add(VIN, "task_poison", b"never")
    life.rows.add(VIN, "task_next", b"next")
    for _ in range(MAX_ATTEMPTS):
        life.reconnect()
        life.restart()
    life.reconnect()
    assert life.sent == ["task_poison"] * MAX_ATTEMPTS + ["task_next"]
    assert life.rows.outcomes[VIN, "task_poison", sha1(b"never")].outcome is Outcome.FAILED
    assert life.rows.outcomes[VIN, "task_poison", sha1(b"never")].attempts == MAX_ATTEMPTS


def test_a_replaced_row_counts_from_zero() -> None:
    """Another payload under the same request id is another row: its attempts start at 0."""
    life = Lifetimes()
    life.rows.add(VIN, "task_cfg", b"v1")
    life.reconnect()
    life.restart()
    life.rows.add(VIN, "task_cfg", b"v2")
    life.restart()
    for _ in range(MAX_ATTEMPTS):
        life.reconnect()
        life.restart()
    life.reconnect()  # sent v2 MAX_ATTEMPTS times: it ends now
    assert life.sent == ["task_cfg"] * (1 + MAX_ATTEMPTS)
    assert life.rows.outcomes[VIN, "task_cfg", sha1(b"v2")].attempts == MAX_ATTEMPTS


def test_an_answer_awaited_before_a_restart_is_awaited_after_it() -> None:
    """PUBACKed, answer pending, server restarted: the vehicle is not sent it again (it has it),
    its slot stays taken, and its answer ends it responded."""
    life = Lifetimes()
    life.rows.add(VIN, "task_diag", b"diag", await_response=True)
    life.rows.add(VIN, "task_next", b"next")
    s = life.reconnect()
    life.worker.handle(Acknowledge(VIN, s, "task_diag", sha1(b"diag")))
    life.restart()
    s = life.reconnect()
    assert life.sent == ["task_diag"]
    life.worker.handle(Responded(VIN, s, "task_diag", b"ok", 2))
    assert life.rows.outcomes[VIN, "task_diag", sha1(b"diag")].outcome is Outcome.RESPONDED
    assert life.sent == ["task_diag", "task_next"]


def test_the_response_timeout_counts_the_time_before_the_restart() -> None:
    """The wait for an answer started at the PUBACK, before the restart: it fails at
    response_timeout_s from then, and the next request goes."""
    life = Lifetimes()
    life.rows.add(VIN, "task_diag", b"diag", await_response=True)
    life.rows.add(VIN, "task_next", b"next")
    s = life.reconnect()
    life.worker.handle(Acknowledge(VIN, s, "task_diag", sha1(b"diag")))
    life.clock.now += RESPONSE_TIMEOUT_S - 1
    life.restart()
    life.reconnect()
    assert life.sent == ["task_diag"]
    life.clock.now += 1
    life.worker.handle(Sweep())
    ended = life.rows.outcomes[VIN, "task_diag", sha1(b"diag")]
    assert (ended.outcome, ended.attempts) == (Outcome.FAILED, 1)
    assert life.sent == ["task_diag", "task_next"]


def test_answers_awaited_are_restored_at_start_for_vehicles_that_stay_away() -> None:
    """The sweep ends an awaited delivery at its timeout although its vehicle never comes back."""
    life = Lifetimes()
    life.rows.add(VIN, "task_diag", b"diag", await_response=True)
    s = life.reconnect()
    life.worker.handle(Acknowledge(VIN, s, "task_diag", sha1(b"diag")))
    life.restart()
    kept = life.rows.tried(VIN, "task_diag", sha1(b"diag"))
    life.worker.restore_awaited(VIN, "task_diag", sha1(b"diag"), kept)
    life.clock.now += RESPONSE_TIMEOUT_S
    life.worker.handle(Sweep())
    assert life.rows.outcomes[VIN, "task_diag", sha1(b"diag")].outcome is Outcome.FAILED


def test_a_puback_after_a_restart_of_a_row_awaiting_its_answer_starts_the_wait() -> None:
    """A resumed session redelivers a row awaiting its answer and the vehicle PUBACKs it before
    we sent it in this lifetime: the answer, not that PUBACK, ends it."""
    life = Lifetimes()
    life.rows.add(VIN, "task_diag", b"diag", await_response=True)
    life.rows.add(VIN, "task_next", b"next")
    life.reconnect()
    life.restart()
    s = session(life.port)
    life.worker.handle(Acknowledge(VIN, s, "task_diag", sha1(b"diag")))
    life.worker.handle(MaybeSend(Trigger.HEARTBEAT, VIN, s))
    assert life.sent == ["task_diag"] and (VIN, "task_diag", sha1(b"diag")) not in life.rows.outcomes
    life.worker.handle(Responded(VIN, s, "task_diag", b"ok", 2))
    assert life.rows.outcomes[VIN, "task_diag", sha1(b"diag")].outcome is Outcome.RESPONDED


# -- LMDB -------------------------------------------------------------------------------------


@pytest.fixture
def lmdb_rows(tmp_path: Path) -> tuple[Store, GroupCommitter, StoreRows]:
    store = Store(tmp_path / "lmdb")
    writer = GroupCommitter(store, lazy_delay_s=3600)  # lazy ops wait for company, never for time
    yield store, writer, StoreRows(store, writer)
    writer.close()
    store.close()


def _commit(writer: GroupCommitter) -> None:
    """A durable commit, which takes the lazy ops waiting with it."""
    writer.submit(lambda txn: None).result(5)


def _put(store: Store, writer: GroupCommitter, vin: str, rid: str, blob: bytes, *, awaits: bool = False) -> None:
    spec = batches.RowSpec(flags=keys.FLAG_AWAIT_RESPONSE if awaits else 0)
    writer.submit(lambda txn: batches.store_batch(txn, store.tables, [vin], rid, blob, 1, spec=spec)).result(5)


def test_store_rows_keep_attempts_with_a_later_commit_and_forget_them_with_the_row(
    lmdb_rows: tuple[Store, GroupCommitter, StoreRows],
) -> None:
    """Publishes and a PUBACK awaiting the answer reach the store by lazy commits (one op per
    window); another payload under the request id, or the row's end, leaves no entry behind."""
    store, writer, rows = lmdb_rows
    _put(store, writer, VIN, "task_a", b"a")
    _put(store, writer, VIN, "task_b", b"b", awaits=True)
    a, _ = store.oldest(VIN)[0] or (None, None)
    assert a is not None and a.request_id == "task_a"
    commits = writer.commits
    rows.sent(VIN, a, 1)
    rows.sent(VIN, a, 2)
    b = store.row(VIN, "task_b")
    assert b is not None
    rows.sent(VIN, b, 1)
    rows.awaiting(VIN, "task_b", b.sha1, 1, session(41000))
    later = StoreRows(store, writer)  # a new process: only what is committed counts
    assert later.tried(VIN, "task_a", a.sha1).attempts == 0  # not committed yet
    _commit(writer)
    assert writer.commits == commits + 1  # four records, one op, in the commit that came next
    assert later.tried(VIN, "task_a", a.sha1).attempts == 2
    kept = later.tried(VIN, "task_b", b.sha1)
    assert (kept.attempts, kept.awaits, kept.session) == (1, True, session(41000))
    assert kept.acked_age_s is not None and kept.acked_age_s < 5
    assert [(v, r) for v, r, *_ in later.awaited()] == [(VIN, "task_b")]
    _put(store, writer, VIN, "task_a", b"a2")  # replaced: another row
    assert later.tried(VIN, "task_a", sha1(b"a2")).attempts == 0
    assert rows.ack(VIN, "task_b", b.sha1, outcome=Outcome.RESPONDED)
    _commit(writer)
    poll(lambda: not rows.acking(VIN, "task_b", b.sha1))  # its future's callback
    assert store.counts()["tries"] == 0 and store.counts()["awaited"] == 0
    assert later.awaited() == []


def test_a_record_for_a_row_ended_first_is_dropped(lmdb_rows: tuple[Store, GroupCommitter, StoreRows]) -> None:
    """A publish kept after its row's end committed (a cancel, expiry) writes nothing."""
    store, writer, rows = lmdb_rows
    _put(store, writer, VIN, "task_a", b"a")
    row = store.row(VIN, "task_a")
    assert row is not None
    writer.submit(lambda txn: batches.delete_row_if(txn, store.tables, VIN, "task_a", row.sha1, 2)).result(5)
    rows.sent(VIN, row, 1)
    _commit(writer)
    assert store.counts()["tries"] == 0


def test_a_dispatcher_restores_answers_awaited_at_start(lmdb_rows: tuple[Store, GroupCommitter, StoreRows]) -> None:
    """What `FanoutServer.start` does: the owning worker holds the slot again."""
    store, writer, rows = lmdb_rows
    _put(store, writer, VIN, "task_b", b"b", awaits=True)
    b = store.row(VIN, "task_b")
    assert b is not None
    rows.sent(VIN, b, 3)
    rows.awaiting(VIN, "task_b", b.sha1, 3, session(41000))
    _commit(writer)
    later = StoreRows(store, writer)
    dispatcher = Dispatcher(later, RecordingPublisher(), workers=2, inflight_timeout_s=60)
    assert dispatcher.restore_awaited(later.awaited()) == 1
    entry = dispatcher.worker_of(VIN).inflight[VIN]  # type: ignore[union-attr]
    assert (entry.request_id, entry.attempts, entry.session) == ("task_b", 3, session(41000))
    assert entry.acked_at is not None


def test_a_schema_3_store_opens_and_keeps_attempts(tmp_path: Path) -> None:
    """A data dir written before attempts were kept: a reader is told to start the server once;
    a writer adds the tables and carries on with the rows it had."""
    path = tmp_path / "lmdb"
    with Store(path) as s:
        _put_plain(s, VIN, "task_a", b"a")
    env = lmdb.open(str(path), max_dbs=32)  # as a schema-3 build left it: no attempt tables
    with env.begin(write=True) as txn:
        for name in (b"tries", b"awaited"):
            txn.drop(env.open_db(name, txn=txn), delete=True)
        txn.put(b"schema_version", b"3", db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(StorageError, match="predates schema 4"):
        Store(path, readonly=True)
    with Store(path) as s:
        assert s.schema_version == SCHEMA_VERSION
        writer = GroupCommitter(s)
        rows = StoreRows(s, writer)
        row = s.row(VIN, "task_a")
        assert row is not None
        rows.sent(VIN, row, 1)
        writer.close()
        assert s.tried(VIN, "task_a", row.sha1, 2).attempts == 1
    with Store(path, readonly=True) as s:
        assert s.schema_version == SCHEMA_VERSION


def _put_plain(store: Store, vin: str, rid: str, blob: bytes) -> None:
    with store.write() as txn:
        batches.store_batch(txn, store.tables, [vin], rid, blob, 1)


class _FailsFirst:
    """A committer whose first submit fails before its op runs (as a closed or full store's does)."""

    def __init__(self, writer: GroupCommitter) -> None:
        self._writer, self.failed = writer, False

    def submit(self, op: Any, **kwargs: Any) -> Future[Any]:
        if not self.failed:
            self.failed = True
            future: Future[Any] = Future()
            future.set_exception(StorageError("map full"))
            return future
        return self._writer.submit(op, **kwargs)


def test_records_are_kept_again_after_an_op_that_failed_before_it_ran(
    lmdb_rows: tuple[Store, GroupCommitter, StoreRows],
) -> None:
    """The record of the failed op is lost (one more delivery at worst); the next ones are kept."""
    store, writer, _ = lmdb_rows
    _put(store, writer, VIN, "task_a", b"a")
    a = store.row(VIN, "task_a")
    assert a is not None
    failing = _FailsFirst(writer)
    rows = StoreRows(store, failing)  # type: ignore[arg-type]
    rows.sent(VIN, a, 1)
    assert failing.failed
    rows.sent(VIN, a, 2)
    _commit(writer)
    assert StoreRows(store, writer).tried(VIN, "task_a", a.sha1).attempts == 2


def test_a_row_whose_delete_is_on_its_way_has_nothing_kept(lmdb_rows: tuple[Store, GroupCommitter, StoreRows]) -> None:
    """An answered row of a previous start, its delete not committed yet: a duplicate PUBACK must
    not find its awaited state and take the vehicle's slot again."""
    store, writer, rows = lmdb_rows
    _put(store, writer, VIN, "task_b", b"b", awaits=True)
    b = store.row(VIN, "task_b")
    assert b is not None
    rows.awaiting(VIN, "task_b", b.sha1, 1, session(41000))
    _commit(writer)
    later = StoreRows(store, writer)  # after a restart
    assert later.tried(VIN, "task_b", b.sha1).awaits
    assert later.ack(VIN, "task_b", b.sha1, outcome=Outcome.RESPONDED)
    assert later.acking(VIN, "task_b", b.sha1)
    assert later.tried(VIN, "task_b", b.sha1) == NOTHING_KEPT


def test_acked_rows_end_by_one_lazy_op_and_a_failed_op_leaves_none_behind(
    lmdb_rows: tuple[Store, GroupCommitter, StoreRows],
) -> None:
    """Rows acked in one commit window end by one op with that commit; an op that failed before it
    ran makes its rows visible again (delivered once more at worst) and the next acks end theirs."""
    store, writer, _ = lmdb_rows
    for rid in ("task_a", "task_b", "task_c"):
        _put(store, writer, VIN, rid, rid.encode())
    failing = _FailsFirst(writer)
    rows = StoreRows(store, failing)  # type: ignore[arg-type]
    assert rows.ack(VIN, "task_a", sha1(b"task_a"))
    assert failing.failed and not rows.acking(VIN, "task_a", sha1(b"task_a"))
    assert rows.ack(VIN, "task_b", sha1(b"task_b")) and rows.ack(VIN, "task_c", sha1(b"task_c"))
    assert rows.acking(VIN, "task_c", sha1(b"task_c"))
    _commit(writer)
    assert [store.row(VIN, rid) is None for rid in ("task_a", "task_b", "task_c")] == [False, True, True]
    assert not rows.acking(VIN, "task_b", sha1(b"task_b")) and not rows.acking(VIN, "task_c", sha1(b"task_c"))
    assert store.outcome(VIN, "task_c", sha1(b"task_c")) is Outcome.DELIVERED
