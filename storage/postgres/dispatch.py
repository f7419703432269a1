"""PostgreSQL: vehicles' dispatch state, read in batches, written back under their locks.

`presence` and `vin_state` hold what a worker keeps in memory on LMDB. `load_many` reads many
vehicles' state in one statement; after the worker's rules ran, `save_many` writes what changed
for each vehicle whose state is still as read, under its advisory lock, in one statement (its own
transaction): at most one delivery in flight per vehicle across instances. `load` (one vehicle,
locked to the end of the caller's transaction) serves the Admin API. The bulk filters
(`heartbeats`, `present_wanting`, `with_work`) say in one statement which vehicles need an event.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from storage import model
from storage.model import Outcome
from storage.postgres.outcomes import MAX_ATTEMPTS
from storage.postgres.types import Connection, Record, fetch_one


@dataclass(frozen=True, slots=True)
class Marker:
    """The delivery recorded for a vehicle (`vin_state`): in flight, or voided (sent, not acked,
    its connection gone since), with what the worker's InFlight entry holds."""

    request_id: str
    sha1: bytes
    session: str
    sent_ms: int
    attempts: int
    await_response: bool = False
    acked_ms: int | None = None
    cancelled: bool = False
    voided: bool = False


@dataclass(frozen=True, slots=True)
class Loaded:
    """A vehicle's state as its event found it (under its lock, or in a batch's load)."""

    #: The encoded session of its live connection (None: offline).
    presence: str | None
    marker: Marker | None
    #: Its first deliverable rows, oldest first, with payloads.
    rows: list[tuple[model.Row, bytes]]
    #: The recorded delivery as `sdv_marker_token` writes it (a batch's load only): what a save
    #: checks it still finds.
    token: str | None = None


def _marker_of(r: Record) -> Marker:
    return Marker(
        r["request_id"],
        bytes(r["sha1"]),
        r["session"],
        r["sent_ms"],
        r["attempts"],
        r["await_response"],
        r["acked_ms"],
        r["cancelled"],
        r["voided"],
    )


def _row_of(vin: str, r: Record) -> tuple[model.Row, bytes]:
    row = model.Row(vin, r["request_id"], r["ts_ms"], bytes(r["sha1"]), r["size"], r["expires_ms"], r["flags"])
    return row, bytes(r["data"])


async def load(conn: Connection, vin: str, now_ms: int, rows: int) -> Loaded:
    """Lock the vehicle until the end of the transaction of `conn` and read its state with its
    first `rows` deliverable rows (one round trip)."""
    presence: str | None = None
    marker: Marker | None = None
    found: list[tuple[model.Row, bytes]] = []
    for r in await conn.fetch("SELECT * FROM sdv_vin_load($1, $2, $3)", vin, now_ms, rows):
        kind = r["kind"]
        if kind == "p":
            presence = r["session"]
        elif kind == "r":
            found.append(_row_of(vin, r))
        else:
            marker = _marker_of(r)
    return Loaded(presence, marker, found)


async def load_many(
    conn: Connection,
    vins: Sequence[str],
    now_ms: int,
    rows: int,
    held: Sequence[str] = (),
    high: Collection[str] = (),
) -> dict[str, Loaded]:
    """The state of each of `vins` with its first `rows` deliverable rows in delivery order (high
    priority first: flagged by their batch, or of the request ids in `high`; those of the request
    ids in `held` passed over), in one snapshot and without a lock (`sdv_vin_load_many`, one
    round trip): a batch's `save_many` checks it is still so."""
    presence: dict[str, str] = {}
    markers: dict[str, tuple[Marker, str]] = {}
    found: dict[str, list[tuple[model.Row, bytes]]] = {}
    query = "SELECT * FROM sdv_vin_load_many($1::text[], $2, $3, $4::text[], $5::text[])"
    for r in await conn.fetch(query, list(vins), now_ms, rows, list(held), list(high)):
        vin, kind = r["vin"], r["kind"]
        if kind == "p":
            presence[vin] = r["session"]
        elif kind == "r":
            found.setdefault(vin, []).append(_row_of(vin, r))
        else:
            markers[vin] = (_marker_of(r), r["token"])
    out = {}
    for vin in vins:
        marker, token = markers.get(vin, (None, None))
        queue = sorted(found.get(vin, ()), key=lambda rp: rp[0].order(rp[0].high_priority or rp[0].request_id in high))
        out[vin] = Loaded(presence.get(vin), marker, queue, token)
    return out


