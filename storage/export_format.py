"""The Parquet export format both stores write: table schemas, format version, batch sizes.

The Spark jobs in spark/ read it, never a live store; the LMDB export (storage/lmdb/export.py) and the
PostgreSQL one (storage/postgres/export.py) write the same tables, so a job never knows which store
made an export. Imports neither `lmdb` nor `asyncpg`.
"""

from __future__ import annotations

import pyarrow as pa

from storage.model import COUNT_NAMES

FORMAT = "sdv-fanout-export"
#: Changes only when a table that readers already know changes. Adding a table (outcomes,
#: generations and policies came later) does not: older jobs ignore it, and a job that needs it checks the
#: manifest's counts for it. 2 (store schema 3, request lifecycle): rows gained `expires_at_ms`
#: and `await_response`, outcomes the `responded` outcome with `response` and `response_bytes`,
#: generations the `responded` count. The jobs in spark/ read 1 and 2 (a column version 1 lacks
#: reads as its "nothing" value: no expiry, no answer awaited, none responded). 3: rows gained
#: `high_priority` (the batch's own flag; a policy's priority is in the policies table), outcomes
#: `sent_ms`; the jobs read an older export as one without high-priority rows or send times.
FORMAT_VERSION = 3
#: Rows per Parquet record batch: ~3 MB of Arrow memory per batch ...
BATCH_ROWS = 65_536
#: ... or fewer, where a batch would hold more than this many bytes of the vehicles' answers
#: (up to max_response_bytes, 1 MiB at most, each).
BATCH_BYTES = 32 << 20

ROWS_SCHEMA = pa.schema(
    [
        ("vin", pa.string()),
        ("request_id", pa.string()),
        ("ts_ms", pa.int64()),
        ("sha1", pa.binary()),
        ("size", pa.int64()),
        #: Epoch ms after which the row is never sent; null: no expiry.
        ("expires_at_ms", pa.int64()),
        #: The vehicle's answer, not its PUBACK, ends the row.
        ("await_response", pa.bool_()),
        #: Its batch asked high priority (`"priority": "high"`): it goes before the vehicle's others.
        ("high_priority", pa.bool_()),
    ]
)
BLOBS_SCHEMA = pa.schema(
    [("sha1", pa.binary()), ("created_ms", pa.int64()), ("touched_ms", pa.int64()), ("size", pa.int64())]
)
ALIASES_SCHEMA = pa.schema([("data_id", pa.string()), ("sha1", pa.binary()), ("ts_ms", pa.int64())])
#: One per (VIN, generation) that has ended; sha1 as lower-case hex (what receipts and the Admin API
#: show), outcome as its name (`delivered`, `superseded`, `cancelled`, `expired`, `failed`,
#: `responded`). `response` is the answer of a `responded` pair as stored (its first
#: max_response_bytes) and `response_bytes` its length; both null for every other outcome.
#: `sent_ms`: when the pair's row was first published to the vehicle; null when it never was (or
#: the store did not know: an outcome recorded before it kept send times).
OUTCOMES_SCHEMA = pa.schema(
    [
        ("vin", pa.string()),
        ("request_id", pa.string()),
        ("sha1", pa.string()),
        ("outcome", pa.string()),
        ("ended_ms", pa.int64()),
        ("stored_ms", pa.int64()),
        ("attempts", pa.int64()),
        ("response", pa.binary()),
        ("response_bytes", pa.int64()),
        ("sent_ms", pa.int64()),
    ]
)
#: One per generation (request_id, sha1): its first and last change and its counts, as stored.
GENERATIONS_SCHEMA = pa.schema(
    [("request_id", pa.string()), ("sha1", pa.string()), ("first_ms", pa.int64()), ("last_ms", pa.int64())]
    + [(name, pa.int64()) for name in COUNT_NAMES]
)
#: One per campaign policy in force: its fields as set (`policy`, JSON as stored and echoed), when
#: it was set, and the request's abort under it (`aborted`: JSON with criterion, counts, at_ms; null
#: while not aborted). The stores keep both as given and the export copies them unread.
POLICIES_SCHEMA = pa.schema(
    [("request_id", pa.string()), ("policy", pa.string()), ("set_ms", pa.int64()), ("aborted", pa.string())]
)
