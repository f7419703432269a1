"""The vocabulary both stores share: rows, outcomes and their codes, write results, cancel chunks,
GC reports, statistics and the clock.

Plain values only: this module imports neither `lmdb` nor `asyncpg`, so the LMDB store, the
PostgreSQL store and the server speak of the same things without importing each other.
"""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson

# -- the clock ---------------------------------------------------------------------------


def now_ms() -> int:
    """Wall-clock milliseconds: row and blob timestamps are compared across restarts."""
    return time.time_ns() // 1_000_000


# -- rows --------------------------------------------------------------------------------

#: Row flag: the vehicle's answer on the response topic, not its PUBACK, ends the row.
FLAG_AWAIT_RESPONSE = 1
#: Row flag: its batch asked `"priority": "high"`: it goes before the vehicle's normal rows. The
#: PostgreSQL partial index rows_high and sdv_vin_load_many write it as the literal 2.
FLAG_HIGH_PRIORITY = 2


#: A row's lane in delivery order (`delivery_order`): high priority first.
HIGH_LANE, NORMAL_LANE = b"\x00", b"\x01"


def delivery_order(high: bool, ts_be: bytes, request_id: bytes) -> tuple[bytes, bytes]:
    """A row's place in its vehicle's delivery order, the one Python form of the rule (the SQL's
    is sdv_vin_load_many): high priority first, then oldest (`ts_be`: its timestamp, 8 bytes
    big-endian), then by request id (UTF-8 bytes: code point order)."""
    return (HIGH_LANE if high else NORMAL_LANE) + ts_be, request_id


class Row(NamedTuple):
    """One pending request: what to send to `vin` as `request_id`."""

    vin: str
    request_id: str
    ts_ms: int
    sha1: bytes
    size: int
    #: Epoch ms after which the row is never sent (0: no expiry).
    expires_ms: int = 0
    flags: int = 0

    @property
    def await_response(self) -> bool:
        return bool(self.flags & FLAG_AWAIT_RESPONSE)

    @property
    def high_priority(self) -> bool:
        """Its batch asked for high priority (its request's policy may ask it too: `Gates.high`)."""
        return bool(self.flags & FLAG_HIGH_PRIORITY)

    def expired(self, now_ms: int) -> bool:
        return 0 < self.expires_ms <= now_ms

    def order(self, high: bool) -> tuple[bytes, bytes]:
        """Its place in delivery order (`delivery_order`), high priority when `high`."""
        return delivery_order(high, self.ts_ms.to_bytes(8, "big"), self.request_id.encode())


@dataclass(frozen=True, slots=True)
class RowSpec:
    """What a batch asks of every row beyond its payload."""

    #: Epoch ms after which it is never sent (0: never expires).
    expires_ms: int = 0
    flags: int = 0
    #: A vehicle with this many pending rows gets no new one (0: unbounded).
    max_pending: int = 0


PLAIN = RowSpec()


def sha1_of(blob: bytes) -> bytes:
    return hashlib.sha1(blob, usedforsecurity=False).digest()


# -- outcomes ----------------------------------------------------------------------------

#: The counts of a generation, in slot order: an Outcome's value is its slot.
COUNT_NAMES = ("total", "pending", "delivered", "superseded", "cancelled", "expired", "failed", "responded")


class Outcome(enum.IntEnum):
    """How a (VIN, generation) ended; the value is its slot in `COUNT_NAMES`."""

    DELIVERED = 2
    SUPERSEDED = 3
    CANCELLED = 4
    EXPIRED = 5
    FAILED = 6
    #: The vehicle answered on the response topic (await_response rows).
    RESPONDED = 7

    @property
    def label(self) -> str:
        return COUNT_NAMES[self.value]


#: The "status" values of an answer that count as a failed answer (abort criterion `answer_failed`).
FAILED_ANSWERS = ("failed", "rejected")


def answer_failed(response: bytes) -> bool:
    """Whether a vehicle's answer is a JSON object whose "status" is "failed" or "rejected" (an
    answer cut at max_response_bytes that no longer parses is not). Twin: sdv_answer_failed
    (storage/postgres/sql/functions/outcomes.sql)."""
    try:
        doc = orjson.loads(response)
    except orjson.JSONDecodeError:
        return False
    return isinstance(doc, dict) and isinstance(doc.get("status"), str) and doc["status"] in FAILED_ANSWERS


@dataclass(frozen=True, slots=True)
class Generation:
    """One generation's counts, as stored."""

    request_id: str
    sha1: bytes
    first_ms: int
    last_ms: int
    counts: dict[str, int]

    @property
    def pending(self) -> int:
        return self.counts["pending"]


@dataclass(frozen=True, slots=True)
class OutcomeRecord:
    vin: str
    request_id: str
    sha1: bytes
    outcome: Outcome
    ts_ms: int
    #: When its row was stored: ts_ms - stored_ms is the time to the outcome.
    stored_ms: int
    attempts: int
    #: The vehicle's answer (its first max_response_bytes), for `responded`.
    response: bytes = b""


#: A generation's place in `ListRequests` order: last change, then its `gens` key (request id,
#: then sha1), so two generations never tie and a page token names one place exactly.
PageKey = tuple[int, bytes]


def generation_key(request_id: str, sha1: bytes) -> bytes:
    """A generation's name in one key: request id, NUL, sha1 (LMDB's `gens` key, both stores' page tokens)."""
    return request_id.encode() + b"\x00" + sha1


