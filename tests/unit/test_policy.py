"""Campaign policies as values: what a policy message may say (reason `bad_policy` naming the field
otherwise), its stored form, and when its gate opens under an injected clock (start_at, paused,
windows in an IANA zone across a DST change)."""

from __future__ import annotations

import datetime
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from exhook_server.batch import BatchParser, Kind, PolicyDoc
from exhook_server.config import Config
from exhook_server.errors import BatchRejected, Reason
from exhook_server.policy import AbortCriterion, Policy, Ramp, Window, parse_fields, window_opens_at

BERLIN = ZoneInfo("Europe/Berlin")


def ms(*parts: int, tz: datetime.tzinfo = datetime.UTC) -> int:
    return int(datetime.datetime(*parts, tzinfo=tz).timestamp() * 1000)  # type: ignore[misc]


FULL: dict[str, Any] = {
    "max_per_minute": 600,
    "ramp": {"start_per_minute": 60, "factor": 2, "every_s": 300},
    "max_in_flight": 50,
    "abort": [{"outcome": "failed", "ratio": 0.1, "min_finished": 100}],
    "start_at": "2026-11-28T18:00:00Z",
    "windows": [{"cron": "0  2 * * *", "duration_s": 7200, "tz": "Europe/Berlin"}],
    "paused": True,
    "priority": "high",
}


def test_every_field_is_read_and_its_stored_form_reads_back_the_same() -> None:
    policy = parse_fields({"request_id": "task_ota_1", **FULL})
    assert policy == Policy(
        600,
        Ramp(60, 2.0, 300),
        50,
        (AbortCriterion("failed", 0.1, 100),),
        ms(2026, 11, 28, 18),
        (Window("0 2 * * *", 7200, "Europe/Berlin"),),
        True,
        "high",
    )
    assert Policy.decode(policy.encode()) == policy
    assert policy.as_doc()["start_at"] == ms(2026, 11, 28, 18)  # echoed as epoch ms


