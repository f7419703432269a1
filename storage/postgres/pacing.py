"""PostgreSQL: campaign pacing's fleet-wide state, for every instance at once.

`lease` takes tokens of many requests' buckets (table `pacing_buckets`) in one statement, the
instance's clock stamping them; `out` counts requests' deliveries out under their PACING locks,
held to the end of the caller's transaction (sql/functions/pacing.sql); `forget` drops the
buckets of requests no longer paced. exhook_server/dispatch/pacing.py decides what to ask.
"""

from __future__ import annotations

from collections.abc import Sequence

from storage.postgres.types import Connection


async def lease(conn: Connection, asks: Sequence[tuple[str, float, float, int]], now_ms: int) -> dict[str, int]:
    """Up to `want` tokens of each (request id, rate per s, burst, want): what each got."""
    ordered = sorted(asks)
    got = await conn.fetchval(
        "SELECT sdv_pacing_lease($1::text[], $2::float8[], $3::float8[], $4::int4[], $5::int8)",
        [a[0] for a in ordered],
        [a[1] for a in ordered],
        [a[2] for a in ordered],
        [a[3] for a in ordered],
        now_ms,
    )
    return {a[0]: int(n) for a, n in zip(ordered, got or [], strict=True)}


async def out(conn: Connection, request_ids: Sequence[str]) -> dict[str, int]:
    """Deliveries out per request id, their locks held to the end of the caller's transaction."""
    found = await conn.fetch("SELECT request_id, n FROM sdv_pacing_out($1::text[])", sorted(set(request_ids)))
    return {r["request_id"]: int(r["n"]) for r in found}


async def forget(conn: Connection, request_ids: Sequence[str]) -> None:
    """Drop the buckets of `request_ids`, and any of a request without a policy."""
    await conn.execute(
        "DELETE FROM pacing_buckets b WHERE b.request_id = ANY($1::text[])"
        " OR NOT EXISTS (SELECT 1 FROM policies p WHERE p.request_id = b.request_id)",
        list(request_ids),
    )