@dataclass(frozen=True, slots=True)
class Save:
    """What one vehicle event of a batch decided and the state it decided on: when given (a
    1-tuple; None leaves it as it is) its live session, encoded (None: offline), and its delivery
    marker (None: nothing out; `sender`, the instance that just sent it, or None to keep the
    recorded one); the pairs it ended (request id, sha1, outcome, attempts, response). `sends`:
    the marker is a publish of its pair, saved only while that row is still pending (the vehicle's
    state may have gone out and back since the load: sent, PUBACKed and ended elsewhere)."""

    vin: str
    seen: Loaded
    presence: tuple[str | None] | None = None
    marker: tuple[Marker | None] | None = None
    sender: str | None = None
    ends: Sequence[tuple[str, bytes, Outcome, int, bytes]] = ()
    sends: bool = False


#: `save_many` verdicts: written; the vehicle's lock held elsewhere right now; its state changed
#: since the load. Neither of the last two wrote anything: the event runs again.
SAVED, BUSY, CHANGED = 0, 1, 2


def _flag(given: tuple[object] | None) -> int:
    return 0 if given is None else (1 if given[0] is not None else 2)


def _marker_flag(save: Save) -> int:
    """sdv_vin_save_many's p_marker: 0 unchanged, 1 the given fields, 2 none, 3 the given fields
    as a publish of their pair (only while its row is pending)."""
    flag = _flag(save.marker)
    return 3 if flag == 1 and save.sends else flag


async def save_many(conn: Connection, now_ms: int, saves: Sequence[Save]) -> list[tuple[int, list[bool]]]:
    """Many vehicle events' decisions in one statement and one transaction (`sdv_vin_save_many`,
    sql/functions/vehicle_batches.sql), given in VIN order, one per vehicle: per save its verdict
    and, when SAVED, whether each of its `ends` ended (as `batches.delete_row_if` ends a pair)."""
    markers = [s.marker[0] if s.marker else None for s in saves]
    ends = [e for s in saves for e in s.ends]
    found = await conn.fetch(
        _SAVE_MANY,
        now_ms,
        [s.vin for s in saves],
        [s.seen.presence for s in saves],
        [s.seen.token for s in saves],
        [_flag(s.presence) for s in saves],
        [s.presence[0] if s.presence else None for s in saves],
        [_marker_flag(s) for s in saves],
        [m.request_id if m else None for m in markers],
        [m.sha1 if m else None for m in markers],
        [m.session if m else None for m in markers],
        [m.sent_ms if m else None for m in markers],
        [m.attempts if m else None for m in markers],
        [m.await_response if m else None for m in markers],
        [m.acked_ms if m else None for m in markers],
        [m.cancelled if m else None for m in markers],
        [m.voided if m else None for m in markers],
        [s.sender for s in saves],
        [len(s.ends) for s in saves],
        [e[0] for e in ends],
        [e[1] for e in ends],
        [int(e[2]) for e in ends],
        [min(e[3], MAX_ATTEMPTS) for e in ends],
        [e[4] for e in ends],
    )
    verdicts = {int(r["ev"]): (int(r["verdict"]), [bool(d) for d in r["done"] or []]) for r in found}
    return [verdicts[k + 1] for k in range(len(saves))]


_SAVE_MANY = """
SELECT ev, verdict, done FROM sdv_vin_save_many($1::int8, $2::text[], $3::text[], $4::text[], $5::int2[],
    $6::text[], $7::int2[], $8::text[], $9::bytea[], $10::text[], $11::int8[], $12::int4[], $13::bool[],
    $14::int8[], $15::bool[], $16::bool[], $17::text[], $18::int4[], $19::text[], $20::bytea[], $21::int2[],
    $22::int4[], $23::bytea[])
"""


