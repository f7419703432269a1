"""Ingestion through the real hook: both formats, dedup, replacement, early triggers, rejections."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from exhook_server._proto import exhook_v3_pb2 as pb
from testkit.harness import ExHookClient, InProcessServer, StepClock

STOP = pb.ValuedResponse.STOP_AND_RETURN


def rejected_count(reason: str) -> float:
    return REGISTRY.get_sample_value("sdv_fanout_batches_rejected_total", {"reason": reason}) or 0.0


def test_shared_payload_is_stored_once(server: InProcessServer, client: ExHookClient) -> None:
    """N batches carrying the same data produce one blob and N x VINs rows."""
    for n in range(5):
        client.batch([f"VIN{n}A", f"VIN{n}B"], f"task_ota_{n}", "same payload")
    stats = server.store.stats()
    assert (stats.rows, stats.blobs) == (10, 1)
    assert stats.dedup_ratio == pytest.approx(10.0)


def test_newer_batch_replaces_row_of_same_vin_and_request(server: InProcessServer, client: ExHookClient) -> None:
    """A second batch for the same (VIN, request_id) replaces the row; the expiry index follows."""
    client.batch(["VIN1", "VIN2"], "task_cfg_1", "old")
    client.batch(["VIN1"], "task_cfg_1", "new")
    [row] = server.store.pending("VIN1")
    assert server.store.blob(row.sha1) == b"new"
    assert server.store.blob(server.store.pending("VIN2")[0].sha1) == b"old"
    with server.store.read() as txn:
        assert txn.stat(server.store.tables.expiry)["entries"] == 2


def test_pending_rows_come_oldest_first(server: InProcessServer, client: ExHookClient) -> None:
    """A vehicle's queue is in arrival order, not request-id order."""
    for rid in ("task_z_1", "task_a_1", "task_m_1"):
        client.batch(["VIN1"], rid, rid)
    assert [r.request_id for r in server.store.pending("VIN1")] == ["task_z_1", "task_a_1", "task_m_1"]


def test_base64_data_is_decoded(server: InProcessServer, client: ExHookClient) -> None:
    """`data_encoding: base64` delivers the decoded bytes, binary included."""
    blob = bytes(range(256))
    client.batch(["VIN1"], "task_bin_1", blob)
    [row] = server.store.pending("VIN1")
    assert row.sha1 == hashlib.sha1(blob).digest()
    assert server.store.blob(row.sha1) == blob


def test_duplicate_vins_are_folded(server: InProcessServer, client: ExHookClient) -> None:
    """A VIN listed twice in one batch gets one row."""
    client.batch(["VIN1", "VIN1", "VIN2"], "task_a_1", "x")
    assert server.store.stats().rows == 2


def test_plugin_format_data_then_trigger(server: InProcessServer, client: ExHookClient) -> None:
    """EMQX plugin 0.4.x: raw data on $SDV-FANOUT/data/<id>, then the trigger, gives the rows."""
    assert client.publish("$SDV-FANOUT/data/1718000000000", b"\x00raw\xffbytes").type == STOP
    reply = client.publish(
        "$SDV-FANOUT/trigger",
        json.dumps({"ids": ["VIN1", "VIN2"], "request_id": "task_ota_7", "data_id": "1718000000000"}).encode(),
    )
    assert reply.type == STOP and reply.message.headers["allow_publish"] == "false"
    [row] = server.store.pending("VIN2")
    assert server.store.blob(row.sha1) == b"\x00raw\xffbytes"


def test_trigger_before_data_is_parked_then_completed(server: InProcessServer, client: ExHookClient) -> None:
    """A trigger that overtakes its data is stored durably and becomes rows when the data arrives."""
    trigger = {"ids": ["VIN1"], "request_id": "task_ota_8", "data_id": "d-42"}
    client.publish("$SDV-FANOUT/trigger", json.dumps(trigger).encode())
    assert server.store.pending("VIN1") == []
    assert server.store.early_count() == 1
    client.publish("$SDV-FANOUT/data/d-42", b"late data")
    assert [r.request_id for r in server.store.pending("VIN1")] == ["task_ota_8"]
    assert server.store.early_count() == 0


