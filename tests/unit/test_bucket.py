"""The token bucket under an injected clock: accrual up to the burst, all-or-nothing and partial
takes, the wait until a token, a rate change keeping what accrued, and a clock stepping back."""

from __future__ import annotations

import math

import pytest

from exhook_server.dispatch.bucket import TokenBucket


class Clock:
    def __init__(self) -> None:
        self.s = 1000.0

    def __call__(self) -> float:
        return self.s


def test_a_full_bucket_allows_its_burst_then_one_token_per_interval() -> None:
    """Full at first: `burst` go at once, then one each 1/rate seconds."""
    clock = Clock()
    bucket = TokenBucket(rate_per_s=2.0, burst=3.0, clock=clock)
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    assert bucket.wait_s() == pytest.approx(0.5)
    clock.s += 0.25
    assert not bucket.take() and bucket.wait_s() == pytest.approx(0.25)
    clock.s += 0.25
    assert bucket.take() and not bucket.take()


def test_tokens_accrue_only_up_to_the_burst() -> None:
    """A quiet hour leaves `burst` tokens, not an hour's worth."""
    clock = Clock()
    bucket = TokenBucket(rate_per_s=10.0, burst=5.0, clock=clock, tokens=0)
    assert bucket.available() == 0
    clock.s += 3600
    assert bucket.available() == 5.0
    assert bucket.take_up_to(100) == 5 and bucket.take_up_to(100) == 0


def test_starts_over_an_interval_never_exceed_burst_plus_rate_times_interval() -> None:
    """Taking greedily every 7 ms for 60 s: burst + 60 * rate starts, within one token."""
    clock = Clock()
    bucket = TokenBucket(rate_per_s=100 / 60, burst=5.0, clock=clock)
    started = 0
    for _ in range(60_000 // 7):
        started += bucket.take_up_to(10)
        clock.s += 0.007
    assert 5 + 100 - 1 <= started <= 5 + 100


def test_take_is_all_or_nothing_and_take_up_to_gives_whole_tokens() -> None:
    """take(3) with 2.5 tokens spends nothing; take_up_to(3) spends 2 and keeps the half."""
    clock = Clock()
    bucket = TokenBucket(rate_per_s=1.0, burst=4.0, clock=clock, tokens=2.5)
    assert not bucket.take(3) and bucket.available() == 2.5
    assert bucket.take_up_to(3) == 2 and bucket.available() == pytest.approx(0.5)
    assert bucket.wait_s() == pytest.approx(0.5)


def test_more_than_the_burst_never_comes() -> None:
    """wait_s for more tokens than the bucket holds is infinite; take of them is refused."""
    bucket = TokenBucket(rate_per_s=1.0, burst=2.0, clock=Clock())
    assert bucket.wait_s(3) == math.inf and not bucket.take(3)


def test_set_rate_keeps_what_accrued_at_the_old_rate() -> None:
    """Tokens accrued before the change count at the old rate, later ones at the new."""
    clock = Clock()
    bucket = TokenBucket(rate_per_s=1.0, burst=10.0, clock=clock, tokens=0)
    clock.s += 2
    bucket.set_rate(4.0)
    clock.s += 1
    assert bucket.available() == pytest.approx(2 + 4)
    bucket.set_rate(4.0, burst=3.0)  # a smaller burst clips what is held
    assert bucket.available() == 3.0 and bucket.rate_per_s == 4.0 and bucket.burst == 3.0


def test_a_clock_stepping_back_accrues_nothing() -> None:
    """An injected clock going back in time neither adds nor removes tokens."""
    clock = Clock()
    bucket = TokenBucket(rate_per_s=1.0, burst=5.0, clock=clock, tokens=1)
    clock.s -= 100
    assert bucket.available() == 1
    clock.s += 1  # from the stepped-back time: one second later
    assert bucket.available() == 2


@pytest.mark.parametrize(("rate", "burst"), [(0.0, 1.0), (-1.0, 1.0), (math.nan, 1.0), (1.0, 0.5), (1.0, math.inf)])
def test_a_rate_or_burst_that_cannot_work_is_refused(rate: float, burst: float) -> None:
    """A non-positive or non-finite rate, or a burst below one token, raises ValueError."""
    with pytest.raises(ValueError):
        TokenBucket(rate, burst, clock=Clock())