# A vehicle has something deliverable (the queue's rule, as in sdv_vin_load_many) ... Written as scalar
# subqueries with LIMIT 1, never pulled up into joins: the planner otherwise chose a hash
# semi-join that reads and aggregates all of `rows` for a few hundred VINs (measured: 1-4 ms per
# batch with nobody online, bench/pg_serve.py); this way each VIN is one index probe.
_HAS_WORK = """((SELECT true FROM rows r LEFT JOIN cancels c ON c.request_id = r.request_id
    WHERE r.vin = v.vin AND NOT (r.expires_ms > 0 AND r.expires_ms <= $2::bigint)
        AND (c.cut_ms IS NULL OR r.ts_ms > c.cut_ms) LIMIT 1) IS NOT NULL)"""
# ... and no delivery holding its slot: one out for less than the in-flight timeout ($3 ms), or
# PUBACKed and awaiting its answer for less than the response timeout ($4 ms).
_FREE = """((SELECT true FROM vin_state s WHERE s.vin = v.vin AND s.request_id IS NOT NULL AND NOT s.voided
        AND ((s.acked_ms IS NULL AND s.sent_ms > $2::bigint - $3::bigint) OR s.acked_ms > $2::bigint - $4::bigint)
        LIMIT 1) IS NULL)"""

# The session as a scalar subquery too: as a LEFT JOIN the planner hashed all of `presence` for
# each window of heartbeats (3 ms for 50 VINs with 15,000 vehicles online, growing with the fleet).
_HEARTBEATS = f"""
SELECT v.vin, (SELECT p.session FROM presence p WHERE p.vin = v.vin) AS session,
       ({_HAS_WORK} AND {_FREE}) AS wanting
FROM unnest($1::text[]) AS v(vin)
"""

# Presence first, one index probe per VIN (a scalar subquery: as a join, the planner hashed all of
# `presence` per batch once it held 15,000 vehicles, 4 ms), and the work probes only for the VINs
# online (OFFSET 0 keeps the fence: pushed below it they ran for every VIN of the batch, 0.7 ms
# per 200-VIN batch with nobody online). EXPLAIN ANALYZE, 200 VINs: 0.03 ms with nobody online.
_PRESENT_WANTING = f"""
SELECT v.vin FROM (SELECT u.vin FROM unnest($1::text[]) AS u(vin)
                   WHERE (SELECT true FROM presence p WHERE p.vin = u.vin) OFFSET 0) AS v
WHERE {_HAS_WORK} AND {_FREE}
"""

_ONLINE_WANTING = f"""
SELECT v.vin FROM (SELECT vin FROM presence WHERE vin > $1 ORDER BY vin LIMIT $5) AS v
WHERE {_HAS_WORK} AND {_FREE}
"""


@dataclass(frozen=True, slots=True)
class Timeouts:
    """The dispatch timeouts the bulk filters apply, in ms."""

    inflight_ms: int
    response_ms: int


async def heartbeats(
    conn: Connection, vins: Sequence[str], now_ms: int, timeouts: Timeouts
) -> list[tuple[str, str | None, bool]]:
    """For heartbeats gathered over a few milliseconds: each vehicle's recorded session and
    whether it has work and a free slot (one statement, no lock)."""
    found = await conn.fetch(_HEARTBEATS, list(vins), now_ms, timeouts.inflight_ms, timeouts.response_ms)
    return [(r["vin"], r["session"], r["wanting"]) for r in found]


async def with_work(conn: Connection, vins: Sequence[str], now_ms: int) -> list[str]:
    """Of `vins`, those with a deliverable row (the queue's rule; one statement)."""
    found = await conn.fetch(f"SELECT v.vin FROM unnest($1::text[]) AS v(vin) WHERE {_HAS_WORK}", list(vins), now_ms)
    return [r["vin"] for r in found]


async def present_wanting(conn: Connection, vins: Sequence[str], now_ms: int, timeouts: Timeouts) -> list[str]:
    """Of `vins` (a new batch's), those online with work and a free slot: the only ones a new
    batch can cause a send to."""
    found = await conn.fetch(_PRESENT_WANTING, list(vins), now_ms, timeouts.inflight_ms, timeouts.response_ms)
    return [r["vin"] for r in found]


