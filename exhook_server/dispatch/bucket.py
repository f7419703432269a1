"""A token bucket on an injected clock: how many starts a rate allows now, and when the next one.

Tokens accrue at `rate_per_s` up to `burst` (so at most `burst` go at once after a quiet spell,
and over any interval T at most `burst + rate_per_s * T`); `take` spends them, all or nothing,
`take_up_to` as many whole ones as there are. `wait_s` says how long until n tokens are there.
`set_rate` changes the rate from now on (tokens accrued so far keep the old rate). The clock is
seconds from any origin (time.monotonic by default); a clock stepping back accrues nothing.
Not thread-safe: one owner (a worker, an event loop) uses it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class TokenBucket:
    """Starts allowed at `rate_per_s`, at most `burst` at once."""

    __slots__ = ("_burst", "_clock", "_rate", "_stamp", "_tokens")

    def __init__(
        self,
        rate_per_s: float,
        burst: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        tokens: float | None = None,
    ) -> None:
        """`tokens`: what the bucket holds at first (default full: `burst`)."""
        _check(rate_per_s, burst)
        self._rate = rate_per_s
        self._burst = burst
        self._clock = clock
        self._stamp = clock()
        self._tokens = burst if tokens is None else min(max(tokens, 0.0), burst)

    @property
    def rate_per_s(self) -> float:
        return self._rate

    @property
    def burst(self) -> float:
        return self._burst

    def set_rate(self, rate_per_s: float, burst: float | None = None) -> None:
        """Accrue at `rate_per_s` from now on (and hold at most `burst`, when given)."""
        new_burst = self._burst if burst is None else burst
        _check(rate_per_s, new_burst)
        self._refill()
        self._rate, self._burst = rate_per_s, new_burst
        self._tokens = min(self._tokens, new_burst)

    def available(self) -> float:
        """Tokens there now (fractional: a part of the next one has accrued)."""
        self._refill()
        return self._tokens

    def take(self, n: float = 1.0) -> bool:
        """Spend `n` tokens if they are all there; False (nothing spent) otherwise."""
        self._refill()
        if self._tokens + 1e-9 < n:
            return False
        self._tokens = max(self._tokens - n, 0.0)
        return True

    def take_up_to(self, n: int) -> int:
        """Spend as many whole tokens as there are, at most `n`; how many were spent."""
        self._refill()
        got = min(n, math.floor(self._tokens + 1e-9))
        if got > 0:
            self._tokens = max(self._tokens - got, 0.0)
        return max(got, 0)

    def wait_s(self, n: float = 1.0) -> float:
        """Seconds until `n` tokens are there (0: now); inf when `n` exceeds the burst."""
        self._refill()
        missing = n - self._tokens
        if missing <= 1e-9:
            return 0.0
        if n > self._burst + 1e-9:
            return math.inf
        return missing / self._rate

    def _refill(self) -> None:
        now = self._clock()
        elapsed = now - self._stamp
        self._stamp = now
        if elapsed > 0:
            self._tokens = min(self._tokens + elapsed * self._rate, self._burst)


def _check(rate_per_s: float, burst: float) -> None:
    if not (math.isfinite(rate_per_s) and rate_per_s > 0):
        raise ValueError(f"rate_per_s must be a positive number, not {rate_per_s!r}")
    if not (math.isfinite(burst) and burst >= 1):
        raise ValueError(f"burst must be at least 1 token, not {burst!r}")
