"""A `rejected` receipt says what is wrong (`detail`) and, where one VIN or one field of the batch
is at fault, which (`vin`, `field`): the platform finds the one bad VIN of 10,000 without our
logs. Every part is bounded. Real Ingestor on a real LMDB store; the status link records."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from exhook_server.batch import Kind
from exhook_server.config import Config
from exhook_server.ingest import MAX_DETAIL_CHARS, Ingestor
from exhook_server.status import StatusPublisher
from storage.lmdb.store import Store
from storage.lmdb.writer import GroupCommitter
from storage.lmdb.writes import LmdbWrites

TOPIC = "$SDV-FANOUT"


class Heard:
    """The status link: every status message, decoded."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def publish_status(self, topic: str, payload: bytes, on_puback: Callable[[int], None]) -> bool:
        self.events.append(json.loads(payload))
        on_puback(0)
        return True


def rejected(tmp_path: Path, payload: bytes, kind: Kind = Kind.BATCH, **settings: Any) -> dict[str, Any]:
    """The one `rejected` receipt `payload` gets."""
    cfg = Config(data_dir=str(tmp_path / "lmdb"), **settings)
    heard = Heard()

    async def go() -> None:
        store = Store(cfg.data_dir)
        committer = GroupCommitter(store)
        ingestor = Ingestor(cfg, LmdbWrites(store, committer, 4.0), status=StatusPublisher(cfg, lambda: heard))
        try:
            topic = cfg.trigger_topic if kind is Kind.TRIGGER else TOPIC
            assert not await ingestor.ingest(kind, topic, payload, "sdv-platform", "platform")
        finally:
            await ingestor.stop()
            await asyncio.to_thread(committer.close)
            store.close()

    asyncio.run(go())
    [receipt] = [e for e in heard.events if e["event"] == "rejected"]
    return receipt


def batch(**doc: Any) -> bytes:
    return json.dumps({"ids": ["VIN1"], "request_id": "task_r_1", "data": "x", **doc}).encode()


def test_the_one_bad_vin_of_ten_thousand_is_named(tmp_path: Path) -> None:
    vins = [f"VIN{i:05d}" for i in range(10_000)]
    vins[7_321] = "VIN 07321"  # a space: not a VIN
    receipt = rejected(tmp_path, batch(ids=vins))
    assert (receipt["reason"], receipt["vin"], receipt["field"]) == ("bad_vin", "VIN 07321", "ids")
    assert receipt["request_id"] == "task_r_1" and "vin_pattern" in receipt["detail"]


@pytest.mark.parametrize(
    ("doc", "reason", "field"),
    [
        ({"request_id": 7}, "wrong_type", "request_id"),
        ({"data": None}, "wrong_type", "data"),
        ({"ids": []}, "empty_ids", "ids"),
        ({"ids": ["VIN1", 5]}, "wrong_type", "ids"),
        ({"expires_at": "tomorrow"}, "bad_expires_at", "expires_at"),
        ({"expires_at": 1}, "expired", "expires_at"),
        ({"data": "%%%", "data_encoding": "base64"}, "bad_data_encoding", "data"),
        ({"data_encoding": "rot13"}, "bad_data_encoding", "data_encoding"),
        ({"batch_id": ""}, "bad_batch_id", "batch_id"),
        ({"await_response": "yes"}, "wrong_type", "await_response"),
        ({"priority": "urgent"}, "bad_priority", "priority"),
        ({"priority": 1}, "wrong_type", "priority"),
    ],
)
def test_the_field_at_fault_is_named(tmp_path: Path, doc: dict[str, Any], reason: str, field: str) -> None:
    receipt = rejected(tmp_path, batch(**doc))
    assert (receipt["reason"], receipt["field"]) == (reason, field)
    assert receipt["detail"] and "vin" not in receipt


def test_a_missing_field_is_named(tmp_path: Path) -> None:
    receipt = rejected(tmp_path, json.dumps({"ids": ["VIN1"], "request_id": "task_r_2"}).encode())
    assert (receipt["reason"], receipt["field"], receipt["detail"]) == ("missing_field", "data", "data is missing")


def test_a_problem_of_the_whole_message_has_a_detail_and_no_field(tmp_path: Path) -> None:
    receipt = rejected(tmp_path, b"{not json")
    assert receipt["reason"] == "invalid_json" and receipt["detail"]
    assert "field" not in receipt and "vin" not in receipt and receipt["request_id"] is None


def test_every_part_is_bounded(tmp_path: Path) -> None:
    """A long VIN of control characters is cut and escaped; the detail has a bound."""
    receipt = rejected(tmp_path, batch(ids=["\n" * 5_000]), vin_pattern=r"[\s\S]{1,10000}")
    assert receipt["reason"] == "bad_vin" and len(receipt["vin"]) <= 80 and "\n" not in receipt["vin"]
    receipt = rejected(tmp_path, batch(data="x" * 100), max_payload_bytes=60, max_ingest_inflight_bytes=60)
    assert receipt["reason"] == "payload_too_large" and len(receipt["detail"]) <= MAX_DETAIL_CHARS