async def online_wanting(
    conn: Connection, after: str, limit: int, now_ms: int, timeouts: Timeouts
) -> tuple[list[str], str | None]:
    """One page (`limit` online vehicles after `after`, in VIN order) of the online vehicles
    with work and a free slot, and where the next page starts (None: done)."""
    page = await online_page(conn, after, limit)
    if not page:
        return [], None
    found = await conn.fetch(_ONLINE_WANTING, after, now_ms, timeouts.inflight_ms, timeouts.response_ms, limit)
    return [r["vin"] for r in found], (page[-1] if len(page) == limit else None)


async def overdue(conn: Connection, now_ms: int, timeouts: Timeouts, limit: int) -> list[str]:
    """Vehicles whose delivery is past the in-flight timeout (not acked) or past the response
    timeout (acked, no answer): what the timeout sweep looks at, oldest first."""
    found = await conn.fetch(
        """SELECT vin FROM vin_state
           WHERE request_id IS NOT NULL AND NOT voided
               AND ((acked_ms IS NULL AND sent_ms <= $1::bigint - $2::bigint) OR acked_ms <= $1::bigint - $3::bigint)
           ORDER BY sent_ms LIMIT $4""",
        now_ms,
        timeouts.inflight_ms,
        timeouts.response_ms,
        limit,
    )
    return [r["vin"] for r in found]


async def forget_node(conn: Connection, node: str, started_ms: int) -> tuple[int, int]:
    """EMQX node `node` started at `started_ms`: the presence recorded before that on it, and the
    deliveries sent before that to its sessions and not PUBACKed, belong to sessions that are gone
    (deleted; voided: sent again as re-sends). (presences deleted, deliveries voided)."""
    async with conn.transaction():
        gone = await conn.fetch(
            "DELETE FROM presence WHERE split_part(session, chr(31), 1) = $1 AND seen_ms < $2 RETURNING vin",
            node,
            started_ms,
        )
        voided = await conn.fetch(
            """UPDATE vin_state SET voided = true
               WHERE request_id IS NOT NULL AND NOT voided AND acked_ms IS NULL
                   AND split_part(session, chr(31), 1) = $1 AND sent_ms < $2
               RETURNING vin""",
            node,
            started_ms,
        )
    return len(gone), len(voided)


async def sent_by(conn: Connection, sender: str, after: str, limit: int) -> list[str]:
    """Vehicles with a delivery out that `sender`'s MQTT client published (lost with its link)."""
    found = await conn.fetch(
        """SELECT vin FROM vin_state WHERE sender = $1 AND request_id IS NOT NULL AND NOT voided AND vin > $2
           ORDER BY vin LIMIT $3""",
        sender,
        after,
        limit,
    )
    return [r["vin"] for r in found]


async def with_marker_of(conn: Connection, request_id: str, vins: Sequence[str]) -> list[str]:
    """Of `vins`, those whose recorded delivery is of `request_id` (a cancel's candidates)."""
    found = await conn.fetch(
        "SELECT vin FROM vin_state WHERE request_id = $1 AND vin = ANY($2::text[])", request_id, list(vins)
    )
    return [r["vin"] for r in found]


async def totals(conn: Connection) -> tuple[int, int, int]:
    """(vehicles online, deliveries out, of which PUBACKed and awaiting their answer), everywhere."""
    r = await fetch_one(
        conn,
        """SELECT (SELECT count(*) FROM presence) AS online,
                  (SELECT count(*) FROM vin_state WHERE request_id IS NOT NULL AND NOT voided) AS out,
                  (SELECT count(*) FROM vin_state WHERE acked_ms IS NOT NULL) AS awaiting""",
    )
    return int(r["online"]), int(r["out"]), int(r["awaiting"])


async def online_among(conn: Connection, vins: Sequence[str]) -> int:
    """How many of `vins` are online (one index probe each)."""
    return int(await conn.fetchval("SELECT count(*) FROM presence WHERE vin = ANY($1::text[])", list(vins)))


async def online_page(conn: Connection, after: str, limit: int) -> list[str]:
    """Online vehicles after `after`, in VIN order."""
    found = await conn.fetch("SELECT vin FROM presence WHERE vin > $1 ORDER BY vin LIMIT $2", after, limit)
    return [r["vin"] for r in found]
