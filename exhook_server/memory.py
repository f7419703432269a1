"""Keeping glibc's malloc from holding on to the memory of a burst of large batches.

Python and gRPC free a batch's buffers when its call ends, but glibc keeps freed pages in its
arenas for reuse (one arena per allocating thread, up to 8 per core). Two arenas per process
(`limit_arenas`) lower the peak of such a flood, and `malloc_trim(0)` once ingest is quiet after
a burst (`trim_after_bursts`) returns the rest. Not glibc: both do nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import time
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:  # procs imports this module before the fork, prometheus_client (metrics) after
    from exhook_server.admission import IngestBudget

log = structlog.get_logger("sdv_fanout.memory")

#: Batch bytes that must have gone through ingest since the last trim: below this, what a trim
#: could return is not worth its walk over the arenas.
MIN_CHURN_BYTES = 32 << 20
#: Arenas per process: the main thread, the group committer and gRPC's threads share them.
ARENAS = 2
_M_ARENA_MAX = -8  # glibc malloc.h


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def limit_arenas() -> bool:
    """Cap malloc arenas at ARENAS before the threads that would create more start (and before
    `serve` forks its processes, which inherit it). An operator's MALLOC_ARENA_MAX wins."""
    if _LIBC is None or "MALLOC_ARENA_MAX" in os.environ:
        return False
    return bool(_LIBC.mallopt(_M_ARENA_MAX, ARENAS))


def trim() -> bool:
    """Return every free heap page to the kernel now (blocking); False where libc cannot."""
    if _LIBC is None:
        return False
    _LIBC.malloc_trim(0)
    return True


def rss_bytes() -> int:
    """This process's resident memory."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class BurstWatch:
    """Tick by tick, whether a burst of batches just ended: nothing in progress now, little came in
    since the last tick, and at least MIN_CHURN_BYTES since the last trim. Never mid-burst: the
    pages a trim returns would only be faulted back in at once."""

    def __init__(self, seen_total: int = 0) -> None:
        self._trimmed_at = self._last_seen = seen_total

    def ended(self, in_use: int, seen_total: int) -> bool:
        """One tick with the budget's `in_use` and `seen_total`; True means trim now."""
        recent, self._last_seen = seen_total - self._last_seen, seen_total
        if in_use or recent >= MIN_CHURN_BYTES or seen_total - self._trimmed_at < MIN_CHURN_BYTES:
            return False
        self._trimmed_at = seen_total
        return True


async def trim_after_bursts(budget: IngestBudget, interval_s: float = 1.0) -> None:
    """Forever: every `interval_s`, trim (in a thread) and log `memory_trimmed` when a burst ended."""
    watch = BurstWatch(budget.seen_total)
    while True:
        await asyncio.sleep(interval_s)
        if not watch.ended(budget.in_use, budget.seen_total):
            continue
        before, started = rss_bytes(), time.perf_counter()
        if not await asyncio.to_thread(trim):
            return
        log.info(
            "memory_trimmed",
            rss_before=before,
            rss_after=rss_bytes(),
            took_ms=round((time.perf_counter() - started) * 1000, 1),
        )
