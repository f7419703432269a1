"""storage/latency.py: log buckets whose percentiles are within 5 % of the exact ones."""

from __future__ import annotations

import math
import random

from storage.latency import BOUNDS, bucket_of, latency_ms, percentiles


def exact(samples: list[int], q: float) -> int:
    """The nearest-rank percentile."""
    return sorted(samples)[max(1, math.ceil(q * len(samples))) - 1]


def test_percentiles_from_buckets_are_within_five_percent_of_the_exact_ones() -> None:
    """Random latencies from 1 ms to days, several shapes: p50/p90/p99 off by at most 5 %."""
    rng = random.Random(26)
    shapes = [
        [rng.randint(1, 30) for _ in range(500)],
        [round(rng.lognormvariate(6, 2)) + 1 for _ in range(5_000)],
        [rng.randint(1, 86_400_000) for _ in range(2_000)],
        [7] * 99 + [3_600_000],
    ]
    for samples in shapes:
        counts: dict[int, int] = {}
        for ms in samples:
            counts[bucket_of(ms)] = counts.get(bucket_of(ms), 0) + 1
        found = percentiles(counts)
        assert found is not None
        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            want = exact(samples, q)
            assert abs(found[name] - want) <= 0.05 * want, (name, found[name], want)


def test_small_latencies_are_exact_and_a_clock_step_counts_as_zero() -> None:
    """Up to 20 ms each ms is a bucket of its own; a negative latency (a clock step) is 0."""
    assert [percentiles({bucket_of(ms): 1}) for ms in (1, 7, 20)] == [
        {"p50": ms, "p90": ms, "p99": ms} for ms in (1, 7, 20)
    ]
    assert percentiles({bucket_of(-5): 3}) == {"p50": 0, "p90": 0, "p99": 0}
    assert bucket_of(BOUNDS[-1] * 10) == len(BOUNDS)


def test_latency_ms_names_only_the_stages_counted() -> None:
    """No answers awaited: no `answered`; nothing counted at all: empty."""
    shown = latency_ms({"delivered": {bucket_of(250): 2}})
    assert list(shown) == ["delivered"] and abs(shown["delivered"]["p99"] - 250) <= 12.5
    assert latency_ms({}) == {}