def test_orphan_trigger_expires_with_reason(make_server: Any) -> None:
    """A parked trigger whose data never comes is dropped once early_ttl_s has passed (not
    before), with a logged reason. The server's clock is stepped: no race with the wall clock."""
    clock = StepClock()
    srv = make_server(early_ttl_s=60, early_sweep_interval_s=3600, clock=clock)
    c = ExHookClient(srv.port)
    c.publish(
        "$SDV-FANOUT/trigger", json.dumps({"ids": ["VIN1"], "request_id": "task_a_1", "data_id": "gone"}).encode()
    )
    assert srv.store.early_count() == 1
    clock.advance(59.999)
    assert srv.run(srv.server.parked.sweep()) == []
    assert srv.store.early_count() == 1
    clock.advance(0.001)
    with capture_logs() as logs:
        expired = srv.run(srv.server.parked.sweep())
    assert [(e.data_id, e.request_id) for e in expired] == [("gone", "task_a_1")]
    assert srv.store.early_count() == 0
    assert any(e["event"] == "early_trigger_expired" and e["reason"] == "data_never_arrived" for e in logs)
    c.close()


def test_early_triggers_are_bounded(make_server: Any) -> None:
    """Past early_max_count, a trigger without data is rejected with early_triggers_full."""
    srv = make_server(early_max_count=2)
    c = ExHookClient(srv.port)
    before = rejected_count("early_triggers_full")
    for n in range(3):
        c.publish(
            "$SDV-FANOUT/trigger",
            json.dumps({"ids": ["VIN1"], "request_id": f"task_a_{n}", "data_id": f"d{n}"}).encode(),
        )
    assert srv.store.early_count() == 2
    assert rejected_count("early_triggers_full") == before + 1
    c.close()


def test_other_topics_are_ignored(server: InProcessServer, client: ExHookClient) -> None:
    """A publish outside the batch topics is answered IGNORE and stores nothing."""
    assert client.publish("ecp/VIN1/online", b"{}").type == pb.ValuedResponse.IGNORE
    assert client.publish("$SDV-FANOUTX", b"{}").type == pb.ValuedResponse.IGNORE
    assert server.store.stats().rows == 0


def test_v2_service_ingests_the_same_way(server: InProcessServer) -> None:
    """An EMQX 5.8 broker (emqx.exhook.v2) gets the same answer and the same rows."""
    c = ExHookClient(server.port, package="v2")
    assert c.batch(["VIN9"], "task_a_1", "v2").type == STOP
    assert len(server.store.pending("VIN9")) == 1
    c.close()


GOOD = {"ids": ["VIN1"], "request_id": "task_a_1", "data": "x"}

