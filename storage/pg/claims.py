"""One delivery in flight per vehicle across instances: claims on PostgreSQL (issue 14, first cut).

Any instance may handle any hook of any vehicle, so "who may send to this vehicle now" cannot
live in one process's memory as it does with LMDB (where the owning process decides, reached by
forwarding; bench/lmdb_claims.py showed LMDB's host-wide writer lock would cap claims there). On
PostgreSQL the row lock of the vehicle's `vin_state` row decides: a claim is one statement that
sets the marker from the vehicle's oldest deliverable row only if none is set (or the one set is
older than the in-flight timeout, a re-send), and returns that row with its payload. Of two
instances claiming at once, one gets the row, the other nothing.

"Deliverable" is what LMDB's queue offers (Store._visible_rows): not past its expires_at, not
taken by a cancel of every vehicle in progress (stored at or before its cut).

Not wired into the server yet: dispatch over PostgreSQL (presence, resume, answers, attempts
limit, the sweep) builds on these statements.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from storage.outcomes import Outcome
from storage.pg import ingest

_DELIVERABLE = """
    r.vin = $1::text
    AND (r.expires_ms = 0 OR r.expires_ms > $3::bigint)
    AND NOT EXISTS (SELECT 1 FROM cancels c WHERE c.request_id = r.request_id AND r.ts_ms <= c.cut_ms)
"""

_CLAIM = f"""
WITH next AS (
    SELECT r.request_id, r.sha1 FROM rows r
    WHERE {_DELIVERABLE}
    ORDER BY r.ts_ms, r.request_id
    LIMIT 1
), claimed AS (
    INSERT INTO vin_state AS s (vin, request_id, sha1, session, sent_ms, attempts)
    SELECT $1::text, n.request_id, n.sha1, $2::text, $3::bigint, 1 FROM next n
    ON CONFLICT (vin) DO UPDATE
        SET request_id = excluded.request_id, sha1 = excluded.sha1, session = excluded.session,
            sent_ms = excluded.sent_ms,
            attempts = CASE WHEN s.request_id = excluded.request_id AND s.sha1 = excluded.sha1
                            THEN s.attempts + 1 ELSE 1 END
        WHERE s.request_id IS NULL OR s.sent_ms <= $3::bigint - $4::bigint
    RETURNING s.request_id, s.sha1, s.attempts
)
SELECT c.request_id, c.sha1, c.attempts, b.data FROM claimed c JOIN blobs b ON b.sha1 = c.sha1
"""

_RELEASE = """
UPDATE vin_state SET request_id = NULL, sha1 = NULL, session = NULL, sent_ms = NULL, attempts = 0
WHERE vin = $1 AND request_id = $2 AND sha1 = $3
"""

#: Which of these vehicles have something deliverable and nothing fresh in flight: what a batch of
#: heartbeats asks in one statement, so that only those cause a claim.
_WANTING = """
SELECT v FROM unnest($1::text[]) AS v
WHERE NOT EXISTS (
        SELECT 1 FROM vin_state s WHERE s.vin = v AND s.request_id IS NOT NULL AND s.sent_ms > $2::bigint - $3::bigint)
  AND EXISTS (SELECT 1 FROM rows r WHERE r.vin = v AND (r.expires_ms = 0 OR r.expires_ms > $2::bigint))
ORDER BY v
"""


@dataclass(frozen=True, slots=True)
class Claimed:
    """The delivery this instance now owns for the vehicle: publish it."""

    request_id: str
    sha1: bytes
    #: Publishes of this (request_id, sha1) to the vehicle so far, this one included.
    attempts: int
    payload: bytes


async def claim(conn: Any, vin: str, session: str, now_ms: int, inflight_timeout_ms: int) -> Claimed | None:
    """The vehicle's oldest deliverable row, if nothing is in flight for it (or what is has been
    out for inflight_timeout_ms: sent again); None when another delivery holds the vehicle or
    nothing is deliverable. One statement, so one round trip."""
    record = await conn.fetchrow(_CLAIM, vin, session, now_ms, inflight_timeout_ms)
    if record is None:
        return None
    return Claimed(record["request_id"], bytes(record["sha1"]), record["attempts"], bytes(record["data"]))


async def acknowledge(conn: Any, vin: str, request_id: str, sha1: bytes, now_ms: int, attempts: int = 1) -> bool:
    """The vehicle PUBACKed (request_id, sha1): the row ends delivered (or a cancelled one is
    amended), and the marker is cleared if it is this delivery, so the next claim may go. True
    when the row (or its cancelled outcome) was ended here."""
    ended = await ingest.delete_row_if(conn, vin, request_id, sha1, now_ms, Outcome.DELIVERED, attempts)
    await conn.execute(_RELEASE, vin, request_id, sha1)
    return ended


async def wanting(conn: Any, vins: Sequence[str], now_ms: int, inflight_timeout_ms: int) -> list[str]:
    """Of `vins` (heartbeats gathered over a few milliseconds), those worth a claim."""
    return [r["v"] for r in await conn.fetch(_WANTING, sorted(set(vins)), now_ms, inflight_timeout_ms)]
