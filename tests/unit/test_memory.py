"""Memory handed back after a burst of batches: once the burst is over, never in the middle of it."""

from __future__ import annotations

import asyncio
import time

from structlog.testing import capture_logs

from exhook_server import log, memory
from exhook_server.admission import IngestBudget

MiB = 1 << 20
BIG = memory.MIN_CHURN_BYTES


def ticks(watch: memory.BurstWatch, seen_per_tick: list[int], in_use: int = 0) -> list[bool]:
    """Drive `watch` with the batch bytes that came in during each tick; its answer at each."""
    seen, out = 0, []
    for size in seen_per_tick:
        seen += size
        out.append(watch.ended(in_use, seen))
    return out


def test_a_burst_is_trimmed_once_the_tick_after_it_ends() -> None:
    """Heavy ticks, then quiet ones: one trim, on the first quiet tick."""
    assert ticks(memory.BurstWatch(), [BIG, BIG, BIG, 0, 0, 0]) == [False, False, False, True, False, False]


def test_small_traffic_is_never_trimmed_until_it_adds_up() -> None:
    """Light ticks trim only once MIN_CHURN_BYTES went through since the last trim."""
    light = BIG // 4
    assert ticks(memory.BurstWatch(), [light] * 6) == [False, False, False, True, False, False]


def test_no_trim_while_a_batch_is_in_progress() -> None:
    """A burst whose last batch is still being committed is not over."""
    assert ticks(memory.BurstWatch(), [BIG, 0, 0], in_use=MiB) == [False, False, False]


def test_the_trimmer_trims_and_logs_after_a_burst() -> None:
    """trim_after_bursts calls malloc_trim after a burst and logs the RSS before and after."""

    async def run() -> list[dict[str, object]]:
        budget = IngestBudget(MiB)
        with capture_logs() as logs:
            task = asyncio.create_task(memory.trim_after_bursts(budget, interval_s=0.01))
            await asyncio.sleep(0)  # the trimmer takes its starting point
            budget.turn_away(BIG)  # a burst of refused calls churns memory too
            deadline = time.monotonic() + 10
            while not any(e["event"] == "memory_trimmed" for e in logs) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            task.cancel()
        return [e for e in logs if e["event"] == "memory_trimmed"]

    log.configure("console", "info", cache=False)  # memory_trimmed is an info event
    try:
        [line] = asyncio.run(run())
    finally:
        log.configure("console", "warning", cache=False)  # as tests/conftest.py has it
    assert line["rss_before"] > 0 and line["rss_after"] > 0 and line["took_ms"] >= 0