REJECTIONS = [
    ("invalid_json", "$SDV-FANOUT", b"{not json"),
    ("invalid_json", "$SDV-FANOUT", b"\xff\xfe"),
    ("wrong_type", "$SDV-FANOUT", b"[1, 2]"),
    ("missing_field", "$SDV-FANOUT", json.dumps({"ids": ["VIN1"], "data": "x"}).encode()),
    ("missing_field", "$SDV-FANOUT", json.dumps({"request_id": "task_a_1", "data": "x"}).encode()),
    ("missing_field", "$SDV-FANOUT", json.dumps({"ids": ["VIN1"], "request_id": "task_a_1"}).encode()),
    ("wrong_type", "$SDV-FANOUT", json.dumps({**GOOD, "ids": "VIN1"}).encode()),
    ("wrong_type", "$SDV-FANOUT", json.dumps({**GOOD, "ids": ["VIN1", 7]}).encode()),
    ("wrong_type", "$SDV-FANOUT", json.dumps({**GOOD, "request_id": 5}).encode()),
    ("wrong_type", "$SDV-FANOUT", json.dumps({**GOOD, "data": {"a": 1}}).encode()),
    ("empty_ids", "$SDV-FANOUT", json.dumps({**GOOD, "ids": []}).encode()),
    ("bad_vin", "$SDV-FANOUT", json.dumps({**GOOD, "ids": ["VIN1", "a/b"]}).encode()),
    ("bad_vin", "$SDV-FANOUT", json.dumps({**GOOD, "ids": ["+"]}).encode()),
    ("bad_vin", "$SDV-FANOUT", json.dumps({**GOOD, "ids": ["#"]}).encode()),
    ("bad_vin", "$SDV-FANOUT", json.dumps({**GOOD, "ids": ["V\u0000N"]}).encode()),
    ("bad_vin", "$SDV-FANOUT", json.dumps({**GOOD, "ids": ["V" * 65]}).encode()),
    ("bad_vin", "$SDV-FANOUT", json.dumps({**GOOD, "ids": [""]}).encode()),
    ("bad_request_id", "$SDV-FANOUT", json.dumps({**GOOD, "request_id": "task/1"}).encode()),
    ("bad_request_id", "$SDV-FANOUT", json.dumps({**GOOD, "request_id": "task_+"}).encode()),
    ("bad_request_id", "$SDV-FANOUT", json.dumps({**GOOD, "request_id": ""}).encode()),
    ("bad_request_id", "$SDV-FANOUT", json.dumps({**GOOD, "request_id": "a\u0000b"}).encode()),
    ("bad_request_id", "$SDV-FANOUT", json.dumps({**GOOD, "request_id": "x" * 129}).encode()),
    # A C1 control: accepted once, its delivery topic made mosquitto drop the shared delivery link.
    ("bad_request_id", "$SDV-FANOUT", json.dumps({**GOOD, "request_id": "task\u0085_1"}).encode()),
    ("bad_request_id", "$SDV-FANOUT", json.dumps({**GOOD, "request_id": "task\uffff_1"}).encode()),
    ("too_many_ids", "$SDV-FANOUT", json.dumps({**GOOD, "ids": [f"V{i}" for i in range(10_001)]}).encode()),
    ("payload_too_large", "$SDV-FANOUT", json.dumps({**GOOD, "data": "x" * (4 << 20)}).encode()),
    ("bad_data_encoding", "$SDV-FANOUT", json.dumps({**GOOD, "data": "!!", "data_encoding": "base64"}).encode()),
    ("bad_data_encoding", "$SDV-FANOUT", json.dumps({**GOOD, "data_encoding": "gzip"}).encode()),
    ("bad_data_id", "$SDV-FANOUT/data/a/b", b"payload"),
    ("bad_data_id", "$SDV-FANOUT/data", b"payload"),
    (
        "bad_data_id",
        "$SDV-FANOUT/trigger",
        json.dumps({"ids": ["VIN1"], "request_id": "t_1", "data_id": "a b"}).encode(),
    ),
    ("wrong_type", "$SDV-FANOUT/trigger", json.dumps({"ids": ["VIN1"], "request_id": "t_1", "data_id": 3}).encode()),
    ("missing_field", "$SDV-FANOUT/trigger", json.dumps({"ids": ["VIN1"], "request_id": "t_1"}).encode()),
    # Lifecycle fields (issue 13).
    ("expired", "$SDV-FANOUT", json.dumps({**GOOD, "expires_at": 1_000}).encode()),
    ("expired", "$SDV-FANOUT", json.dumps({**GOOD, "expires_at": "2001-09-09T01:46:40Z"}).encode()),
    (
        "expired",
        "$SDV-FANOUT/trigger",
        json.dumps({"ids": ["VIN1"], "request_id": "t_1", "data_id": "d1", "expires_at": 5}).encode(),
    ),
    ("bad_expires_at", "$SDV-FANOUT", json.dumps({**GOOD, "expires_at": "tomorrow"}).encode()),
    ("bad_expires_at", "$SDV-FANOUT", json.dumps({**GOOD, "expires_at": "2099-01-01T00:00:00"}).encode()),
    ("bad_expires_at", "$SDV-FANOUT", json.dumps({**GOOD, "expires_at": 4.5e12}).encode()),
    ("bad_expires_at", "$SDV-FANOUT", json.dumps({**GOOD, "expires_at": -1}).encode()),
    ("bad_expires_at", "$SDV-FANOUT", json.dumps({**GOOD, "expires_at": 10**16}).encode()),
    ("wrong_type", "$SDV-FANOUT", json.dumps({**GOOD, "await_response": "yes"}).encode()),
    ("bad_priority", "$SDV-FANOUT", json.dumps({**GOOD, "priority": "HIGH"}).encode()),
    (
        "bad_priority",
        "$SDV-FANOUT/trigger",
        json.dumps({"ids": ["V1"], "request_id": "t", "data_id": "d", "priority": ""}).encode(),
    ),
    # Cancels are validated like batches.
    ("missing_field", "$SDV-FANOUT/cancel", json.dumps({"ids": ["VIN1"]}).encode()),
    ("bad_request_id", "$SDV-FANOUT/cancel", json.dumps({"request_id": "a/b"}).encode()),
    ("empty_ids", "$SDV-FANOUT/cancel", json.dumps({"request_id": "task_a_1", "ids": []}).encode()),
    ("bad_vin", "$SDV-FANOUT/cancel", json.dumps({"request_id": "task_a_1", "ids": ["V+"]}).encode()),
    ("invalid_json", "$SDV-FANOUT/cancel", b"cancel it"),
]


