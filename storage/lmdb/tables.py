"""The named databases of one LMDB environment and the schema version they make up.

`keys` describes what each table holds byte by byte; `store` opens them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import lmdb

#: 2 added the outcome tables (gens, outcomes, outcome_expiry, batches, batch_expiry); 3 the
#: lifecycle ones (deadlines, backlogs, by_request, cancels), longer rows for expires_at and
#: flags, and the `responded` count; 4 the delivery attempts (tries, awaited), so that they
#: outlive a restart; 5 the campaign policies; 6 their aborts and the failed answers per request;
#: 7 the delivery latencies; 8 when each row was first and last published (in `tries`); 9 when an
#: ended pair's row was first published (in `outcomes`). An older store is upgraded when a writer
#: opens it.
SCHEMA_VERSION = 9
DB_NAMES = (
    "data",
    "touched",
    "ids",
    "expiry",
    "aliases",
    "early",
    "meta",
    "gens",
    "outcomes",
    "outcome_expiry",
    "batches",
    "batch_expiry",
    "deadlines",
    "backlogs",
    "by_request",
    "cancels",
    "tries",
    "awaited",
    "policies",
    "aborts",
    "answers_failed",
    "latency",
)
#: Tables each schema version added, for a clear error when a reader opens an older store.
_FIRST_OF = ((12, 2), (16, 3), (18, 4), (19, 5), (21, 6), (len(DB_NAMES), 7))  # (index past the last table, version)
ADDED_IN = {name: next(v for end, v in _FIRST_OF if i < end) for i, name in enumerate(DB_NAMES) if i >= 7}

#: A named database's handle (what `txn.get(key, db=...)` takes).
Db: TypeAlias = lmdb._Database


@dataclass(frozen=True, slots=True)
class Tables:
    """Handles of the named databases of one environment."""

    data: Db
    touched: Db
    ids: Db
    expiry: Db
    aliases: Db
    early: Db
    meta: Db
    #: request_id \0 sha1 → counts per state (storage/lmdb/outcomes.py).
    gens: Db
    #: VIN \0 request_id \0 sha1 → how that pair ended.
    outcomes: Db
    #: ts + outcomes key: GC walks outcomes oldest first.
    outcome_expiry: Db
    #: batch_id → the receipt of the batch stored under it (idempotent retries).
    batches: Db
    #: ts + batch_id: GC walks batch ids oldest first.
    batch_expiry: Db
    #: expires_at + ids key: the expiry sweep walks rows in the order they expire.
    deadlines: Db
    #: VIN → its pending rows (max_pending_per_vehicle).
    backlogs: Db
    #: request_id \0 VIN → empty: a request's pending VINs (cancel of every vehicle).
    by_request: Db
    #: request_id → a cancel of every vehicle still in progress (its chunks resume after a crash).
    cancels: Db
    #: ids key → sha1 and how often that row was published (written with the next commit).
    tries: Db
    #: ids key → a delivery the vehicle PUBACKed whose answer is awaited (await_response rows).
    awaited: Db
    #: request_id → its campaign policy: set_ms (8 bytes, big-endian) + the policy's JSON.
    policies: Db
    #: request_id → the abort of its campaign under the policy in force (JSON): its batches are
    #: refused until a new policy replaces that one (storage/lmdb/policies.py).
    aborts: Db
    #: request_id → its answers whose "status" is failed or rejected (8 bytes, big-endian).
    answers_failed: Db
    #: gens key + stage + bucket → latencies counted there (storage/lmdb/latency.py).
    latency: Db
