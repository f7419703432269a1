"""Admission control for batch calls: a byte budget, refused at once rather than queued.

Each batch payload is held several times over while it is validated and committed (the
gRPC message, its parsed copy, the JSON document, the blob, the echoed reply), so the bytes
in progress are what a flood costs in memory. `IngestBudget` caps them per server process;
a call that does not fit is refused on the spot (the caller answers RESOURCE_EXHAUSTED),
because a waiting queue would itself hold every waiting payload. Event-loop thread only.
"""

from __future__ import annotations

import structlog

from exhook_server import metrics

log = structlog.get_logger("sdv_fanout.admission")


class IngestBudget:
    """Payload bytes of batch calls in progress, at most `limit_bytes` at once.

    A call is charged at most `limit_bytes` (`charge`), so an idle server admits any call and
    nothing is refused forever.
    """

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes <= 0:
            raise ValueError("limit_bytes must be positive")
        self.limit_bytes = limit_bytes
        #: Bytes admitted and not yet released.
        self.in_use = 0
        #: Bytes of every call that asked, admitted or not: how much memory churned (see `memory`).
        self.seen_total = 0

    def charge(self, size: int) -> int:
        """What a call of `size` payload bytes is charged: at most the whole budget."""
        return min(size, self.limit_bytes)

    def fits(self, size: int) -> bool:
        """Would a call of `size` bytes be admitted now? (No charge, no log.)"""
        return self.in_use + self.charge(size) <= self.limit_bytes

    def try_acquire(self, charge: int) -> bool:
        """Take `charge` (from `charge()`) if it fits under the limit; False (logged, counted) if not."""
        self.seen_total += charge
        if self.in_use + charge > self.limit_bytes:
            self._refuse(charge)
            return False
        self.in_use += charge
        metrics.INGEST_INFLIGHT_BYTES.set(self.in_use)
        return True

    def turn_away(self, size: int) -> None:
        """Refuse a call of `size` bytes that did not `fit` before its message was even parsed."""
        self.seen_total += size
        self._refuse(size)

    def _refuse(self, size: int) -> None:
        metrics.REFUSED_CALLS.inc()
        metrics.REFUSED_BYTES.inc(size)
        log.warning("batch_refused_overload", size=size, in_progress_bytes=self.in_use, limit_bytes=self.limit_bytes)

    def release(self, charge: int) -> None:
        """Give back what `try_acquire` took, once the call is answered or has failed."""
        if charge > self.in_use:
            raise ValueError(f"releasing {charge} bytes, only {self.in_use} in use")
        self.in_use -= charge
        metrics.INGEST_INFLIGHT_BYTES.set(self.in_use)
