"""LMDB: how a request ends, per vehicle, and the counts per generation, kept in the row's transaction.

A generation is one (request_id, blob sha1): request ids are reused, so a newer payload under an id is
counted apart. Every (VIN, generation) taken is either pending (a row holds it) or has exactly one
outcome record, and every change of state happens in the transaction that changes the row, so the
counts equal a recount from rows and outcomes after any crash. GC removes outcome records older than
`outcome_retention_s` (the counts keep them) and the counts of generations with nothing pending whose
last change is that old.
"""

from __future__ import annotations

import heapq
import struct
from collections.abc import Iterable

import lmdb

from storage.lmdb import keys
from storage.lmdb.tables import Tables
from storage.model import Generation as Generation
from storage.model import Outcome as Outcome
from storage.model import OutcomeRecord as OutcomeRecord
from storage.model import PageKey as PageKey
from storage.model import answer_failed

_TOTAL = 0
_PENDING = 1
_COUNT = struct.Struct(">Q")


class Bumps:
    """Count changes of many ends in one op, written once per generation (`write`) instead of a
    read, decode, encode and write of the generation's counts per end. Within one op each slot
    only moves one way (pending and cancelled down, an outcome up), so the sum clamps as the
    steps would."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        #: gens key → (last now_ms, slot → delta).
        self._pending: dict[bytes, tuple[int, dict[int, int]]] = {}

    def add(self, request_id: str, sha1: bytes, now_ms: int, deltas: dict[int, int]) -> None:
        key = keys.gen_key(request_id, sha1)
        held = self._pending.get(key)
        if held is None:
            self._pending[key] = (now_ms, dict(deltas))
            return
        sums = held[1]
        for slot, delta in deltas.items():
            sums[slot] = sums.get(slot, 0) + delta
        self._pending[key] = (now_ms, sums)

    def write(self, txn: lmdb.Transaction, t: Tables) -> None:
        for key, (now_ms, deltas) in self._pending.items():
            _bump_key(txn, t, key, now_ms, deltas)
        self._pending.clear()


def _bump(
    txn: lmdb.Transaction,
    t: Tables,
    request_id: str,
    sha1: bytes,
    now_ms: int,
    deltas: dict[int, int],
    bumps: Bumps | None = None,
) -> None:
    if bumps is not None:
        bumps.add(request_id, sha1, now_ms, deltas)
    else:
        _bump_key(txn, t, keys.gen_key(request_id, sha1), now_ms, deltas)


def _bump_key(txn: lmdb.Transaction, t: Tables, key: bytes, now_ms: int, deltas: dict[int, int]) -> None:
    raw = txn.get(key, db=t.gens)
    if raw is None:
        first_ms, counts = now_ms, [0] * len(keys.COUNT_NAMES)
    else:
        first_ms, _, counts = keys.decode_gen(raw)
    for slot, delta in deltas.items():
        counts[slot] = max(0, counts[slot] + delta)  # never negative, whatever an old store holds
    txn.put(key, keys.gen_value(first_ms, now_ms, counts), db=t.gens)


def generation_exists(txn: lmdb.Transaction, t: Tables, request_id: str, sha1: bytes) -> bool:
    return txn.get(keys.gen_key(request_id, sha1), db=t.gens) is not None


def _drop_outcome(txn: lmdb.Transaction, t: Tables, okey: bytes) -> int | None:
    """Delete an outcome record (and its time index entry); its outcome slot, or None."""
    raw = txn.get(okey, db=t.outcomes)
    if raw is None:
        return None
    ts_ms, _, _, code = keys.decode_outcome(raw)
    txn.delete(okey, db=t.outcomes)
    txn.delete(keys.timed_key(ts_ms, okey), db=t.outcome_expiry)
    return code


def rows_pending(
    txn: lmdb.Transaction,
    t: Tables,
    rkeys: Iterable[bytes],
    request_id: str,
    sha1: bytes,
    now_ms: int,
    *,
    known: bool,
) -> None:
    """The rows `rkeys` now hold (request_id, sha1), which they did not hold before.

    `known`: the generation existed before this write. Only then can a VIN have ended it
    already (delivered, then sent the same again): that outcome is undone, the pair is pending
    again and `total` does not grow. A new generation needs no lookup per VIN.
    """
    fresh = 0
    revived: dict[int, int] = {}
    tail = keys.SEP + sha1
    for rkey in rkeys:
        code = _drop_outcome(txn, t, rkey + tail) if known else None
        if code is None:
            fresh += 1
        else:
            revived[code] = revived.get(code, 0) - 1
    added = fresh - sum(revived.values())
    if added:
        _bump(txn, t, request_id, sha1, now_ms, {_TOTAL: fresh, _PENDING: added, **revived})


def end(
    txn: lmdb.Transaction,
    t: Tables,
    rkey: bytes,
    request_id: str,
    sha1: bytes,
    outcome: Outcome,
    now_ms: int,
    stored_ms: int,
    attempts: int = 0,
    response: bytes = b"",
    sent_ms: int = 0,
    bumps: Bumps | None = None,
) -> None:
    """The pending pair (row `rkey`, generation), stored at `stored_ms` and first published at
    `sent_ms` (0: never, or not known), ends with `outcome` (its row is being deleted or replaced
    in this transaction). With `bumps` the generation's counts change when it is written."""
    okey = rkey + keys.SEP + sha1
    _drop_outcome(txn, t, okey)  # none is expected: the pair was pending
    txn.put(okey, keys.outcome_value(now_ms, stored_ms, attempts, outcome.value, response, sent_ms), db=t.outcomes)
    txn.put(keys.timed_key(now_ms, okey), b"", db=t.outcome_expiry)
    _bump(txn, t, request_id, sha1, now_ms, {_PENDING: -1, outcome.value: 1}, bumps)
    _count_answer(txn, t, request_id, outcome, response)


