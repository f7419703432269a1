"""PostgreSQL: the types of the asyncpg objects the store's functions take, and `fetch_one`.

asyncpg-stubs (pinned to asyncpg's version) types asyncpg for mypy. `Connection` is what a function
that runs statements takes: a connection of its own or one acquired from a `Pool`. A `Record`'s
column values are `Any`: their Python type follows the column's SQL type.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

import asyncpg

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

Record: TypeAlias = asyncpg.Record
Connection: TypeAlias = "asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record]"
Pool: TypeAlias = "asyncpg.Pool[asyncpg.Record]"


class NoRow(Exception):
    """A statement that always returns one row (an aggregate, a function's result) returned none."""


async def fetch_one(conn: Connection, query: str, *args: object) -> Record:
    """The one row of `query`, a statement that always returns exactly one."""
    row = await conn.fetchrow(query, *args)
    if row is None:
        raise NoRow(query)
    return row
