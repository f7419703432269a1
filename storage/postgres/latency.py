"""PostgreSQL: the latency counts of generations (storage/latency.py's buckets), table `gen_latency`.

The same rows as `storage.lmdb.latency`: a count per (request id, sha1, stage, bucket), added to
by one statement per flush (every instance adds its own, in key order: one lock order), read per
request, dropped with their generation by GC (`storage.postgres.gc`).
"""

from __future__ import annotations

from collections.abc import Sequence

from storage.latency import STAGES, Counts, Increment
from storage.postgres.types import Connection

_ADD = """
INSERT INTO gen_latency AS l (request_id, sha1, stage, bucket, n)
SELECT * FROM unnest($1::text[], $2::bytea[], $3::int2[], $4::int2[], $5::int8[])
ON CONFLICT (request_id, sha1, stage, bucket) DO UPDATE SET n = l.n + EXCLUDED.n
"""


async def add(conn: Connection, increments: Sequence[Increment]) -> None:
    """Add each increment (request id, sha1, stage, bucket, count), in one statement."""
    if not increments:
        return
    ordered = sorted(increments)
    await conn.execute(
        _ADD,
        [i[0] for i in ordered],
        [i[1] for i in ordered],
        [STAGES.index(i[2]) for i in ordered],
        [i[3] for i in ordered],
        [i[4] for i in ordered],
    )


async def of_request(conn: Connection, request_id: str) -> dict[bytes, Counts]:
    """The counts of each generation of `request_id` that has any, by sha1."""
    found: dict[bytes, Counts] = {}
    for r in await conn.fetch("SELECT sha1, stage, bucket, n FROM gen_latency WHERE request_id = $1", request_id):
        found.setdefault(bytes(r["sha1"]), {}).setdefault(STAGES[r["stage"]], {})[r["bucket"]] = int(r["n"])
    return found