def _count_answer(txn: lmdb.Transaction, t: Tables, request_id: str, outcome: Outcome, response: bytes) -> None:
    """A failed answer (`model.answer_failed`) counts for its request, in the transaction that
    records it (the `answer_failed` abort criterion reads the count)."""
    if outcome is Outcome.RESPONDED and response and answer_failed(response):
        key = request_id.encode()
        raw = txn.get(key, db=t.answers_failed)
        txn.put(key, _COUNT.pack((0 if raw is None else _COUNT.unpack(raw)[0]) + 1), db=t.answers_failed)


def forget_answers(txn: lmdb.Transaction, t: Tables, request_id: str) -> None:
    """GC: the failed-answer count of `request_id` goes with its last generation."""
    prefix = keys.gen_prefix(request_id)
    cur = txn.cursor(t.gens)
    if not (cur.set_range(prefix) and bytes(cur.key()).startswith(prefix)):
        txn.delete(request_id.encode(), db=t.answers_failed)


def answers_failed(txn: lmdb.Transaction, t: Tables, request_id: str) -> int:
    """The answers of `request_id` whose "status" was failed or rejected."""
    raw = txn.get(request_id.encode(), db=t.answers_failed)
    return 0 if raw is None else int(_COUNT.unpack(raw)[0])


def outcome_of(txn: lmdb.Transaction, t: Tables, vin: str, request_id: str, sha1: bytes) -> Outcome | None:
    raw = txn.get(keys.outcome_key(vin, request_id, sha1), db=t.outcomes)
    return None if raw is None else Outcome(keys.decode_outcome(raw)[3])


def amend_cancelled(
    txn: lmdb.Transaction,
    t: Tables,
    vin: str,
    request_id: str,
    sha1: bytes,
    outcome: Outcome,
    now_ms: int,
    attempts: int = 0,
    response: bytes = b"",
    bumps: Bumps | None = None,
) -> bool:
    """A pair cancelled while its delivery was in flight learns how that delivery ended: the
    vehicle took it (delivered, responded) or it was given up (failed). The cancel could not
    recall it, so its outcome says what happened. True when amended (it was `cancelled`)."""
    if outcome is Outcome.CANCELLED:
        return False  # nothing to amend: it is cancelled already
    okey = keys.outcome_key(vin, request_id, sha1)
    raw = txn.get(okey, db=t.outcomes)
    if raw is None or keys.decode_outcome(raw)[3] != Outcome.CANCELLED:
        return False
    _, stored_ms, old_attempts, _ = keys.decode_outcome(raw)
    sent_ms = keys.outcome_sent(raw)
    _drop_outcome(txn, t, okey)
    amended = keys.outcome_value(now_ms, stored_ms, max(attempts, old_attempts), outcome.value, response, sent_ms)
    txn.put(okey, amended, db=t.outcomes)
    txn.put(keys.timed_key(now_ms, okey), b"", db=t.outcome_expiry)
    _bump(txn, t, request_id, sha1, now_ms, {Outcome.CANCELLED.value: -1, outcome.value: 1}, bumps)
    _count_answer(txn, t, request_id, outcome, response)
    return True


