"""The expiry sweep: rows past their expires_at end `expired`, in chunks of max_rows_per_commit,
every expiry_sweep_interval_s, over either store's `Writes`.

Dispatch never offers such a row anyway; the sweep gives it its outcome. An idle sweep costs one
read and no write; a failed one is logged and the next tries again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from exhook_server import metrics
from exhook_server.config import Config
from exhook_server.dispatch.worker import OutcomeListener
from storage.errors import StorageError
from storage.model import Outcome, now_ms
from storage.port import Writes

log = structlog.get_logger("sdv_fanout.ingest")


class ExpirySweep:
    """Ends expired rows (`sweep`), and forever at its interval (`run`)."""

    def __init__(self, cfg: Config, writes: Writes, clock: Callable[[], int] = now_ms) -> None:
        self._cfg = cfg
        self._writes = writes
        self._clock = clock
        self.outcome_listeners: list[OutcomeListener] = []

    async def sweep(self) -> int:
        """End `expired` every row past its expires_at, in chunks; returns how many."""
        ended_total = 0
        limit = self._cfg.max_rows_per_commit
        soonest = await self._writes.first_deadline()  # an idle sweep costs one read, no write
        if soonest is None or soonest > self._clock():
            return 0
        while True:
            ended = await self._writes.expire_due(self._clock(), limit)
            if ended:
                metrics.OUTCOMES.labels("expired").inc(len(ended))
                log.info("rows_expired", rows=len(ended), request_ids=sorted({rid for _, rid, _ in ended})[:10])
                for listener in self.outcome_listeners:
                    for vin, rid, sha1 in ended:
                        listener(vin, rid, sha1, Outcome.EXPIRED, 0)
            ended_total += len(ended)
            if len(ended) < limit:
                return ended_total

    async def run(self) -> None:
        """Forever: end expired rows every expiry_sweep_interval_s; errors are logged, not fatal."""
        while True:
            await asyncio.sleep(self._cfg.expiry_sweep_interval_s)
            try:
                await self.sweep()
            except StorageError as exc:
                log.error("expiry_sweep_failed", reason=type(exc).__name__, detail=str(exc))
