"""The LMDB environment: opening it, growing its map, and read-only queries.

One environment holds every table (named databases, layout in `keys`). Reads
run in the caller's thread; writes go through `writer.GroupCommitter`. Growing
the map needs every transaction of this process closed, so reads and writes
pass through a gate that the resize closes for a moment.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import threading
from collections.abc import Iterator, Mapping
from collections.abc import Set as AbstractSet
from pathlib import Path
from types import TracebackType
from typing import NamedTuple, cast

import lmdb

from storage.errors import StorageError
from storage.lmdb import keys, queue
from storage.lmdb.cancel import cut_of
from storage.lmdb.outcomes import outcome_of
from storage.lmdb.queue import rebuild_indexes
from storage.lmdb.tables import ADDED_IN, DB_NAMES, SCHEMA_VERSION, Db, Tables
from storage.model import Outcome
from storage.model import Stats as Stats
from storage.model import now_ms as now_ms


class _Gate:
    """Many transactions at once, or one map resize alone."""

    def __init__(self) -> None:
        # The lock itself on the way in and out (no Condition frames): every delivery passes
        # here twice; the condition, on the same lock, only for waits around a resize.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._active = 0
        self._resizing = False

    def enter(self) -> None:
        """One more transaction; waits while a resize runs."""
        with self._lock:
            while self._resizing:
                self._cond.wait()
            self._active += 1

    def leave(self) -> None:
        with self._lock:
            self._active -= 1
            if not self._active and self._resizing:
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._resizing = True
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


class _Txn:
    """One transaction of a Store as a context manager: it holds the gate, adopts a map another
    process grew, commits a write block that ends cleanly and aborts everything else.

    A class rather than a generator-based context manager: dispatch opens read transactions for
    every delivery, and two nested generators (with the gate's) cost about 4 µs of Python per
    transaction, against 0.3 µs for LMDB's begin and abort.
    """

    __slots__ = ("_buffers", "_store", "_txn", "_write")

    def __init__(self, store: Store, write: bool, buffers: bool = True) -> None:
        self._store = store
        self._write = write
        self._buffers = buffers
        self._txn: lmdb.Transaction | None = None

    def __enter__(self) -> lmdb.Transaction:
        store = self._store
        gate = store._gate
        while True:
            gate.enter()
            try:
                txn = (
                    store.env.begin(write=self._write, buffers=True)
                    if self._buffers
                    else store.env.begin(write=self._write)
                )
            except lmdb.MapResizedError:
                gate.leave()
            except BaseException:
                gate.leave()
                raise
            else:
                self._txn = txn
                return txn
            # Another process sharing the environment (a server process of the same group, or
            # `gc run`) grew the map. Adopting its size needs every transaction of ours closed.
            with gate.exclusive():
                store.env.set_mapsize(0)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        txn, self._txn = self._txn, None
        assert txn is not None
        try:
            if exc_type is None and self._write:
                txn.commit()
            else:
                txn.abort()
        finally:
            self._store._gate.leave()


class Tried(NamedTuple):
    """What the store keeps of a row's deliveries (`Store.tried`)."""

    #: Times the row was published (as far as the last commit knows).
    attempts: int
    #: The row's answer, not its PUBACK, ends it (await_response).
    awaits: bool = False
    #: When the vehicle PUBACKed it, its answer awaited since (epoch ms); 0: not PUBACKed.
    acked_ms: int = 0
    #: (node, clientid, host, port) of the session that PUBACKed it.
    session: tuple[str, str, str, int] | None = None


_NEVER = Tried(0)


class Store:
    """One LMDB environment with sdv-fanout's tables.

    `readonly=True` opens an environment another process is writing (the
    `stats` and `inspect` commands): LMDB readers never block the writer.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size_bytes: int = 1 << 30,
        map_max_bytes: int = 1 << 40,
        readonly: bool = False,
    ) -> None:
        self.path = Path(path)
        self.readonly = readonly
        self.map_max_bytes = map_max_bytes
        self._gate = _Gate()
        if readonly:
            if not (self.path / "data.mdb").exists():
                raise StorageError(f"no sdv-fanout data in {self.path}")
        else:
            self.path.mkdir(parents=True, exist_ok=True)
        try:
            self.env = lmdb.open(
                str(self.path),
                map_size=map_size_bytes,
                max_dbs=len(DB_NAMES),
                readonly=readonly,
                # Durability: every commit is fsynced (data and meta page).
                sync=True,
                metasync=True,
                # Blobs are read at random; kernel readahead would only waste cache.
                readahead=False,
                # gRPC handler threads, dispatch workers and CLI processes read at once.
                max_readers=1024,
            )
        except lmdb.Error as exc:
            raise StorageError(f"cannot open LMDB at {self.path}: {exc}") from exc
        if readonly:
            # Another process may have grown the map since the file was created.
            self.env.set_mapsize(0)
        else:
            #: Reader slots left behind by processes killed mid-read (kill -9).
            self.stale_readers_cleared = self.env.reader_check()
        try:
            self.tables = Tables(**{name: self._open_db(name) for name in DB_NAMES})
        except lmdb.Error as exc:
            self.env.close()
            raise StorageError(f"{self.path} is not an sdv-fanout store: {exc}") from exc
        self.schema_version = self._check_schema()

    # -- lifecycle -------------------------------------------------------------
    def _open_db(self, name: str) -> Db:
        try:
            return self.env.open_db(name.encode(), create=not self.readonly)
        except lmdb.NotFoundError:
            if name in ADDED_IN:  # an older store read before any writer upgraded it
                raise StorageError(
                    f"{self.path} predates schema {ADDED_IN[name]}: start the server once to upgrade it"
                ) from None
            raise

    def _check_schema(self) -> int:
        with self.env.begin(write=not self.readonly, db=self.tables.meta) as txn:
            raw = txn.get(b"schema_version")
            if raw is None:
                if self.readonly:
                    raise StorageError(f"{self.path} has no schema version")
                txn.put(b"schema_version", str(SCHEMA_VERSION).encode())
                txn.put(b"created_at_ms", str(now_ms()).encode())
                return SCHEMA_VERSION
            version = int(raw)
            if version in (1, 2, 3, 4, 5, 6, 7, 8) and not self.readonly:
                if version == 1:
                    _upgrade_from_1(txn, self.tables)
                if version < 3:
                    rebuild_indexes(txn, self.tables)
                # 3 → 4: the attempt tables start empty (opened above): rows out for delivery
                # count from 0 once more, as they did after any restart before. 4 → 5: no
                # request has a policy yet (its table was created empty above). 5 → 6: no campaign
                # was aborted, no failed answer counted (their tables start empty). 6 → 7: no
                # latency was counted yet (likewise). 7 → 8: a `tries` value written before
                # holds no send times and reads as "not known" (0). 8 → 9: an outcome recorded
                # before has no send time (its code byte says so).
                txn.put(b"schema_version", str(SCHEMA_VERSION).encode(), db=self.tables.meta)
                return SCHEMA_VERSION
        if version != SCHEMA_VERSION:
            raise StorageError(f"{self.path} has schema version {version}; this build reads {SCHEMA_VERSION}")
        return version

    def close(self) -> None:
        with self._gate.exclusive():
            self.env.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transactions ----------------------------------------------------------
    def read(self) -> _Txn:
        """A read-only snapshot (`with store.read() as txn`); values are memoryviews valid
        inside the block."""
        return _Txn(self, write=False)

    def _read_bytes(self) -> _Txn:
        """A read-only snapshot whose keys and values are bytes (copied out): cheaper than
        memoryviews for the short keys and values a queue scan compares and slices."""
        return _Txn(self, write=False, buffers=False)

    def write(self) -> _Txn:
        """One write transaction (`with store.write() as txn`), committed (and fsynced) when the
        block ends cleanly."""
        return _Txn(self, write=True)

    def map_size(self) -> int:
        return int(self.env.info()["map_size"])

    def map_usage(self) -> float:
        """Used pages over the map size: how close the next growth (or StorageFull) is."""
        info, stat = self.env.info(), self.env.stat()
        return (int(info["last_pgno"]) + 1) * int(stat["psize"]) / int(info["map_size"])

    def grow(self) -> bool:
        """Double the map (up to map_max_bytes); False when it cannot grow any more."""
        with self._gate.exclusive():
            current = self.map_size()
            if current >= self.map_max_bytes:
                return False
            self.env.set_mapsize(min(current * 2, self.map_max_bytes))
            return True

    # -- queries ---------------------------------------------------------------
    def _queue(self, txn: lmdb.Transaction, vin: str, high: AbstractSet[str] | None = None) -> list[keys.Row]:
        """A vehicle's rows in delivery order: high priority first (their batch asked it, or
        their request id is in `high`), oldest first, then by request id."""
        prefix = keys.vin_prefix(vin)
        rows = []
        cur = txn.cursor(self.tables.ids)
        if cur.set_range(prefix):
            for key, value in cur:
                if not bytes(key).startswith(prefix):
                    break
                rows.append(keys.decode_row(key, value))
        rows.sort(key=lambda r: (not (r.high_priority or (high and r.request_id in high)), r.ts_ms, r.request_id))
        return rows

    def _visible_rows(
        self,
        txn: lmdb.Transaction,
        prefix: bytes,
        hidden: Mapping[str, bytes] | None,
        held: AbstractSet[str] | None = None,
    ) -> Iterator[tuple[bytes, bytes]]:
        """(request id, raw value) of the rows under a VIN prefix that may still be sent, in key
        order (`txn` from `_read_bytes`). Left out: those `hidden` names with the same sha1, rows
        of the request ids `held` names (their campaign policy holds them), rows past their
        expires_at (the sweep ends them soon; a vehicle never waits for it), and rows a cancel in
        progress is about to remove."""
        skip = {rid.encode(): sha1 for rid, sha1 in hidden.items()} if hidden else None
        held_ids = {rid.encode() for rid in held} if held else None
        cancels = self._cancel_cuts(txn)
        now = now_ms()
        cur = txn.cursor(self.tables.ids)
        if not cur.set_range(prefix):
            return
        n = len(prefix)
        for key, value in cast("Iterator[tuple[bytes, bytes]]", cur):
            if not key.startswith(prefix):
                return
            rid = key[n:]
            if skip and skip.get(rid) == value[8:28]:  # keys.row_sha1
                continue
            if held_ids and rid in held_ids:
                continue
            if len(value) > 32 and 0 < keys.row_expires(value) <= now:
                continue
            if cancels and keys.row_ts(value) <= cancels.get(rid, -1):
                continue
            yield rid, value

    def _cancel_cuts(self, txn: lmdb.Transaction) -> dict[bytes, int] | None:
        """request id → cut of every cancel-all in progress (rows stored up to the cut are
        being cancelled); None when there is none (the usual case, one O(1) stat)."""
        cur = txn.cursor(self.tables.cancels)
        if not cur.first():  # cheaper than txn.stat, which builds a dict
            return None
        return {bytes(k): cut_of(v) for k, v in cur}

    def row(self, vin: str, request_id: str) -> keys.Row | None:
        """The pending row (vin, request_id), or None."""
        rkey = keys.row_key(vin, request_id)
        with self._read_bytes() as txn:
            value = txn.get(rkey, db=self.tables.ids)
        return None if value is None else keys.decode_row(rkey, value)

    def row_sha1(self, vin: str, request_id: str) -> bytes | None:
        """The sha1 of the pending row (vin, request_id), or None: `row` without the decode."""
        with self._read_bytes() as txn:
            value = txn.get(keys.row_key(vin, request_id), db=self.tables.ids)
        return None if value is None else keys.row_sha1(value)

    def outcome(self, vin: str, request_id: str, sha1: bytes) -> Outcome | None:
        """How the pair (vin, request_id, sha1) ended (an `outcomes.Outcome`), or None."""

        with self.read() as txn:
            return outcome_of(txn, self.tables, vin, request_id, sha1)

    def tried(self, vin: str, request_id: str, sha1: bytes, stored_before_ms: int) -> Tried:
        """What the store keeps of the deliveries of the row (vin, request_id) holding `sha1`:
        nothing (all zero) when the row is gone, holds another payload, or was stored at or
        after `stored_before_ms` (its deliveries are known to the caller)."""
        rkey = keys.row_key(vin, request_id)
        t = self.tables
        with self.read() as txn:
            value = txn.get(rkey, db=t.ids)
            if value is None or keys.row_sha1(value) != sha1 or keys.row_ts(value) >= stored_before_ms:
                return _NEVER
            awaits = keys.row_awaits(value)
            raw = txn.get(rkey, db=t.tries)
            attempts = 0
            if raw is not None:
                kept_sha1, attempts, _, _ = keys.decode_tries(raw)
                if kept_sha1 != sha1:
                    attempts = 0
            if awaits and (raw := txn.get(rkey, db=t.awaited)) is not None:
                kept_sha1, n, acked_ms, session = keys.decode_awaited(raw)
                if kept_sha1 == sha1:
                    return Tried(max(attempts, n), True, acked_ms, session)
            return Tried(attempts, awaits)

    def awaited(self) -> list[tuple[str, str, bytes, int, int, tuple[str, str, str, int]]]:
        """Every delivery PUBACKed whose answer is still awaited: (VIN, request id, sha1,
        attempts, PUBACKed at ms, session). One pass over those alone."""
        t = self.tables
        found = []
        with self.read() as txn:
            for key, raw in txn.cursor(t.awaited):
                value = txn.get(key, db=t.ids)
                sha1, attempts, acked_ms, session = keys.decode_awaited(raw)
                if value is not None and keys.row_sha1(value) == sha1:
                    vin, request_id = keys.split_rkey(bytes(key))
                    found.append((vin, request_id, sha1, attempts, acked_ms, session))
        return found

    def sent_since(self, since_ms: int) -> list[tuple[str, str, int]]:
        """Deliveries last published at or after `since_ms` whose row still holds what was
        published and that no PUBACK awaiting an answer took: (VIN, request id, last published
        at ms). One pass over the rows published and not ended."""
        t = self.tables
        found = []
        with self.read() as txn:
            for key, raw in txn.cursor(t.tries):
                sha1, _, _, last_ms = keys.decode_tries(raw)
                if last_ms < since_ms:
                    continue
                value = txn.get(key, db=t.ids)
                if value is None or keys.row_sha1(value) != sha1:
                    continue
                if (took := txn.get(key, db=t.awaited)) is not None and keys.decode_awaited(took)[0] == sha1:
                    continue
                vin, request_id = keys.split_rkey(bytes(key))
                found.append((vin, request_id, last_ms))
        return found

    def pending(self, vin: str) -> list[keys.Row]:
        """The vehicle's pending requests in delivery order."""
        with self.read() as txn:
            return self._queue(txn, vin)

    def oldest(
        self,
        vin: str,
        hidden: Mapping[str, bytes] | None = None,
        held: AbstractSet[str] | None = None,
        high: AbstractSet[str] | None = None,
    ) -> tuple[tuple[keys.Row, bytes] | None, int]:
        """The vehicle's next request and its payload (None when nothing is deliverable), and
        how many rows it has pending besides the hidden ones, from one snapshot and one pass
        comparing raw bytes (no decode, no sort). A row whose blob is missing is skipped, as it
        can never be delivered. Next: its oldest high-priority row (its batch asked it, or its
        request id is in `high`), else its oldest row.

        `hidden` maps request ids to the sha1 of rows to pass over: acked, their delete not
        committed yet. A row replaced since (another sha1) is not hidden. Rows of the request ids
        in `held` are passed over too (and not counted).
        """
        prefix = keys.vin_prefix(vin)
        high_ids = {rid.encode() for rid in high} if high else None
        count = 0
        with self._read_bytes() as txn:
            best: tuple[tuple[bytes, bytes], bytes] | None = None
            for rid, value in self._visible_rows(txn, prefix, hidden, held):
                count += 1
                order = keys.row_order(rid, value, high_ids)
                if best is None or order < best[0]:
                    best = (order, bytes(value))
            if best is None:
                return None, 0
            row = keys.decode_row(prefix + best[0][1], best[1])
            blob = txn.get(row.sha1, db=self.tables.data)
            if blob is not None:
                return (row, bytes(blob[keys.BLOB_HEAD_SIZE :])), count
            # Its blob is gone (lost data, never the normal case): walk the queue in order, passing
            # over what the first pass passes over (hidden, expired, taken by a cancel).
            cancels = self._cancel_cuts(txn)
            now = now_ms()
            for row in self._queue(txn, vin, high):
                if hidden and hidden.get(row.request_id) == row.sha1:
                    continue
                if held and row.request_id in held:
                    continue
                if row.expired(now) or (cancels and row.ts_ms <= cancels.get(row.request_id.encode(), -1)):
                    continue
                blob = txn.get(row.sha1, db=self.tables.data)
                if blob is not None:
                    return (row, bytes(blob[keys.BLOB_HEAD_SIZE :])), count
        return None, count

    def queue_head(
        self, vin: str, n: int, hidden: Mapping[str, bytes] | None = None, high: AbstractSet[str] | None = None
    ) -> tuple[list[keys.Row], int]:
        """The vehicle's first `n` rows in delivery order (`high` as in `oldest`), and how many
        it has in all, from one pass that decodes only those `n`. Rows `hidden` names (request
        id → sha1: acked, their delete not committed yet) are left out, unless replaced since.

        Normal rows only ever join a queue at its end (they are stamped when stored), so a head
        read once stays the head while it is being delivered, until a high-priority row is
        stored (`high_rows_stored`) or `high` changes: callers may keep it and check each row
        with `payload_if_current` instead of scanning the whole queue again for every delivery.
        """
        prefix = keys.vin_prefix(vin)
        high_ids = {rid.encode() for rid in high} if high else None
        with self._read_bytes() as txn:
            entries = [
                (keys.row_order(rid, value, high_ids), rid, bytes(value))
                for rid, value in self._visible_rows(txn, prefix, hidden)
            ]
        head = heapq.nsmallest(n, entries) if len(entries) > n else sorted(entries)
        return [keys.decode_row(prefix + rid, value) for _, rid, value in head], len(entries)

    def payload_if_current(self, row: keys.Row) -> bytes | None:
        """The payload of `row` if the row is still pending as it was read (not delivered and
        deleted, expired or replaced since) and its blob is there; else None."""
        rkey = keys.row_key(row.vin, row.request_id)
        with self._read_bytes() as txn:
            value = txn.get(rkey, db=self.tables.ids)
            if value is None or value != keys.encoded_row(row) or row.expired(now_ms()):
                return None
            cancels = self._cancel_cuts(txn)
            if cancels and row.ts_ms <= cancels.get(row.request_id.encode(), -1):
                return None
            blob = txn.get(row.sha1, db=self.tables.data)
            return None if blob is None else bytes(blob[keys.BLOB_HEAD_SIZE :])

    def high_rows_stored(self) -> int:
        """How many batches stored high-priority rows since the store was created (a counter in
        `meta`, written with them): a change says a kept queue head may have been overtaken."""
        with self.read() as txn:
            raw = txn.get(keys.HIGH_ROWS_STORED, db=self.tables.meta)
            return 0 if raw is None else keys.decode_u64(raw)

    def blob(self, sha1: bytes) -> bytes | None:
        """The stored payload for `sha1`, or None when it is gone."""
        with self.read() as txn:
            value = txn.get(sha1, db=self.tables.data)
            return None if value is None else bytes(value[keys.BLOB_HEAD_SIZE :])

    def alias(self, data_id: str) -> bytes | None:
        """The sha1 a platform data_id currently names."""
        with self.read() as txn:
            value = txn.get(data_id.encode(), db=self.tables.aliases)
            return None if value is None else keys.decode_alias(value)[0]

    def counts(self) -> dict[str, int]:
        """Entries per table, O(1) (no scan)."""
        with self.read() as txn:
            return {name: int(txn.stat(getattr(self.tables, name))["entries"]) for name in self.tables.__slots__}

    def row_count(self) -> int:
        """Pending rows, O(1)."""
        with self.read() as txn:
            return int(txn.stat(self.tables.ids)["entries"])

    def vehicles_at(self, bound: int) -> int:
        """Vehicles with at least `bound` pending rows: a pass over the per-vehicle counts (only
        vehicles with many rows have one), or over every row for a bound below COUNTED_FROM."""

        with self.read() as txn:
            if bound >= queue.COUNTED_FROM:
                return sum(
                    1
                    for raw in txn.cursor(self.tables.backlogs).iternext(keys=False, values=True)
                    if queue.decode_count(raw) >= bound
                )
            per_vin: dict[bytes, int] = {}
            for key in txn.cursor(self.tables.ids).iternext(keys=True, values=False):
                vin = bytes(key).partition(keys.SEP)[0]
                per_vin[vin] = per_vin.get(vin, 0) + 1
            return sum(1 for n in per_vin.values() if n >= bound)

    def backlog(self, vin: str) -> int:
        """The vehicle's pending rows."""

        with self.read() as txn:
            return queue.backlog(txn, self.tables, vin.encode())

    def early_count(self) -> int:
        with self.read() as txn:
            return int(txn.stat(self.tables.early)["entries"])

    def stats(self) -> Stats:
        """Counts and sizes from one snapshot. Scans rows and blob headers: O(rows + blobs)."""
        t = self.tables
        with self.read() as txn:
            blob_bytes = sum(len(v) - keys.BLOB_HEAD_SIZE for _, v in txn.cursor(t.data))
            logical = sum(keys.decode_row(k, v).size for k, v in txn.cursor(t.ids))
            info = self.env.info()
            stat = self.env.stat()
            return Stats(
                rows=int(txn.stat(t.ids)["entries"]),
                blobs=int(txn.stat(t.data)["entries"]),
                blob_bytes=blob_bytes,
                logical_bytes=logical,
                aliases=int(txn.stat(t.aliases)["entries"]),
                early_triggers=int(txn.stat(t.early)["entries"]),
                map_size_bytes=int(info["map_size"]),
                map_used_bytes=(int(info["last_pgno"]) + 1) * int(stat["psize"]),
                schema_version=self.schema_version,
            )


def _upgrade_from_1(txn: lmdb.Transaction, t: Tables) -> None:
    """Version 1 kept no outcomes: each generation found among the rows starts with every row
    pending (its history before the upgrade is unknown). One pass over the rows."""
    counts: dict[bytes, list[int]] = {}
    first: dict[bytes, int] = {}
    for key, value in txn.cursor(t.ids):
        row = keys.decode_row(key, value)
        gkey = keys.gen_key(row.request_id, row.sha1)
        slot = counts.setdefault(gkey, [0] * len(keys.COUNT_NAMES))
        slot[0] += 1
        slot[1] += 1
        first[gkey] = min(first.get(gkey, row.ts_ms), row.ts_ms)
    for gkey, c in counts.items():
        txn.put(gkey, keys.gen_value(first[gkey], first[gkey], c), db=t.gens)