# -- reads ------------------------------------------------------------------------------------
def _generation(key: bytes | memoryview, value: bytes | memoryview) -> Generation:
    request_id, sha1 = keys.split_gen_key(key)
    first_ms, last_ms, counts = keys.decode_gen(value)
    return Generation(request_id, sha1, first_ms, last_ms, dict(zip(keys.COUNT_NAMES, counts, strict=True)))


def generations(txn: lmdb.Transaction, t: Tables, request_id: str) -> list[Generation]:
    """The generations of `request_id`, newest first (by first change)."""
    prefix = keys.gen_prefix(request_id)
    found = []
    cur = txn.cursor(t.gens)
    if cur.set_range(prefix):
        for key, value in cur:
            if bytes(key[: len(prefix)]) != prefix or len(key) != len(prefix) + 20:
                break
            found.append(_generation(key, value))
    found.sort(key=lambda g: g.first_ms, reverse=True)
    return found


def generation(txn: lmdb.Transaction, t: Tables, request_id: str, sha1: bytes) -> Generation | None:
    key = keys.gen_key(request_id, sha1)
    raw = txn.get(key, db=t.gens)
    return None if raw is None else _generation(key, raw)


def all_generations(txn: lmdb.Transaction, t: Tables) -> list[Generation]:
    """Every generation, newest first (by last change): what `ListRequests` pages through."""
    found = [_generation(k, v) for k, v in txn.cursor(t.gens)]
    found.sort(key=lambda g: (g.last_ms, g.request_id), reverse=True)
    return found


def generations_page(
    txn: lmdb.Transaction, t: Tables, limit: int, after: PageKey | None = None
) -> tuple[list[Generation], PageKey | None, int]:
    """Up to `limit` generations newest first by last change, starting past `after`; the place
    of the last one when more follow (the next page's `after`), and how many there are in all.

    Memory is O(generations) small tuples plus `limit` decoded ones, not every generation
    decoded, so paging a large store stays cheap. Between pages nothing is held: a generation
    that changes moves ahead of the place already reached (not shown twice, maybe missed).
    """
    places: list[PageKey] = []
    for key, value in txn.cursor(t.gens):
        place = (keys.decode_gen(value)[1], bytes(key))
        if after is None or place < after:
            places.append(place)
    total = int(txn.stat(t.gens)["entries"])
    head = heapq.nlargest(max(limit, 1) + 1, places)
    page = head[:limit]
    found = []
    for _, gkey in page:
        counts = txn.get(gkey, db=t.gens)
        assert counts is not None  # the snapshot the scan saw it in
        found.append(_generation(gkey, counts))
    return found, page[-1] if page and len(head) > len(page) else None, total


def vehicle_outcomes(txn: lmdb.Transaction, t: Tables, vin: str, limit: int = 20) -> list[OutcomeRecord]:
    """The vehicle's most recent outcomes, newest first."""
    prefix = keys.vin_prefix(vin)
    found = []
    cur = txn.cursor(t.outcomes)
    if cur.set_range(prefix):
        for key, value in cur:
            if bytes(key[: len(prefix)]) != prefix:
                break
            _, request_id, sha1 = keys.split_outcome_key(key)
            ts_ms, stored_ms, attempts, code = keys.decode_outcome(value)
            found.append(
                OutcomeRecord(
                    vin, request_id, sha1, Outcome(code), ts_ms, stored_ms, attempts, keys.outcome_response(value)
                )
            )
    found.sort(key=lambda o: o.ts_ms, reverse=True)
    return found[:limit]


def recount(txn: lmdb.Transaction, t: Tables) -> dict[tuple[str, bytes], dict[str, int]]:
    """Counts rebuilt from rows and outcome records alone (tests, and `sdv-fanout` checks)."""
    out: dict[tuple[str, bytes], dict[str, int]] = {}

    def slot(rid: str, sha1: bytes) -> dict[str, int]:
        return out.setdefault((rid, sha1), dict.fromkeys(keys.COUNT_NAMES, 0))

    for key, value in txn.cursor(t.ids):
        row = keys.decode_row(key, value)
        counts = slot(row.request_id, row.sha1)
        counts["pending"] += 1
        counts["total"] += 1
    for key, value in txn.cursor(t.outcomes):
        _, rid, sha1 = keys.split_outcome_key(key)
        counts = slot(rid, sha1)
        counts[Outcome(keys.decode_outcome(value)[3]).label] += 1
        counts["total"] += 1
    return out
