"""PostgreSQL instances hear of a policy at its commit and confirm it (exhook_server/backends/postgres/
policy_sync.py): `tell` returns once every other live listener has it in force, waits at most its
timeout for one that never confirms, does not wait for one whose session ended, and a listener
whose connection is ended connects again and reloads every policy. Real database; each test's
listeners run in one event loop."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import asyncpg
from prometheus_client import REGISTRY

from exhook_server.aio import cancel_all
from exhook_server.backends.postgres.policy_sync import APPLICATION, PolicySync
from storage.model import StoredPolicy
from storage.postgres import connect, policies
from storage.postgres.types import Pool

_ids = itertools.count()


@dataclass
class Instance:
    """A listener and what it put in force."""

    pool: Pool
    told: list[tuple[str, bytes | None, int]] = field(default_factory=list)
    reloads: int = 0
    sync: PolicySync = field(init=False)

    def on_policy(self, request_id: str, doc: bytes | None, ms: int) -> None:
        self.told.append((request_id, doc, ms))

    def on_policies(self, found: list[StoredPolicy]) -> None:
        self.reloads += 1


def propagated(outcome: str) -> float:
    return REGISTRY.get_sample_value("sdv_fanout_policy_propagation_total", {"outcome": outcome}) or 0.0


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll `predicate` on the loop until true, or fail after `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


@asynccontextmanager
async def instances(dsn: str, n: int, timeout_s: float = 5.0) -> AsyncIterator[list[Instance]]:
    """`n` listeners on the database, each knowing the others; all stopped after."""
    found: list[Instance] = []
    tasks = []
    try:
        for _ in range(n):
            inst = Instance(await connect.tool_pool(dsn))
            inst.sync = PolicySync(
                dsn,
                lambda p=inst.pool: p,
                timeout_s,
                on_policy=inst.on_policy,
                on_policies=inst.on_policies,
                retry_s=0.05,
            )
            found.append(inst)
            tasks.append(asyncio.create_task(inst.sync.run()))
        await until(lambda: all(len(i.sync.listeners()) == n - 1 for i in found))
        yield found
    finally:
        await cancel_all(tasks)
        for i in found:
            await i.pool.close()


async def store(inst: Instance, doc: bytes | None) -> tuple[str, int]:
    """A policy stored through `inst`'s pool, then told: (request id, set ms)."""
    rid, ms = f"task_sync_{next(_ids)}", 1_000 + next(_ids)
    async with inst.pool.acquire() as conn:
        await policies.set_policy(conn, rid, doc, ms, 100)
    await inst.sync.tell(rid, ms)
    return rid, ms


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


def test_tell_returns_once_every_other_instance_has_the_policy_in_force(pg_dsn: str) -> None:
    """Stored through one of three instances: when `tell` returns, both others were told it (read
    back from the database), confirmed, without a timeout."""

    async def body() -> None:
        async with instances(pg_dsn, 3) as (a, b, c):
            confirmed, timeouts = propagated("confirmed"), propagated("timeout")
            rid, ms = await store(a, b'{"paused": true}')
            assert (rid, b'{"paused": true}', ms) in b.told
            assert (rid, b'{"paused": true}', ms) in c.told
            cleared, _ = await store(c, None)
            assert any(t[0] == cleared and t[1] is None for t in a.told + b.told)
            assert propagated("confirmed") - confirmed == 2
            assert propagated("timeout") == timeouts

    run(body)


def test_a_listener_that_never_confirms_costs_the_timeout_and_one_whose_session_ended_nothing(
    pg_dsn: str,
) -> None:
    """A session that announced itself as a listener and never confirms: `tell` gives up after its
    timeout (counted); once that session ended, `tell` confirms without waiting for it."""

    async def body() -> None:
        async with instances(pg_dsn, 2, timeout_s=1.0) as (a, b):
            mute = await asyncpg.connect(pg_dsn, server_settings={"application_name": APPLICATION})
            await mute.add_listener(policies.CHANNEL, lambda *_: None)
            await policies.announce(mute, "ready")
            await until(lambda: mute.get_server_pid() in a.sync.listeners())
            timeouts = propagated("timeout")
            await store(a, b'{"paused": true}')
            assert propagated("timeout") - timeouts == 1
            await mute.close()
            confirmed = propagated("confirmed")
            rid, _ = await store(a, b'{"paused": false}')
            assert propagated("timeout") - timeouts == 1
            assert propagated("confirmed") - confirmed == 1
            assert any(t[0] == rid for t in b.told)
            assert mute.get_server_pid() not in a.sync.listeners()

    run(body)


def test_a_listener_whose_connection_is_ended_connects_again_and_reloads_every_policy(pg_dsn: str) -> None:
    """pg_terminate_backend of one instance's listener: it connects again (a new session), reads
    every policy again, and is told the next policy as before."""

    async def body() -> None:
        async with instances(pg_dsn, 2) as (a, b):
            old, reloads = b.sync.pid, b.reloads
            async with a.pool.acquire() as conn:
                assert await conn.fetchval("SELECT pg_terminate_backend($1)", old)
            await until(lambda: b.sync.pid not in (None, old) and b.reloads > reloads)
            await until(lambda: b.sync.pid in a.sync.listeners())
            rid, ms = await store(a, b'{"max_in_flight": 3}')
            assert (rid, b'{"max_in_flight": 3}', ms) in b.told

    run(body)
