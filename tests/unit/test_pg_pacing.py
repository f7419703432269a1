"""Campaign pacing on PostgreSQL's fleet-wide buckets (table pacing_buckets, sdv_pacing_lease) under
an injected clock: one or three Pacers, each leasing through a pool of its own from the real
database with the clock given to the statement, start each request's rate within 5 % over a
minute of greedy demand, at 60, 600 and 6,000 per minute (three requests paced side by side)."""

from __future__ import annotations

import asyncio
import itertools

import asyncpg
import pytest

from exhook_server.backends.postgres.backend import PgBudget
from exhook_server.dispatch.pacing import TICK_S, Pacer
from exhook_server.policy import Policy
from storage.postgres.types import Pool

RATES = (60, 600, 6000)
_ids = itertools.count()


class Clock:
    """Wall-clock ms that the test steps."""

    def __init__(self) -> None:
        self.ms = 1_800_000_000_000

    def __call__(self) -> int:
        return self.ms


async def instance_pool(dsn: str) -> Pool:
    """One instance's connection. Its commits skip the WAL flush: durability is not what is
    measured, and 1,200 flushed leases per instance would make the minute last seconds more."""
    return await asyncpg.create_pool(dsn, min_size=1, max_size=1, server_settings={"synchronous_commit": "off"})


async def greedy_minute(dsn: str, instances: int) -> dict[int, int]:
    """Per rate, the deliveries `instances` pacers start in a simulated minute, each starting all
    it may after every tick (a tick every TICK_S, as `Pacer.run`)."""
    clock = Clock()
    rids = {rate: f"task_pg_rate_{rate}_{next(_ids)}" for rate in RATES}
    pools = [await instance_pool(dsn) for _ in range(instances)]
    try:
        pacers = [Pacer(PgBudget(lambda p=p: p, clock), wall_ms=clock) for p in pools]
        for pacer in pacers:
            for rate, rid in rids.items():
                pacer.set(rid, Policy(max_per_minute=rate), clock.ms)
        started = dict.fromkeys(RATES, 0)
        tick_ms = round(TICK_S * 1000)
        for _ in range(60_000 // tick_ms):
            for pacer in pacers:
                await pacer.tick()
                for rate, rid in rids.items():
                    while rid not in pacer.blocked():
                        pacer.started(rid)
                        started[rate] += 1
            clock.ms += tick_ms
        return started
    finally:
        for p in pools:
            await p.close()


@pytest.mark.parametrize("instances", [1, 3])
def test_starts_over_a_minute_follow_each_rate_on_postgresql(pg_dsn: str, instances: int) -> None:
    """Under endless demand on 1 or 3 instances, a minute gives each request its rate within 5 %
    (plus the bucket's first token)."""
    started = asyncio.run(greedy_minute(pg_dsn, instances))
    for rate, n in started.items():
        assert rate * 0.95 <= n <= rate * 1.05 + 1, started