def test_a_message_with_no_field_clears() -> None:
    assert parse_fields({"request_id": "task_ota_1"}) is None
    assert parse_fields({"request_id": "task_ota_1", "correlation_id": "c-1"}) is None


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"max_per_minute": 0}, "max_per_minute"),
        ({"max_per_minute": 1.5}, "max_per_minute"),
        ({"max_per_minute": True}, "max_per_minute"),
        ({"max_in_flight": "10"}, "max_in_flight"),
        ({"ramp": {"start_per_minute": 1, "factor": 2, "every_s": 60}}, "ramp"),  # no max_per_minute
        ({"max_per_minute": 60, "ramp": {"start_per_minute": 61, "factor": 2, "every_s": 60}}, "ramp"),
        ({"max_per_minute": 60, "ramp": {"start_per_minute": 6, "factor": 1, "every_s": 60}}, "ramp"),
        ({"max_per_minute": 60, "ramp": {"start_per_minute": 6, "factor": 2}}, "ramp"),
        ({"abort": []}, "abort"),
        ({"abort": [{"outcome": "delivered", "ratio": 0.1, "min_finished": 1}]}, "abort"),
        ({"abort": [{"outcome": "failed", "ratio": 0, "min_finished": 1}]}, "abort"),
        ({"abort": [{"outcome": "failed", "ratio": 1.5, "min_finished": 1}]}, "abort"),
        ({"abort": [{"outcome": "failed", "ratio": float("nan"), "min_finished": 1}]}, "abort"),
        ({"start_at": "tomorrow"}, "start_at"),
        ({"start_at": "2026-11-28T18:00:00"}, "start_at"),  # no offset
        ({"windows": [{"cron": "0 2 * * * *", "duration_s": 60, "tz": "UTC"}]}, "windows"),  # 6 fields
        ({"windows": [{"cron": "0 25 * * *", "duration_s": 60, "tz": "UTC"}]}, "windows"),
        ({"windows": [{"cron": "0 2 * * *", "duration_s": 0, "tz": "UTC"}]}, "windows"),
        ({"windows": [{"cron": "0 2 * * *", "duration_s": 60, "tz": "Mars/Olympus"}]}, "windows"),
        ({"windows": [{"cron": "0 2 * * *", "duration_s": 60, "tz": "../../etc/passwd"}]}, "windows"),
        ({"paused": "yes"}, "paused"),
        ({"priority": "urgent"}, "priority"),
        ({"max_per_minte": 60}, "max_per_minte"),  # a typo is refused, never ignored
    ],
)
def test_a_wrong_field_is_refused_bad_policy_naming_it(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(BatchRejected) as caught:
        parse_fields({"request_id": "task_ota_1", **fields})
    assert (caught.value.reason, caught.value.field) == (Reason.BAD_POLICY, field)


def test_the_policy_topic_carries_policy_messages_with_their_request_id_checked() -> None:
    cfg = Config()
    parser = BatchParser(cfg)
    assert parser.classify("$SDV-FANOUT/policy") is Kind.POLICY
    parsed = parser.parse(Kind.POLICY, cfg.policy_topic, b'{"request_id": "task_ota_1", "paused": true}')
    assert isinstance(parsed, PolicyDoc) and parsed.request_id == "task_ota_1"
    with pytest.raises(BatchRejected) as caught:
        parser.parse(Kind.POLICY, cfg.policy_topic, b'{"request_id": "a/b", "paused": true}')
    assert caught.value.reason is Reason.BAD_REQUEST_ID
    with pytest.raises(BatchRejected) as caught:
        parser.parse(Kind.POLICY, cfg.policy_topic, b'{"paused": true}')
    assert caught.value.reason is Reason.MISSING_FIELD


def test_start_at_and_paused_gate_the_request() -> None:
    now = ms(2026, 11, 28, 12)
    assert Policy().opens_at(now) == now
    assert Policy(start_at_ms=now + 5000).opens_at(now) == now + 5000
    assert Policy(start_at_ms=now - 5000).opens_at(now) == now
    assert Policy(paused=True).opens_at(now) is None


def test_a_window_is_open_for_its_duration_from_each_start_in_its_zone() -> None:
    nightly = Window("0 2 * * *", 7200, "Europe/Berlin")  # 02:00-04:00 Berlin time
    two_am = ms(2026, 11, 28, 2, tz=BERLIN)  # CET: 01:00 UTC
    assert window_opens_at(nightly, two_am) == two_am  # opens at its start
    assert window_opens_at(nightly, two_am + 7_199_999) == two_am + 7_199_999
    assert window_opens_at(nightly, two_am + 7_200_000) == ms(2026, 11, 29, 2, tz=BERLIN)  # closed at its end
    assert window_opens_at(nightly, two_am - 1) == two_am
    utc = Window("0 2 * * *", 60, "UTC")
    assert window_opens_at(utc, two_am) == ms(2026, 11, 28, 2)  # the same cron in UTC: an hour later


def test_windows_follow_the_time_zone_database_across_dst() -> None:
    """Berlin goes from CET (+1) to CEST (+2) on 2026-03-29: a 02:00 window's starts are 01:00 UTC
    before and 00:00 UTC after; 02:30 does not exist that night, and the window starts when the
    zone database's clock reaches it (03:00 CEST), as croniter computes it."""
    nightly = Window("0 2 * * *", 3600, "Europe/Berlin")
    assert window_opens_at(nightly, ms(2026, 3, 27, 12)) == ms(2026, 3, 28, 1)
    assert window_opens_at(nightly, ms(2026, 3, 30, 12)) == ms(2026, 3, 31, 0)
    half_past = Window("30 2 * * *", 600, "Europe/Berlin")
    assert window_opens_at(half_past, ms(2026, 3, 28, 12)) == ms(2026, 3, 29, 1)  # 03:00 CEST
    autumn = Window("0 12 * * *", 60, "Europe/Berlin")  # 2026-10-25: CEST → CET
    assert window_opens_at(autumn, ms(2026, 10, 24, 12)) == ms(2026, 10, 25, 11)


def test_the_earliest_of_several_windows_opens_the_gate() -> None:
    policy = Policy(windows=(Window("0 22 * * *", 60, "UTC"), Window("0 6 * * *", 60, "UTC")))
    assert policy.opens_at(ms(2026, 11, 28, 12)) == ms(2026, 11, 28, 22)
    assert policy.opens_at(ms(2026, 11, 28, 23)) == ms(2026, 11, 29, 6)
    late = Policy(start_at_ms=ms(2026, 11, 30, 0), windows=(Window("0 6 * * *", 60, "UTC"),))
    assert late.opens_at(ms(2026, 11, 28, 12)) == ms(2026, 11, 30, 6)
