"""Outcome records and generation counts on PostgreSQL, written in the caller's transaction.

The same rules as `storage.lmdb.outcomes`: every (VIN, generation) the store has taken is pending (a
row holds it) or has exactly one outcome record, and a generation's counts say how many of its
pairs are in each state. A transaction gathers its count changes in `Bumps` and writes them in
one go, one upsert per generation in (request_id, sha1) order, so two transactions always lock
generation rows in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from storage import model
from storage.model import Generation, Outcome, OutcomeRecord
from storage.postgres.types import Connection, Record

TOTAL = 0
PENDING = 1
_COLUMNS = ", ".join(model.COUNT_NAMES)
# No floor at 0 here: a change appended to gen_deltas and not folded yet may be what keeps the sum
# from going below it (a revived pair: delivered -1 here, its +1 still appended); readers and the
# fold floor the sums.
_BUMP = f"""
INSERT INTO generations AS g (request_id, sha1, first_ms, last_ms, {_COLUMNS})
VALUES ($1, $2, $3, $3, {", ".join(f"greatest(0, ${i + 4}::bigint)" for i in range(len(model.COUNT_NAMES)))})
ON CONFLICT (request_id, sha1) DO UPDATE SET last_ms = $3,
    {", ".join(f"{n} = g.{n} + ${i + 4}::bigint" for i, n in enumerate(model.COUNT_NAMES))}
"""
# Ended pairs of one transaction, VIN order. DO UPDATE, not an error: like LMDB's `outcomes.end`,
# a stale record of the pair (none is expected: it was pending) is replaced.
_END = """
INSERT INTO outcomes (vin, request_id, sha1, ended_ms, stored_ms, attempts, code, response)
SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::int8[], $5::int8[], $6::int4[], $7::int2[], $8::bytea[])
ON CONFLICT (vin, request_id, sha1) DO UPDATE SET ended_ms = EXCLUDED.ended_ms, stored_ms = EXCLUDED.stored_ms,
    attempts = EXCLUDED.attempts, code = EXCLUDED.code, response = EXCLUDED.response
