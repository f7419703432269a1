"""Small asyncio helpers shared by the server's long-running parts."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

import structlog

log = structlog.get_logger("sdv_fanout.server")
T = TypeVar("T")
#: A named background job: (task name, coroutine).
Job = tuple[str, Coroutine[Any, Any, None]]

#: How long `cancel_all` waits before it cancels a loop again, and how many times it does.
_PATIENCE_S = 1.0
_TRIES = 10


async def cancel_all(tasks: Iterable[asyncio.Task[None]]) -> None:
    """Cancel background loops and wait until each has really stopped (none outlives its owner).

    A loop that catches a failure and goes on can swallow its cancel when the failure was the
    cancel's doing (a database client interrupted mid-query may raise its own error instead):
    such a loop is cancelled again every `_PATIENCE_S`, a bounded number of times, so a stop
    never waits forever on one; one that still runs is logged and left. A cancel of the caller
    meanwhile waits for the end of this (it would leave the loops running), then goes on."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    interrupted = False
    for _ in range(_TRIES):
        running = [t for t in tasks if not t.done()]
        if not running:
            break
        try:
            _, still = await asyncio.wait(running, timeout=_PATIENCE_S)
        except asyncio.CancelledError:  # our owner is stopping too: finish this (bounded) first
            interrupted = True
            still = {t for t in running if not t.done()}
        for task in still:
            log.warning("task_cancelled_again", task=task.get_name())
            task.cancel()
    for task in tasks:
        if not task.done():
            log.error("task_would_not_stop", task=task.get_name())
            continue
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if interrupted:
        raise asyncio.CancelledError


async def in_daemon_thread(fn: Callable[[], T]) -> T:
    """`fn()` in a daemon thread of its own, awaited: unlike `asyncio.to_thread`, a call still
    blocked (a network peer that never answers) does not hold up the process's exit, which waits
    for the default executor's threads. Cancelling the await leaves the thread to finish alone."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not done.done():
            outcome()

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # handed to the awaiting coroutine
            error = exc
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting
                loop.call_soon_threadsafe(settle, lambda: done.set_exception(error))
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, lambda: done.set_result(result))

    threading.Thread(target=run, name=getattr(fn, "__name__", "worker"), daemon=True).start()
    return await done
