"""Campaign progress on the status topic: a generation's counts while they change, then `completed`.

One process (the one running store-wide housekeeping) reads the generation counts from the store
(`Reads`) every `progress_interval_s` and reports each generation whose counts changed: `progress`
with the counts, `completed` once nothing of it is pending (both, if it changes and completes
between two looks), never more than the store says. After a restart only changes since the start
are reported. A waiting `progress` is replaced by its generation's next one and gives way to every
other status message when the queue is full; `completed` is kept like a receipt.
"""

from __future__ import annotations

import asyncio

import structlog

from exhook_server.status import StatusPublisher
from storage.errors import StorageError
from storage.lmdb import outcomes
from storage.port import Reads

log = structlog.get_logger("sdv_fanout.progress")


class ProgressReporter:
    """Compares the stored generation counts with the last look and reports the differences."""

    def __init__(self, reads: Reads, status: StatusPublisher) -> None:
        self._reads = reads
        self._status = status
        #: (request_id, sha1) → (last change ms, pending) at the last look.
        self._seen: dict[tuple[str, bytes], tuple[int, int]] = {}
        self._started = False

    def report(self, gens: list[outcomes.Generation]) -> int:
        """Emit what changed since the last call (the first call only remembers); returns how
        many generations were reported."""
        seen, self._seen = self._seen, {}
        reported = 0
        for gen in gens:
            key = (gen.request_id, gen.sha1)
            before = seen.get(key)
            self._seen[key] = (gen.last_ms, gen.pending)
            if not self._started or (before is not None and before[0] == gen.last_ms):
                continue
            reported += 1
            sha1 = gen.sha1.hex()
            self._status.emit("progress", gen.request_id, sha1=sha1, counts=gen.counts)
            if gen.pending == 0 and (before is None or before[1] > 0):
                self._status.emit("completed", gen.request_id, sha1=sha1, counts=gen.counts)
        self._started = True
        return reported

    async def run(self, interval_s: float) -> None:
        """Forever: look every `interval_s`; storage errors are logged, not fatal."""
        while True:
            try:
                self.report(await self._reads.all_generations())
            except StorageError as exc:
                log.error("progress_failed", reason=type(exc).__name__, detail=str(exc))
            await asyncio.sleep(interval_s)
