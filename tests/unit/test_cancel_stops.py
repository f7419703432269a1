"""A stop always ends the server's loops: a database error caused by the cancel itself is not a
failure to retry, and a loop that swallows its cancel anyway is cancelled again, a bounded number
of times (a PostgreSQL-mode server once hung in stop() about one time in three)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import asyncpg

from exhook_server.aio import cancel_all
from exhook_server.backends.postgres import pgmode
from storage.errors import StorageError
from storage.postgres.errors import as_storage_error
from testkit.pg_cluster import APP_DB, APP_USER, PgCluster


async def _query_that_fails_when_interrupted() -> None:
    """What asyncpg can do: the interruption of a query surfaces as an error of its own."""
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        raise asyncpg.InterfaceError("cannot perform operation: another operation is in progress") from None


async def _retrying_loop(attempts: list[int]) -> None:
    """A background loop as the server has them: log the store's failure, try again (bounded
    here, so that a failing test ends)."""
    while len(attempts) < 20:
        attempts.append(1)
        with contextlib.suppress(StorageError):
            await as_storage_error(_query_that_fails_when_interrupted())
        await asyncio.sleep(0.01)


def test_a_cancel_that_the_driver_turns_into_its_own_error_still_stops_the_loop() -> None:
    async def main() -> tuple[bool, int]:
        attempts: list[int] = []
        task = asyncio.create_task(_retrying_loop(attempts))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.wait([task], timeout=5)
        cancelled = task.cancelled()
        task.cancel()
        await asyncio.wait([task], timeout=30)
        return cancelled, len(attempts)

    cancelled, attempts = asyncio.run(main())
    assert cancelled and attempts == 1


def test_a_real_database_failure_is_still_a_storage_error() -> None:
    async def fails() -> None:
        raise asyncpg.InterfaceError("connection is closed")

    async def main() -> str:
        try:
            await as_storage_error(fails())
        except StorageError as exc:
            return str(exc)
        return "no error"

    assert "InterfaceError" in asyncio.run(main())


def test_cancel_all_cancels_again_a_loop_that_swallowed_its_cancel() -> None:
    async def stubborn(swallowed: list[int]) -> None:
        for _ in range(3):
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                if not swallowed:
                    swallowed.append(1)
                    continue
                raise

    async def main() -> tuple[bool, bool, int]:
        swallowed: list[int] = []
        plain = asyncio.create_task(asyncio.sleep(30))
        odd = asyncio.create_task(stubborn(swallowed))
        await asyncio.sleep(0)
        stopping = asyncio.create_task(cancel_all([plain, odd]))
        done, _ = await asyncio.wait([stopping], timeout=10)  # not wait_for: its cancel would help
        odd.cancel()
        await asyncio.wait([odd, stopping], timeout=30)
        return bool(done), odd.cancelled(), len(swallowed)

    assert asyncio.run(main()) == (True, True, 1)


def test_a_leader_connect_cancelled_by_a_stop_is_over_when_the_cancel_returns(pg_cluster: PgCluster) -> None:
    """A stop that cancels the leader while its connection is opening (slow: a loaded machine, a
    far database) returns once that connect is over and its connection closed: nothing pending is
    left to a loop about to close (it was destroyed pending, its socket unclosed)."""

    async def main() -> tuple[list[str], int]:
        links: list[asyncio.Task[Any]] = []

        async def slow_link(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            links.append(asyncio.current_task())  # type: ignore[arg-type]
            await asyncio.sleep(0.5)  # the database answers late
            up_r, up_w = await asyncio.open_connection("127.0.0.1", pg_cluster.port)

            async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
                with contextlib.suppress(ConnectionError):
                    while data := await src.read(65536):
                        dst.write(data)
                        await dst.drain()
                dst.close()

            await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))

        link = await asyncio.start_server(slow_link, "127.0.0.1", 0)
        port = link.sockets[0].getsockname()[1]
        try:
            leader = asyncio.create_task(pgmode._connect(f"postgresql://{APP_USER}@127.0.0.1:{port}/{APP_DB}"))
            await asyncio.sleep(0.1)
            leader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await leader
            pending = [t.get_coro().__qualname__ for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            still = await asyncpg.connect(pg_cluster.dsn_for(APP_DB))
            try:
                opened = await still.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", pgmode.LEADER_APPLICATION
                )
            finally:
                await still.close()
            return [name for name in pending if name == "connect"], opened
        finally:
            link.close()
            await asyncio.wait(links, timeout=10)  # the link ends with the connection it carried
            await link.wait_closed()

    assert asyncio.run(main()) == ([], 0)
