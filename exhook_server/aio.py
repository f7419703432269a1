"""Small asyncio helpers shared by the server's long-running parts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable


async def cancel_all(tasks: Iterable[asyncio.Task[None]]) -> None:
    """Cancel background loops and wait until each has really stopped (none outlives its owner)."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