@pytest.mark.parametrize(("reason", "topic", "payload"), REJECTIONS)
def test_bad_batch_is_rejected_with_reason(
    server: InProcessServer, client: ExHookClient, reason: str, topic: str, payload: bytes
) -> None:
    """Each malformed batch gets its reason code in the log and the counter, writes nothing, and is not routed."""
    before = rejected_count(reason)
    with capture_logs() as logs:
        reply = client.publish(topic, payload)
    assert reply.type == STOP
    assert reply.message.headers["allow_publish"] == "false"
    assert reply.message.payload == payload and reply.message.topic == topic
    assert [e["reason"] for e in logs if e["event"] == "batch_rejected"] == [reason]
    assert rejected_count(reason) == before + 1
    stats = server.store.stats()
    assert (stats.rows, stats.blobs, stats.aliases, stats.early_triggers) == (0, 0, 0, 0)


def test_rejection_does_not_disturb_concurrent_batches(server: InProcessServer) -> None:
    """Good and bad batches interleaved from many channels: every good one is stored whole."""
    from concurrent.futures import ThreadPoolExecutor

    def send(n: int) -> None:
        c = ExHookClient(server.port)
        if n % 3 == 0:
            c.publish("$SDV-FANOUT", json.dumps({**GOOD, "ids": ["ok", "bad/vin"]}).encode())
        else:
            c.batch([f"VIN{n}", f"VIN{n}X"], f"task_a_{n}", f"data {n}")
        c.close()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(send, range(60)))
    good = [n for n in range(60) if n % 3]
    assert server.store.stats().rows == 2 * len(good)
    for n in good:
        [row] = server.store.pending(f"VIN{n}X")
        assert server.store.blob(row.sha1) == f"data {n}".encode()
    assert server.store.pending("ok") == []


def test_publisher_allowlist(make_server: Any) -> None:
    """With publisher_allowlist set, only listed clientids or usernames may send batches."""
    srv = make_server(publisher_allowlist=("sdv-platform",))
    c = ExHookClient(srv.port)
    c.batch(["VIN1"], "task_a_1", "ok")  # clientid sdv-platform
    c.publish("$SDV-FANOUT", json.dumps({**GOOD, "ids": ["VIN2"]}).encode(), sender="intruder", username="x")
    c.publish("$SDV-FANOUT", json.dumps({**GOOD, "ids": ["VIN3"]}).encode(), sender="p2", username="sdv-platform")
    assert [bool(srv.store.pending(v)) for v in ("VIN1", "VIN2", "VIN3")] == [True, False, True]
    c.close()


def test_custom_vin_pattern(make_server: Any) -> None:
    """vin_pattern narrows what a VIN may be; topic-breaking characters stay forbidden anyway."""
    srv = make_server(vin_pattern=r"[A-HJ-NPR-Z0-9]{17}|.*")
    c = ExHookClient(srv.port)
    c.publish("$SDV-FANOUT", json.dumps({**GOOD, "ids": ["a/b"]}).encode())
    c.batch(["WDB1234567890ABCD"], "task_a_1", "x")
    assert srv.store.stats().rows == 1
    c.close()
