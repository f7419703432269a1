"""Latencies of a generation's deliveries as counts in log buckets, and the percentiles they give.

A latency of `ms` milliseconds is counted in bucket `bucket_of(ms)`: bucket i holds [BOUNDS[i-1],
BOUNDS[i]) (bucket 0 below 1 ms, the last one from BOUNDS[-1] on). Neighbouring bounds differ by at
most 10 %, so a percentile read back as its bucket's geometric middle is within 5 % of the exact
one. Both stores keep the counts per (request id, sha1, stage) and bucket; the rule is this module.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from typing import TypeAlias

#: The stages measured: stored -> PUBACK, and PUBACK -> the vehicle's answer.
STAGES = ("delivered", "answered")
#: Latencies counted apart at most: beyond (~50 days), the last bucket.
MAX_MS = 50 * 86_400_000


def _bounds() -> tuple[int, ...]:
    """Every ms up to 20 (a bucket of one value is exact), then each bound the floor of 1.1
    times the last: a bucket's values span at most 10 %."""
    bounds = list(range(1, 21))
    while bounds[-1] < MAX_MS:
        bounds.append(math.floor(bounds[-1] * 1.1))
    return tuple(bounds)


#: Bucket lower bounds in ms.
BOUNDS = _bounds()
BUCKETS = len(BOUNDS) + 1
#: One generation's counts: stage -> bucket -> latencies counted there.
Counts: TypeAlias = dict[str, dict[int, int]]
#: What a store adds to: (request id, sha1, stage, bucket, count).
Increment: TypeAlias = tuple[str, bytes, str, int, int]
#: The percentiles reported.
QUANTILES = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99))


def bucket_of(ms: int) -> int:
    """The bucket counting a latency of `ms` milliseconds (negative: 0, a clock step)."""
    return bisect.bisect_right(BOUNDS, ms)


def _middle(bucket: int) -> int:
    """A bucket's value: the geometric middle of the latencies it can hold (whole ms)."""
    if bucket == 0:
        return 0
    low = BOUNDS[bucket - 1]
    high = BOUNDS[bucket] - 1 if bucket < len(BOUNDS) else low
    return round(math.sqrt(low * high))


def percentiles(counts: Mapping[int, int]) -> dict[str, int] | None:
    """p50 / p90 / p99 in ms (nearest rank) of the latencies counted by bucket; None when none."""
    total = sum(counts.values())
    if total <= 0:
        return None
    ranked = sorted((b, n) for b, n in counts.items() if n > 0)
    out: dict[str, int] = {}
    for name, q in QUANTILES:
        rank = max(1, math.ceil(q * total))
        seen = 0
        for bucket, n in ranked:
            seen += n
            if seen >= rank:
                out[name] = _middle(bucket)
                break
    return out


def latency_ms(by_stage: Mapping[str, Mapping[int, int]]) -> dict[str, dict[str, int]]:
    """The `latency_ms` field of events and answers: percentiles per stage that has counts."""
    return {stage: p for stage in STAGES if (p := percentiles(by_stage.get(stage, {}))) is not None}
