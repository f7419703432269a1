"""exhook_server/forecast.py: when a campaign's rows will all have started, on an injected clock."""

from __future__ import annotations

import datetime

from exhook_server.forecast import completes_at
from exhook_server.policy import Policy, Ramp, Window

UTC = datetime.UTC


def ms(*when: int) -> int:
    return int(datetime.datetime(*when, tzinfo=UTC).timestamp() * 1000)  # type: ignore[misc]


NOW = ms(2026, 11, 28, 1, 0)


def test_without_a_policy_or_a_rate_every_row_goes_now_or_when_the_gate_opens() -> None:
    """No rate bounds it: the rows go the moment the gate is open (now, or start_at)."""
    assert completes_at(None, 0, 1_000, NOW) == NOW
    assert completes_at(Policy(start_at_ms=NOW + 5_000), NOW, 1_000, NOW) == NOW + 5_000
    assert completes_at(Policy(max_per_minute=60), NOW, 0, NOW) == NOW


def test_a_paused_policy_never_completes() -> None:
    """Paused: nothing is sent, so no completion time."""
    assert completes_at(Policy(paused=True, max_per_minute=60), NOW, 10, NOW) is None


def test_a_rate_spreads_the_rows_from_start_at() -> None:
    """60 a minute: 120 rows take two minutes from start_at."""
    policy = Policy(max_per_minute=60, start_at_ms=NOW + 60_000)
    assert completes_at(policy, NOW, 120, NOW) == NOW + 60_000 + 120_000


def test_a_ramp_doubles_the_rate_each_step_up_to_the_maximum() -> None:
    """60, 120, then 240 a minute: 300 rows are 60 + 120 in two minutes, the last 120 in 30 s."""
    policy = Policy(max_per_minute=240, ramp=Ramp(60, 2.0, 60))
    assert completes_at(policy, NOW, 300, NOW) == NOW + 150_000
    # Set an hour ago: the ramp is over, 240 a minute from now.
    assert completes_at(policy, NOW - 3_600_000, 300, NOW) == NOW + 75_000


def test_rows_go_only_inside_windows_and_wait_for_the_next_one() -> None:
    """1 a minute in a daily 02:00-03:00 UTC window: 90 rows are 60 tonight and 30 tomorrow night."""
    policy = Policy(max_per_minute=1, windows=(Window("0 2 * * *", 3600, "UTC"),))
    assert completes_at(policy, NOW, 90, NOW) == ms(2026, 11, 29, 2, 30)
    assert completes_at(policy, NOW, 60, NOW) == ms(2026, 11, 28, 3, 0)


def test_overlapping_windows_are_one_open_stretch() -> None:
    """02:00 for 1 h and 02:30 for 1 h: open 02:00-03:30 without a break."""
    policy = Policy(windows=(Window("0 2 * * *", 3600, "UTC"), Window("30 2 * * *", 3600, "UTC")))
    assert policy.open_until(ms(2026, 11, 28, 2, 10)) == ms(2026, 11, 28, 3, 30)
    paced = Policy(max_per_minute=1, windows=policy.windows)
    assert completes_at(paced, NOW, 90, NOW) == ms(2026, 11, 28, 3, 30)
