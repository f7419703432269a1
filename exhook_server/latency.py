"""Live time-to-delivery: each delivery's latencies counted per generation, written in batches.

Dispatch reports a delivery's stored -> PUBACK and PUBACK -> answer latencies (`observe`); each
is a counter increment here (its generation, stage and log bucket: storage/latency.py) and an
observation of the Prometheus histogram. Every FLUSH_S the counts go to the store in one write
(`Writes.add_latency`; LMDB with the next commit), so the delivery path never waits for them; a
crash loses at most the last second's. What the store cannot take now is kept, up to MAX_KEYS.
"""

from __future__ import annotations

import asyncio

import structlog

from exhook_server import metrics
from storage.errors import StorageError
from storage.latency import STAGES, Increment, bucket_of
from storage.port import Writes

log = structlog.get_logger("sdv_fanout.latency")

#: Seconds between writes of the counts (progress reports read them every progress_interval_s).
FLUSH_S = 1.0
#: Counters held at most while the store cannot take them: (generation, stage, bucket) each.
MAX_KEYS = 100_000


class Latencies:
    """This process's latency counts not written yet."""

    def __init__(self, writes: Writes) -> None:
        self._writes = writes
        self._counts: dict[tuple[str, bytes, str, int], int] = {}
        #: The histogram's child per stage, bound once (a labels() lookup per delivery saved).
        self._histogram = {stage: metrics.DELIVERY_LATENCY.labels(stage) for stage in STAGES}

    def observe(self, vin: str, request_id: str, sha1: bytes, stage: str, ms: int, ends: bool) -> None:
        """A delivery's latency (dispatch's LatencyListener)."""
        self._histogram[stage].observe(max(0, ms) / 1000)
        key = (request_id, sha1, stage, bucket_of(ms))
        if key in self._counts:
            self._counts[key] += 1
        elif len(self._counts) < MAX_KEYS:
            self._counts[key] = 1
        else:
            metrics.LATENCY_DROPPED.inc()

    async def flush(self) -> int:
        """Write the counts held (kept for the next try when the store fails); how many."""
        counts, self._counts = self._counts, {}
        if not counts:
            return 0
        increments: list[Increment] = [(*key, n) for key, n in counts.items()]
        try:
            await self._writes.add_latency(increments)
        except StorageError as exc:
            log.warning("latency_not_stored", reason=type(exc).__name__, detail=str(exc), counters=len(counts))
            for key, n in counts.items():
                if key in self._counts or len(self._counts) < MAX_KEYS:
                    self._counts[key] = self._counts.get(key, 0) + n
            return 0
        return len(increments)

    async def run(self) -> None:
        """Forever: flush every FLUSH_S."""
        while True:
            await asyncio.sleep(FLUSH_S)
            await self.flush()