# -- results of writes -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BatchWritten:
    """The outcome of storing one batch (or completing one early trigger)."""

    request_id: str
    sha1: bytes
    vins: tuple[str, ...]
    replaced: int
    new_blob: bool
    #: sha1s of the older generations of request_id whose rows this batch superseded.
    superseded: frozenset[bytes] = frozenset()
    #: The platform's tags, for a parked trigger completed later (a direct batch's are known
    #: to its caller): echoed in its receipt.
    batch_id: str | None = None
    correlation_id: str | None = None
    #: VINs given no row because their backlog is full (max_pending_per_vehicle).
    refused: tuple[str, ...] = ()

    @property
    def rows(self) -> int:
        return len(self.vins)


@dataclass(frozen=True, slots=True)
class Duplicate:
    """A batch whose batch_id was stored before: nothing written, the first receipt again."""

    batch_id: str
    request_id: str
    #: None while the first one is a parked trigger still waiting for its data.
    sha1: bytes | None
    rows: int
    ts_ms: int
    refused: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class EarlyExpired:
    """An early trigger whose data never came."""

    data_id: str
    request_id: str
    vins: int
    age_ms: int
    batch_id: str | None = None
    correlation_id: str | None = None
    #: data_never_arrived (its TTL passed), or expired (its expires_at passed while parked).
    reason: str = "data_never_arrived"


@dataclass(frozen=True, slots=True)
class DataWritten:
    """The outcome of storing a `$SDV-FANOUT/data/<data_id>` payload."""

    data_id: str
    sha1: bytes
    new_blob: bool
    #: Early triggers this data completed, now real rows.
    completed: tuple[BatchWritten, ...] = ()
    #: More triggers wait for this data than one transaction may complete (`complete_early`).
    more: bool = False
    #: Triggers whose expires_at passed before this data came: dropped.
    expired: tuple[EarlyExpired, ...] = ()


@dataclass(frozen=True, slots=True)
class EarlyCompleted:
    """Parked triggers turned into rows by one `complete_early` chunk."""

    completed: tuple[BatchWritten, ...]
    #: Triggers for the data_id still wait: run another chunk.
    more: bool
    #: Triggers whose expires_at passed before their data came: dropped.
    expired: tuple[EarlyExpired, ...] = ()


@dataclass(frozen=True, slots=True)
class TriggerWritten:
    """The outcome of a trigger: rows written, or parked until its data arrives."""

    data_id: str
    request_id: str
    batch: BatchWritten | None
    early: bool


@dataclass(frozen=True, slots=True)
class RowsPut:
    replaced: int
    #: sha1s of the generations whose pending rows were replaced by another payload.
    superseded: frozenset[bytes]
    #: VINs whose backlog was full: no row for them.
    refused: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class CancelChunk:
    """What one cancel transaction did."""

    request_id: str
    #: (VIN, sha1) of the rows this transaction cancelled.
    cancelled: tuple[tuple[str, bytes], ...]
    #: Rows cancelled by this cancel so far, this chunk included.
    total: int
    #: A cancel of every vehicle has more rows to go (run `cancel_chunk` again).
    more: bool
    correlation_id: str | None = None
    #: Why the cancel was started when not by a cancel message: "aborted" (a campaign's abort).
    reason: str | None = None


# -- housekeeping ------------------------------------------------------------------------

#: Rows or aliases deleted per write transaction: short enough to keep ingest latency flat.
ROW_CHUNK = 1000
#: Blobs per write transaction (they may be large).
BLOB_CHUNK = 100


@dataclass(frozen=True, slots=True)
class StoredPolicy:
    """A request's campaign policy as a store keeps it: the validated fields as JSON (the store
    does not read them; exhook_server/policy.py does) and when it was set (epoch ms)."""

    request_id: str
    doc: bytes
    set_ms: int
    #: The abort of the request under this policy (criterion, counts, at_ms as JSON), if one
    #: happened: its batches are refused until a new policy replaces this one.
    aborted: bytes | None = None


@dataclass(slots=True)
class GcReport:
    """What one GC run did (or, with dry_run, would do)."""

    dry_run: bool = False
    rows_expired: int = 0
    aliases_expired: int = 0
    blobs_deleted: int = 0
    blob_bytes_freed: int = 0
    blobs_kept_recent: int = 0
    early_expired: int = 0
    outcomes_expired: int = 0
    generations_expired: int = 0
    batch_ids_expired: int = 0
    seconds: float = 0.0
    expired_early: list[EarlyExpired] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "expired_early"}
        out["seconds"] = round(self.seconds, 3)
        return out


@dataclass(slots=True)
class ApplyReport:
    """What `gc apply` deleted, and what it kept because the store moved on since the export."""

    dry_run: bool = False
    rows_deleted: int = 0
    rows_kept_changed: int = 0
    aliases_deleted: int = 0
    blobs_deleted: int = 0
    blob_bytes_freed: int = 0
    blobs_kept_recent: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True, slots=True)
class Stats:
    """What `sdv-fanout stats` shows; read in one consistent snapshot."""

    rows: int
    blobs: int
    blob_bytes: int
    logical_bytes: int
    aliases: int
    early_triggers: int
    map_size_bytes: int
    map_used_bytes: int
    schema_version: int

    @property
    def dedup_ratio(self) -> float:
        """Bytes the rows would take without dedup, per byte actually stored."""
        return self.logical_bytes / self.blob_bytes if self.blob_bytes else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out["dedup_ratio"] = round(self.dedup_ratio, 3)
        return out
