"""Which EMQX node restarts dispatch acts on (exhook_server/dispatch/restarts.py)."""

from __future__ import annotations

from exhook_server.dispatch.restarts import SLACK_MS, NodeStarts

T0 = 1_800_000_000_000


def test_a_node_started_before_us_is_not_a_restart_and_a_later_start_is_once() -> None:
    starts = NodeStarts(lambda: T0)
    assert not starts.restarted("emqx@n1", T0 - 3_600_000)  # up before we started: nothing of ours is older
    assert starts.restarted("emqx@n1", T0 + 60_000)
    assert not starts.restarted("emqx@n1", T0 + 60_000 + SLACK_MS)  # a reload of the same incarnation
    assert starts.restarted("emqx@n1", T0 + 120_000)
    assert starts.restarted("emqx@n2", T0 + 90_000)  # per node


def test_a_baseline_of_zero_acts_on_the_first_start_seen() -> None:
    """PostgreSQL's form: what a restart drops is only what was recorded before it."""
    starts = NodeStarts(lambda: 0)
    assert starts.restarted("emqx@n1", T0)
    assert not starts.restarted("emqx@n1", T0 + 5)