"""
# Up to $1 appended changes, oldest first, moved into their generations in one statement. Rows a
# concurrent fold holds are skipped; changes of a generation GC removed meanwhile go with it.
_FOLD = f"""
WITH picked AS (
    DELETE FROM gen_deltas WHERE id IN (SELECT id FROM gen_deltas ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED)
    RETURNING *
), summed AS (
    SELECT request_id, sha1, max(last_ms) AS last_ms, {", ".join(f"sum({n}) AS {n}" for n in model.COUNT_NAMES)}
    FROM picked GROUP BY request_id, sha1
), applied AS (
    UPDATE generations g SET last_ms = greatest(g.last_ms, s.last_ms),
        {", ".join(f"{n} = greatest(0, g.{n} + s.{n})" for n in model.COUNT_NAMES)}
    FROM (SELECT * FROM summed ORDER BY request_id, sha1) s
    WHERE g.request_id = s.request_id AND g.sha1 = s.sha1
    RETURNING 1
)
SELECT (SELECT count(*) FROM picked) AS folded
"""
#: The largest attempts count an outcome keeps (LMDB stores it in 16 bits).
MAX_ATTEMPTS = 0xFFFF


class Bumps:
    """Count changes of one transaction, per generation (slots of `model.COUNT_NAMES`)."""

    def __init__(self) -> None:
        self._deltas: dict[tuple[str, bytes], list[int]] = {}

    def add(self, request_id: str, sha1: bytes, slot: int, delta: int) -> None:
        counts = self._deltas.setdefault((request_id, sha1), [0] * len(model.COUNT_NAMES))
        counts[slot] += delta

    async def write(self, conn: Connection, now_ms: int) -> None:
        """Apply the changes to their generation rows (locked until the commit)."""
        if self._deltas:
            args = [(rid, sha1, now_ms, *counts) for (rid, sha1), counts in sorted(self._deltas.items())]
            await conn.executemany(_BUMP, args)
            self._deltas.clear()


@dataclass(frozen=True, slots=True)
class Ended:
    """A pending pair that ends in this transaction (its row deleted or replaced)."""

    vin: str
    request_id: str
    sha1: bytes
    #: When its row was stored.
    stored_ms: int
    outcome: Outcome
    attempts: int = 0
    response: bytes = b""


async def end_pairs(conn: Connection, ended: Sequence[Ended], now_ms: int, bumps: Bumps) -> None:
    """Record how each pair ended (at `now_ms`) and count it: pending -1, its outcome +1."""
    if not ended:
        return
    ordered = sorted(ended, key=lambda e: (e.vin, e.request_id, e.sha1))
    await conn.execute(
        _END,
        [e.vin for e in ordered],
        [e.request_id for e in ordered],
        [e.sha1 for e in ordered],
        [now_ms] * len(ordered),
        [e.stored_ms for e in ordered],
        [min(e.attempts, MAX_ATTEMPTS) for e in ordered],
        [int(e.outcome) for e in ordered],
        [e.response for e in ordered],
    )
    for e in ordered:
        bumps.add(e.request_id, e.sha1, PENDING, -1)
        bumps.add(e.request_id, e.sha1, e.outcome.value, 1)


async def rows_pending(
    conn: Connection, vins: Sequence[str], request_id: str, sha1: bytes, bumps: Bumps, *, known: bool
) -> None:
    """The rows of `vins` now hold (request_id, sha1), which they did not hold before (as
    `storage.lmdb.outcomes.rows_pending`): a pair that had ended (delivered, then sent the same again)
    is pending again and `total` does not grow; only a generation that existed before (`known`)
    can have such pairs, so a new one costs no lookup."""
    if not vins:
        return
    revived: dict[int, int] = {}
    if known:
        for (code,) in await conn.fetch(
            "DELETE FROM outcomes WHERE request_id = $1 AND sha1 = $2 AND vin = ANY($3::text[]) RETURNING code",
            request_id,
            sha1,
            list(vins),
        ):
            revived[int(code)] = revived.get(int(code), 0) + 1
    fresh = len(vins) - sum(revived.values())
    bumps.add(request_id, sha1, TOTAL, fresh)
    bumps.add(request_id, sha1, PENDING, len(vins))
    for code, n in revived.items():
        bumps.add(request_id, sha1, code, -n)


async def fold(conn: Connection, limit: int = 10_000) -> int:
    """Move up to `limit` appended count changes into their generation rows (one transaction);
    how many were folded. Safe beside other folds and every other writer."""
    return int(await conn.fetchval(_FOLD, limit))


# -- reads ------------------------------------------------------------------------------------
# Readers see `generation_counts`: the folded counts plus the changes appended since.
def generation_of(record: Record) -> Generation:
    """A generation from a row of `generation_counts`."""
    counts = {name: int(record[name]) for name in model.COUNT_NAMES}
    return Generation(record["request_id"], bytes(record["sha1"]), record["first_ms"], record["last_ms"], counts)


async def generation(conn: Connection, request_id: str, sha1: bytes) -> Generation | None:
    record = await conn.fetchrow(
        "SELECT * FROM generation_counts WHERE request_id = $1 AND sha1 = $2", request_id, sha1
    )
    return None if record is None else generation_of(record)


async def all_generations(conn: Connection) -> list[Generation]:
    """Every generation, newest first by last change (as `storage.lmdb.outcomes.all_generations`)."""
    records = await conn.fetch("SELECT * FROM generation_counts ORDER BY last_ms DESC, request_id DESC, sha1")
    return [generation_of(r) for r in records]


async def outcome_of(conn: Connection, vin: str, request_id: str, sha1: bytes) -> Outcome | None:
    code = await conn.fetchval(
        "SELECT code FROM outcomes WHERE vin = $1 AND request_id = $2 AND sha1 = $3", vin, request_id, sha1
    )
    return None if code is None else Outcome(code)


_RECOUNT = """
SELECT request_id, sha1, -1 AS code, count(*) AS n FROM rows GROUP BY request_id, sha1
UNION ALL
SELECT request_id, sha1, code, count(*) FROM outcomes GROUP BY request_id, sha1, code
"""


async def recount(conn: Connection) -> dict[tuple[str, bytes], dict[str, int]]:
    """Counts rebuilt from rows and outcome records alone (as `storage.lmdb.outcomes.recount`)."""
    out: dict[tuple[str, bytes], dict[str, int]] = {}
    for request_id, sha1, code, n in await conn.fetch(_RECOUNT):
        counts = out.setdefault((request_id, bytes(sha1)), dict.fromkeys(model.COUNT_NAMES, 0))
        counts["pending" if code < 0 else Outcome(code).label] += n
        counts["total"] += n
    return out


async def generations(conn: Connection, request_id: str) -> list[Generation]:
    """The generations of `request_id`, newest first by first change (as
    `storage.lmdb.outcomes.generations`: ties in sha1 order)."""
    records = await conn.fetch(
        "SELECT * FROM generation_counts WHERE request_id = $1 ORDER BY first_ms DESC, sha1", request_id
    )
    return [generation_of(r) for r in records]


async def vehicle_outcomes(conn: Connection, vin: str, limit: int = 20) -> list[OutcomeRecord]:
    """The vehicle's most recent outcomes, newest first, with the stored answers (as
    `storage.lmdb.outcomes.vehicle_outcomes`: ties in (request id, sha1) order)."""
    records = await conn.fetch(
        """SELECT request_id, sha1, code, ended_ms, stored_ms, attempts, response FROM outcomes
           WHERE vin = $1 ORDER BY ended_ms DESC, request_id, sha1 LIMIT $2""",
        vin,
        limit,
    )
    return [
        OutcomeRecord(
            vin,
            r["request_id"],
            bytes(r["sha1"]),
            Outcome(r["code"]),
            r["ended_ms"],
            r["stored_ms"],
            r["attempts"],
            bytes(r["response"]),
        )
        for r in records
    ]
