"""Lifecycle fields of a batch and the cancel message, as the parser reads them."""

from __future__ import annotations

import json

import pytest

from exhook_server.batch import Batch, BatchParser, Cancel, Kind, Trigger
from exhook_server.config import Config
from exhook_server.errors import BatchRejected, Reason

NOW = 1_795_000_000_000  # 2026-11-18


def parse(kind: Kind, doc: dict[str, object], cfg: Config | None = None) -> object:
    parser = BatchParser(cfg or Config(), clock=lambda: NOW)
    topic = {Kind.BATCH: "$SDV-FANOUT", Kind.TRIGGER: "$SDV-FANOUT/trigger", Kind.CANCEL: "$SDV-FANOUT/cancel"}[kind]
    return parser.parse(kind, topic, json.dumps(doc).encode())


BASE = {"ids": ["V1"], "request_id": "task_a_1", "data": "x"}


@pytest.mark.parametrize(
    ("value", "ms"),
    [
        (NOW + 1, NOW + 1),
        ("2026-11-23T22:00:00Z", 1_795_471_200_000),
        ("2026-11-23T23:00:00.250+01:00", 1_795_471_200_250),
        ("2026-11-23t22:00:00z", 1_795_471_200_000),
    ],
)
def test_expires_at_takes_epoch_ms_and_rfc3339_with_offset(value: object, ms: int) -> None:
    batch = parse(Kind.BATCH, {**BASE, "expires_at": value})
    assert isinstance(batch, Batch) and batch.life.expires_ms == ms


def test_a_batch_past_its_expiry_is_rejected_expired() -> None:
    with pytest.raises(BatchRejected) as exc:
        parse(Kind.BATCH, {**BASE, "expires_at": NOW})
    assert exc.value.reason is Reason.EXPIRED


def test_await_response_defaults_to_the_setting_and_needs_a_response_topic() -> None:
    assert not parse(Kind.BATCH, BASE).life.await_response  # type: ignore[attr-defined]
    assert parse(Kind.BATCH, BASE, Config(await_response=True)).life.await_response  # type: ignore[attr-defined]
    assert not parse(Kind.BATCH, {**BASE, "await_response": False}, Config(await_response=True)).life.flags  # type: ignore[attr-defined]
    trigger = parse(Kind.TRIGGER, {"ids": ["V1"], "request_id": "t_1", "data_id": "d", "await_response": True})
    assert isinstance(trigger, Trigger) and trigger.life.await_response
    with pytest.raises(BatchRejected) as exc:
        parse(Kind.BATCH, {**BASE, "await_response": True}, Config(response_topic_prefix=""))
    assert exc.value.reason is Reason.RESPONSES_OFF


def test_a_cancel_names_a_request_and_optionally_vehicles() -> None:
    every = parse(Kind.CANCEL, {"request_id": "task_a_1"})
    assert every == Cancel("task_a_1", None)
    some = parse(Kind.CANCEL, {"request_id": "task_a_1", "ids": ["V2", "V1", "V2"], "correlation_id": "c"})
    assert isinstance(some, Cancel) and some.vins == ("V2", "V1") and some.tags.correlation_id == "c"


@pytest.mark.parametrize(
    ("kind", "doc"),
    [
        (Kind.CANCEL, {"request_id": "task_a_1", "ids": None}),
        (Kind.CANCEL, {"request_id": "task_a_1", "ids": "V1"}),
        (Kind.CANCEL, {"request_id": "task_a_1", "ids": {"V1": 1}}),
        (Kind.BATCH, {**BASE, "ids": None}),
        (Kind.TRIGGER, {"ids": None, "request_id": "t_1", "data_id": "d"}),
    ],
)
def test_ids_present_must_be_an_array_on_every_control_topic(kind: Kind, doc: dict[str, object]) -> None:
    """`ids` is absent (a cancel of every vehicle) or an array: `null` is wrong_type, never "every vehicle"."""
    with pytest.raises(BatchRejected) as exc:
        parse(kind, doc)
    assert exc.value.reason is Reason.WRONG_TYPE


def test_a_cancel_with_empty_ids_is_refused_not_widened() -> None:
    with pytest.raises(BatchRejected) as exc:
        parse(Kind.CANCEL, {"request_id": "task_a_1", "ids": []})
    assert exc.value.reason is Reason.EMPTY_IDS
