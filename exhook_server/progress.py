"""Campaign progress on the status topic: a generation's counts while they change, then `completed`.

One process (the one running store-wide housekeeping) reads the generation counts from the store
(`Reads`) every `progress_interval_s` and reports each generation whose counts changed: `progress`
with the counts and delivery latencies (`latency_ms`), `completed` once nothing of it is pending
(SETTLE_S later, with its last latencies), never more than the store says. After a restart only changes since the start
are reported. A waiting `progress` is replaced by its generation's next one and gives way to every
other status message when the queue is full; `completed` is kept like a receipt.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

import structlog

from exhook_server.latency import FLUSH_S
from exhook_server.status import StatusPublisher
from storage.errors import StorageError
from storage.latency import Counts, latency_ms
from storage.lmdb import outcomes
from storage.port import Reads

log = structlog.get_logger("sdv_fanout.progress")

#: How long a `completed` waits for the latencies of the generation's last deliveries: every
#: process writes its counts each FLUSH_S, LMDB's with a commit that may wait ack_commit_delay_ms.
SETTLE_S = FLUSH_S + 0.5


class ProgressReporter:
    """Compares the stored generation counts with the last look and reports the differences."""

    def __init__(self, reads: Reads, status: StatusPublisher, clock: Callable[[], float] = time.monotonic) -> None:
        self._reads = reads
        self._status = status
        self._clock = clock
        #: Completed generations whose `completed` waits for their last latencies: (due, generation).
        self._due: list[tuple[float, outcomes.Generation]] = []
        #: (request_id, sha1) → (last change ms, pending) at the last look.
        self._seen: dict[tuple[str, bytes], tuple[int, int]] = {}
        self._started = False

    def report(self, gens: list[outcomes.Generation]) -> int:
        """Emit what changed since the last call (the first call only remembers); returns how
        many generations were reported."""
        return self._emit(self._changes(gens), {})

    async def look(self) -> int:
        """`report` on the stored generations, with their latencies (one read per request
        reported). A `completed` waits SETTLE_S for the latencies of its last deliveries (each
        process writes its counts every second), then goes with every one counted."""
        changes = self._changes(await self._reads.all_generations())
        now = self._clock()
        self._due += [(now + SETTLE_S, gen) for gen, completed in changes if completed]
        due = [gen for at, gen in self._due if at <= now]
        self._due = [(at, gen) for at, gen in self._due if at > now]
        wanted = dict.fromkeys(g.request_id for g in [*(g for g, _ in changes), *due])
        latency = {rid: await self._reads.latency(rid) for rid in wanted}
        self._emit([(gen, False) for gen, _ in changes], latency)
        self._emit([(gen, True) for gen in due], latency, progress=False)
        return len(changes)

    def next_look_s(self, interval_s: float) -> float:
        """Seconds to the next look: `interval_s`, or sooner when a `completed` is due."""
        if not self._due:
            return interval_s
        return max(0.0, min(interval_s, min(at for at, _ in self._due) - self._clock()))

    def _changes(self, gens: list[outcomes.Generation]) -> list[tuple[outcomes.Generation, bool]]:
        """The generations changed since the last look (none at the first), each with whether it
        completed since."""
        seen, self._seen = self._seen, {}
        changes = []
        for gen in gens:
            key = (gen.request_id, gen.sha1)
            before = seen.get(key)
            self._seen[key] = (gen.last_ms, gen.pending)
            if not self._started or (before is not None and before[0] == gen.last_ms):
                continue
            changes.append((gen, gen.pending == 0 and (before is None or before[1] > 0)))
        self._started = True
        return changes

    def _emit(
        self,
        changes: list[tuple[outcomes.Generation, bool]],
        latency: Mapping[str, Mapping[bytes, Counts]],
        *,
        progress: bool = True,
    ) -> int:
        for gen, completed in changes:
            sha1 = gen.sha1.hex()
            shown = latency_ms(latency.get(gen.request_id, {}).get(gen.sha1, {})) or None
            if progress:
                self._status.emit("progress", gen.request_id, sha1=sha1, counts=gen.counts, latency_ms=shown)
            if completed:
                self._status.emit("completed", gen.request_id, sha1=sha1, counts=gen.counts, latency_ms=shown)
        return len(changes)

    async def run(self, interval_s: float) -> None:
        """Forever: look every `interval_s`; storage errors are logged, not fatal."""
        while True:
            try:
                await self.look()
            except StorageError as exc:
                log.error("progress_failed", reason=type(exc).__name__, detail=str(exc))
            await asyncio.sleep(self.next_look_s(interval_s))
