"""A vehicle's pending rows as dispatch orders them, each with its priority, for people to read.

A row is high priority when its batch asked it (its flag) or its request's policy in force says
`"priority": "high"`; high rows go first, then the others, each oldest first (then by request id):
`storage.model.delivery_order`, as LMDB's dispatch orders them, and `sdv_vin_load_many`. `inspect` (offline and
through Admin GetVehicle) shows rows this way; one policy read per request id among the rows.
"""

from __future__ import annotations

from collections.abc import Sequence

from exhook_server.policy import Policy
from storage.model import Row
from storage.port import Reads


async def high_requests(reads: Reads, request_ids: set[str]) -> set[str]:
    """Those of `request_ids` whose policy in force says priority high (an unreadable one: no)."""
    high = set()
    for rid in sorted(request_ids):
        stored = await reads.policy(rid)
        if stored is None:
            continue
        try:
            policy = Policy.decode(stored.doc)
        except Exception:  # a policy this build cannot read holds nothing (as in Gates)
            continue
        if policy.priority == "high":
            high.add(rid)
    return high


async def in_delivery_order(reads: Reads, rows: Sequence[Row]) -> list[tuple[Row, bool]]:
    """(row, high priority) of `rows`, high priority first, oldest first within each."""
    high = await high_requests(reads, {r.request_id for r in rows if not r.high_priority})
    marked = [(r, r.high_priority or r.request_id in high) for r in rows]
    marked.sort(key=lambda m: m[0].order(m[1]))
    return marked
