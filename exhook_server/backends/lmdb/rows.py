"""LMDB: the rows dispatch reads and deletes (a `RowSource` over the store and its group committer).

Acked rows are ended lazily, by one op per commit window (`batches.DeleteRows`), so the vehicle's next
request need not wait: from the ack on, the row is hidden from `oldest` until its delete has committed;
a crash in between only brings the row back for one more delivery (QoS 1 allows it). Publishes and
PUBACKs of awaited deliveries are kept (`tries`, `awaited`) the same way (`batches.RecordTries`), never
by an fsync of their own: a kill -9 loses at most that window's records (a row may then be published
once more than `max_attempts`, never fewer; an awaited delivery may go once more).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future
from typing import Any

import structlog

from exhook_server.dispatch.commands import Session
from exhook_server.dispatch.worker import NOTHING_KEPT, Kept
from storage.lmdb import batches, keys
from storage.lmdb.store import Store
from storage.lmdb.writer import GroupCommitter
from storage.model import Outcome, Row, now_ms

log = structlog.get_logger("sdv_fanout.dispatch")

#: A queue longer than this keeps its head: a quarter of its rows, at most _HEAD_MAX_ROWS.
_HEAD_ROWS = 32
_HEAD_MAX_ROWS = 256
#: Heads kept at most (least recently used go): ~300 B per row, so at most ~40 MB.
_HEADS_MAX = 512


class StoreRows:
    """RowSource over a Store: reads in the caller's thread, deletes through group commit.

    A vehicle back online with a long queue is drained one delivery at a time, and finding the
    oldest row is a pass over its whole queue, so the drain would cost O(rows²). For such queues the
    head of the queue (its first quarter, in delivery order) is kept between deliveries and checked
    row by row instead: a pass per quarter of the queue, not per delivery. New normal rows only join
    at the end of a queue, so the head stays right; a high-priority row stored since, or a change of
    the requests whose policy says high, makes every head be read again.
    """

    def __init__(self, store: Store, committer: GroupCommitter) -> None:
        self._store = store
        self._committer = committer
        #: vin → request_id → sha1 of acked rows whose delete is not committed yet. Written by
        #: the dispatch loop, cleared by the writer thread's completion callback.
        self._deleting: dict[str, dict[str, bytes]] = {}
        self._lock = threading.Lock()
        #: vin → the rows at the head of its long queue, in delivery order (dispatch loop only).
        self._heads: OrderedDict[str, deque[Row]] = OrderedDict()  # (also its first row, until acked)
        #: What the heads were read under: `Store.high_rows_stored` and the high request ids.
        self._heads_read: tuple[int, frozenset[str]] = (-1, frozenset())
        #: Rows read by passes over queues, for tests and benchmarks.
        self.rows_scanned = 0
        #: Acked rows to end, in order, not yet taken by a commit (see `batches.DeleteRows`;
        #: under `_lock`, with `_deleting`).
        self._ends: list[batches.RowEnd] = []
        #: Publishes and PUBACKs to keep, in order, not yet taken by a commit (see `batches.RecordTries`).
        self._tries: list[batches.TryRecord] = []
        self._tries_lock = threading.Lock()
        #: Rows stored since are known to dispatch's memory (as they are in PostgreSQL's one
        #: delivery per vehicle); the store's count of the older ones bridges the restart.
        self._started_ms = now_ms()

    def oldest(
        self, vin: str, skip: frozenset[str] | None = None, high: frozenset[str] | None = None
    ) -> tuple[Row, bytes] | None:
        with self._lock:
            hidden = self._deleting.get(vin)
            hidden = dict(hidden) if hidden else None
        if skip:
            # Some requests are held by their campaign policy: one pass that passes over their
            # rows (the kept head is for queues that drain in order, and stays as it is).
            found, count = self._store.oldest(vin, hidden, skip, high)
            self.rows_scanned += count
            return found
        # A kept head is overtaken by a high-priority row stored since, or a change of the
        # requests whose policy says high: then every head is read again.
        if self._heads and self._heads_read != (self._store.high_rows_stored(), high or frozenset()):
            self._heads.clear()
        head = self._heads.get(vin)
        if head is not None:
            self._heads.move_to_end(vin)
            found = self._first_current(head, hidden)
            if found is not None:
                return found
            del self._heads[vin]  # used up: read the next head
        found, count = self._store.oldest(vin, hidden, None, high)
        self.rows_scanned += count
        if count > _HEAD_ROWS:  # a long queue: keep its head for the next deliveries
            if not self._heads:
                self._heads_read = (self._store.high_rows_stored(), high or frozenset())
            rows, count = self._store.queue_head(vin, min(_HEAD_MAX_ROWS, count // 4), hidden, high)
            self.rows_scanned += count
            self._heads[vin] = deque(rows)
            if len(self._heads) > _HEADS_MAX:
                self._heads.popitem(last=False)
        return found

    def _first_current(self, head: deque[Row], hidden: dict[str, bytes] | None) -> tuple[Row, bytes] | None:
        """The first row of `head` still pending as read and not hidden; rows before it are
        dropped from `head` (delivered, expired, replaced, or without their blob)."""
        while head:
            row = head[0]
            if not (hidden and hidden.get(row.request_id) == row.sha1):
                payload = self._store.payload_if_current(row)
                if payload is not None:
                    return row, payload
            head.popleft()
        return None

    def ack(
        self,
        vin: str,
        request_id: str,
        sha1: bytes,
        *,
        outcome: Outcome = Outcome.DELIVERED,
        attempts: int = 1,
        response: bytes = b"",
    ) -> bool:
        with self._lock:
            if self._deleting.get(vin, {}).get(request_id) == sha1:
                return False  # a duplicate PUBACK: its delete is already on its way
        if (
            self._store.row_sha1(vin, request_id) != sha1
            and self._store.outcome(vin, request_id, sha1) is not Outcome.CANCELLED
        ):
            # Nothing of ours to end (a duplicate PUBACK, or the row was replaced since), and no
            # cancelled delivery to amend: no write at all. The op re-checks inside its
            # transaction, so this read only ever saves work, it never decides.
            return False
        with self._lock:
            self._deleting.setdefault(vin, {})[request_id] = sha1
            self._ends.append((vin, request_id, sha1, now_ms(), outcome, attempts, response))
            first = len(self._ends) == 1
        if first:  # one op per commit window ends every row acked until it runs
            op = batches.DeleteRows(self._store.tables, self._take_ends)
            future = self._committer.submit(op, lazy=True)
            future.add_done_callback(functools.partial(self._deleted, op))
        return True

    def _take_ends(self) -> list[batches.RowEnd]:
        with self._lock:
            taken, self._ends = self._ends, []
        return taken

    def _deleted(self, op: batches.DeleteRows, future: Future[list[bool]]) -> None:
        ends = op.ends()  # an op that failed before it ran takes its ends now: none stays queued
        with self._lock:
            for vin, request_id, sha1, *_ in ends:
                mine = self._deleting.get(vin)
                if mine is not None and mine.get(request_id) == sha1:
                    del mine[request_id]
                    if not mine:
                        del self._deleting[vin]
        if future.exception() is not None:
            # The rows stay and are visible again: the next trigger delivers each once more.
            for vin, request_id, *_ in ends:
                log.error("ack_delete_failed", vin=vin, request_id=request_id, error=repr(future.exception()))

    def acking(self, vin: str, request_id: str, sha1: bytes) -> bool:
        with self._lock:
            return self._deleting.get(vin, {}).get(request_id) == sha1

    # -- attempts kept across restarts ------------------------------------------------
    def tried(self, vin: str, request_id: str, sha1: bytes, stored_ms: int = -1) -> Kept:
        if stored_ms >= self._started_ms:
            return NOTHING_KEPT  # stored since the start: dispatch's memory knows it all
        if self.acking(vin, request_id, sha1):
            return NOTHING_KEPT  # ended, its delete on its way: nothing to resume (no read either)
        rkey = keys.row_key(vin, request_id)
        with self._tries_lock:  # not committed yet: the newest word
            waiting = [r for r in self._tries if r[0] == rkey and r[1] == sha1] if self._tries else None
        kept = self._store.tried(vin, request_id, sha1, self._started_ms)
        attempts, acked_ms, session = kept.attempts, kept.acked_ms, kept.session
        for _, _, n, ms, who in waiting or ():
            attempts = max(attempts, n)
            acked_ms, session = (ms, who) if who is not None else (0, None)
        if not attempts and not kept.awaits:
            return NOTHING_KEPT
        if session is None:
            return Kept(attempts, kept.awaits)
        age = max(0.0, (now_ms() - acked_ms) / 1000)
        return Kept(attempts, kept.awaits, age, Session(*session))

    def sent(self, vin: str, row: Row, attempts: int) -> None:
        self._keep((keys.row_key(vin, row.request_id), row.sha1, attempts, now_ms(), None))

    def awaiting(self, vin: str, request_id: str, sha1: bytes, attempts: int, session: Session) -> None:
        who = session.__reduce__()[1]
        self._keep((keys.row_key(vin, request_id), sha1, attempts, now_ms(), who))

    def _keep(self, record: batches.TryRecord) -> None:
        with self._tries_lock:
            self._tries.append(record)
            first = len(self._tries) == 1
        if first:  # one op per commit window takes every record queued until it runs
            op = batches.RecordTries(self._store.tables, self.take_tries)
            future = self._committer.submit(op, lazy=True)
            future.add_done_callback(functools.partial(_tries_done, op))

    def take_tries(self) -> list[batches.TryRecord]:
        with self._tries_lock:
            taken, self._tries = self._tries, []
        return taken

    def awaited(self) -> list[tuple[str, str, bytes, Kept]]:
        """Deliveries PUBACKed before this start whose answer is still awaited: (VIN, request
        id, sha1, what is kept of it)."""
        now = now_ms()
        return [
            (vin, rid, sha1, Kept(attempts, True, max(0.0, (now - acked_ms) / 1000), Session(*session)))
            for vin, rid, sha1, attempts, acked_ms, session in self._store.awaited()
        ]

    def sent_out(self, inflight_timeout_s: float) -> list[tuple[str, str, int]]:
        """Deliveries published before this start and still out (neither ended nor PUBACKed
        awaiting an answer) within their in-flight timeout: (VIN, request id, until when
        (epoch ms) each counts as out)."""
        timeout_ms = round(inflight_timeout_s * 1000)
        found = self._store.sent_since(now_ms() - timeout_ms)
        return [(vin, rid, last_ms + timeout_ms) for vin, rid, last_ms in found]

    def deleting(self) -> int:
        """Vehicles with an acked row whose delete is not committed yet."""
        return len(self._deleting)


def _tries_done(op: batches.RecordTries, future: Future[Any]) -> None:
    """A failed op's records count as never published (at worst one more delivery of those
    rows). One that failed before it ran (store closed or full) drops the records it would have
    taken: else they would stay queued, and no later record would submit an op again."""
    if future.exception() is None:
        return
    log.error("attempts_not_kept", error=repr(future.exception()), records=len(op.records()))
