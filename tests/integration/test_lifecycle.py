"""Commands that behave (issue 13): cancel, expiry, bounded backlogs, attempt limits, answers.

Real mosquitto, real server, real LMDB, real MQTT 5 vehicles whose hooks the EMQX-faithful
simulator plays, and a platform subscribed to the status topic.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from exhook_server import metrics
from storage.lmdb import outcomes
from storage.lmdb.batches import sha1_of
from testkit.harness import StepClock, poll
from tests.integration.test_delivery_e2e import Rig, make_rig
from tests.integration.test_status_topic import Platform


def counts(rig: Rig, request_id: str, data: bytes) -> dict[str, int]:
    """The generation's counts, without the zeros."""
    found = [g for g in rig.srv.generations(request_id) if g.sha1 == sha1_of(data)]
    assert found, f"no generation {request_id}"
    return {k: v for k, v in found[0].counts.items() if v}


def outcome_of(rig: Rig, vin: str, request_id: str) -> outcomes.OutcomeRecord | None:
    found = [o for o in rig.srv.vehicle_outcomes(vin) if o.request_id == request_id]
    return found[0] if found else None


def rids(rig: Rig, v: Any) -> list[str]:
    return rig.rids(v)


def cancel(rig: Rig, request_id: str, ids: list[str] | None = None, **extra: Any) -> Any:
    doc: dict[str, Any] = {"request_id": request_id, **extra}
    if ids is not None:
        doc["ids"] = ids
    return rig.emqx.publish("$SDV-FANOUT/cancel", json.dumps(doc).encode())


@pytest.fixture
def store_kind(each_store: str) -> str:
    """Every test here runs on both stores."""
    return each_store


@pytest.fixture
def event_mode(each_event_mode: str) -> str:
    """The tests here run with vehicle events as hook calls and over MQTT, but for `hooks_only` ones."""
    return each_event_mode


#: A test that no heartbeat, answer or PUBACK decides (or whose subject is the hook itself) runs
#: in the hook mode only: over MQTT it would repeat what the hook mode tests.
hooks_only = pytest.mark.parametrize("each_event_mode", ["hooks"])


@pytest.fixture
def make(tmp_path: Path, make_server: Any) -> Iterator[Any]:
    """A rig with these settings (one per test) and a platform listening to the status topic."""
    made: list[tuple[Iterator[Rig], Platform]] = []

    def build(**overrides: Any) -> tuple[Rig, Platform]:
        gen = make_rig(tmp_path, make_server, progress_interval_s=0.2, **overrides)
        rig = next(gen)
        platform = Platform(rig.broker.port)
        made.append((gen, platform))
        return rig, platform

    yield build
    for gen, platform in made:
        platform.close()
        with pytest.raises(StopIteration):
            next(gen)


# -- cancel -------------------------------------------------------------------------------------


def test_cancel_of_some_vehicles_with_one_in_flight(make: Any) -> None:
    """The named VINs' pending rows end cancelled; the one already out is reported in_flight and
    ends as what the vehicle did with it (its PUBACK: delivered); the others stay pending."""
    rig, platform = make()
    v1 = rig.online("V1")
    v1.auto_ack = False
    rig.emqx.publish_batch(["V1", "V2", "V3"], "task_ota_1", "fw")
    v1.wait_for(1)
    cancel(rig, "task_ota_1", ["V1", "V2"], correlation_id="stop-1")
    [event] = platform.wait(event="cancelled", request_id="task_ota_1")
    assert (event["cancelled"], event["in_flight"], event["correlation_id"]) == (2, 1, "stop-1")
    assert counts(rig, "task_ota_1", b"fw") == {"total": 3, "pending": 1, "cancelled": 2}
    assert v1.ack_pending() == 1
    poll(lambda: counts(rig, "task_ota_1", b"fw") == {"total": 3, "pending": 1, "cancelled": 1, "delivered": 1})
    assert [r.request_id for r in rig.srv.pending("V3")] == ["task_ota_1"]
    rig.online("V2")  # nothing comes for it
    v3 = rig.online("V3")
    v3.wait_for(1)
    assert rig.emqx.vehicles[1].received == []


def test_a_delivery_pubacked_just_before_the_cancel_is_delivered_not_cancelled(make: Any) -> None:
    """PUBACKed, its delete waiting for a lazy commit (a long ack_commit_delay_ms): the delete joins
    the cancel's transaction, ahead of it, so the pair is delivered and the cancel takes the rest.
    (Another server process's waiting delete cannot join: the cancel counts that one in_flight and
    the delete amends it, see test_dispatch_rules.)"""
    rig, platform = make(ack_commit_delay_ms=3_000)
    v1 = rig.online("V1")
    rig.emqx.publish_batch(["V1", "V2"], "task_ota_3", "fw3")
    v1.wait_for(1)
    if rig.srv.server.store is None:  # PostgreSQL: a PUBACK's delete commits within its event
        poll(lambda: outcome_of(rig, "V1", "task_ota_3") is not None)
    else:
        rows = rig.srv.server.dispatcher.workers
        poll(lambda: any(w._rows.acking("V1", "task_ota_3", sha1_of(b"fw3")) for w in rows.values()))
    cancel(rig, "task_ota_3")
    [event] = platform.wait(event="cancelled", request_id="task_ota_3")
    assert (event["cancelled"], event["in_flight"]) == (1, 0)
    assert counts(rig, "task_ota_3", b"fw3") == {"total": 2, "cancelled": 1, "delivered": 1}


@hooks_only
def test_cancel_of_every_vehicle_in_chunks_stops_deliveries_at_once(make: Any) -> None:
    """Without ids every pending row of the request ends cancelled, over several bounded
    transactions; from the answer on, none of them is sent, and other requests go on."""
    rig, platform = make(max_ids_per_batch=5, max_rows_per_commit=5)
    fleet = [f"V{n:02}" for n in range(23)]
    for part in range(0, len(fleet), 5):
        rig.emqx.publish_batch(fleet[part : part + 5], "task_ota_2", "fw2")
    rig.emqx.publish_batch(fleet[:5], "task_cfg_2", "cfg")
    cancel(rig, "task_ota_2")
    vehicles = [rig.online(vin) for vin in fleet[:5]]
    [event] = platform.wait(event="cancelled", request_id="task_ota_2")
    assert (event["cancelled"], event["in_flight"]) == (23, 0)
    for v in vehicles:
        v.wait_for(1)
    assert {rid for v in vehicles for rid in rids(rig, v)} == {"task_cfg_2"}
    assert counts(rig, "task_ota_2", b"fw2") == {"total": 23, "cancelled": 23}
    assert rig.srv.cancels_in_progress() == []


@hooks_only
def test_a_cancel_racing_batches_of_the_same_request_takes_each_batch_whole_or_not_at_all(make: Any) -> None:
    """Cancels of every vehicle and new batches of the request, from two threads at once: a batch
    committed before a cancel is cancelled whole, one after it survives whole, never half."""
    rig, _ = make(max_ids_per_batch=5, max_rows_per_commit=5)
    fleet = [f"R{n:02}" for n in range(20)]
    datas = [f"gen-{n}" for n in range(6)]

    def batches() -> None:
        for data in datas:
            for part in range(0, len(fleet), 5):
                rig.emqx.publish_batch(fleet[part : part + 5], "task_race_1", data)

    def cancels() -> None:
        for _ in range(6):
            cancel(rig, "task_race_1")

    threads = [threading.Thread(target=batches), threading.Thread(target=cancels)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    poll(lambda: not rig.srv.server.cancels._cancelling, timeout_s=20)
    assert rig.srv.cancels_in_progress() == []
    gens = {g.sha1: g.counts for g in rig.srv.generations("task_race_1")}
    stored, recounted = rig.srv.counts_and_recount()
    assert stored == recounted
    pending_total = sum(c["pending"] for c in gens.values())
    # Every VIN holds at most one row of the request: the last batch not cancelled, or nothing.
    assert pending_total in (0, len(fleet))
    for vin in fleet:
        assert len([r for r in rig.srv.pending(vin) if r.request_id == "task_race_1"]) == pending_total // len(fleet)


# -- expiry -------------------------------------------------------------------------------------


@hooks_only
def test_a_request_expiring_while_its_vehicle_is_offline_is_never_sent(make: Any) -> None:
    """Past expires_at the row ends expired (through the time index) and is never delivered.
    The server's clock is stepped past expires_at: a slow publish cannot find it passed already."""
    clock = StepClock()
    rig, platform = make(clock=clock)
    expires = clock.ms + 800
    rig.emqx.publish_batch(["V1", "V2"], "task_unlock_1", "open", expires_at=expires)
    rig.emqx.publish_batch(["V1"], "task_cfg_1", "cfg")
    assert counts(rig, "task_unlock_1", b"open") == {"total": 2, "pending": 2}
    clock.advance(1.0)
    poll(lambda: counts(rig, "task_unlock_1", b"open") == {"total": 2, "expired": 2}, timeout_s=10)
    v1 = rig.online("V1")
    v1.wait_for(1)
    assert rids(rig, v1) == ["task_cfg_1"]
    record = outcome_of(rig, "V1", "task_unlock_1")
    assert record is not None and record.outcome is outcomes.Outcome.EXPIRED and record.ts_ms >= expires
    [done] = platform.wait(event="completed", request_id="task_unlock_1")
    assert done["counts"]["expired"] == 2


def test_an_expiry_between_queueing_and_delivery_is_skipped_without_waiting_for_the_sweep(make: Any) -> None:
    """A row that expires while the vehicle's previous delivery is out is passed over the moment
    the slot frees, even before the sweep ends it. Ingest and the sweep judge by a clock that
    stays put (the batch is never found expired on arrival, nor swept); delivery by the wall clock."""
    clock = StepClock()
    rig, _ = make(expiry_sweep_interval_s=60.0, clock=clock)
    v1 = rig.online("V1")
    v1.auto_ack = False
    rig.emqx.publish_batch(["V1"], "task_a_1", "a")
    v1.wait_for(1)
    expires = clock.ms + 300
    rig.emqx.publish_batch(["V1"], "task_b_1", "b", expires_at=expires)
    rig.emqx.publish_batch(["V1"], "task_c_1", "c")
    poll(lambda: time.time() * 1000 > expires + 5)  # the wall clock passing it is the point
    v1.auto_ack = True
    assert v1.ack_pending() == 1
    v1.wait_for(2)
    assert rids(rig, v1) == ["task_a_1", "task_c_1"]
    assert counts(rig, "task_b_1", b"b") == {"total": 1, "pending": 1}  # not swept yet, never sent


@hooks_only
def test_an_expiring_delivery_carries_the_seconds_it_has_left_as_message_expiry_interval(make: Any) -> None:
    """A paho MQTT 5 subscriber on the vehicle's topic reads the Message-Expiry-Interval: the
    seconds left until expires_at (a request without one carries none)."""
    rig, _ = make()
    seen: queue.Queue[tuple[str, int | None]] = queue.Queue()
    subscribed: queue.Queue[bool] = queue.Queue()
    spy = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="spy", protocol=mqtt.MQTTv5)
    spy.on_subscribe = lambda c, u, mid, rc, props: subscribed.put(True)
    spy.on_message = lambda c, u, m: seen.put(
        (m.topic.rsplit("/", 1)[1], getattr(m.properties, "MessageExpiryInterval", None))
    )
    spy.connect("127.0.0.1", rig.broker.port)
    spy.subscribe("agent/V1/proxy/request/+", qos=1)
    spy.loop_start()
    try:
        subscribed.get(timeout=10)
        v1 = rig.online("V1")
        rig.emqx.publish_batch(["V1"], "task_unlock_2", "open", expires_at=int(time.time() * 1000) + 30_000)
        rig.emqx.publish_batch(["V1"], "task_cfg_2", "cfg")
        v1.wait_for(2)
        got = dict(seen.get(timeout=10) for _ in range(2))
    finally:
        spy.loop_stop()
        spy.disconnect()
    assert 25 <= got["task_unlock_2"] <= 30
    assert got["task_cfg_2"] is None


# -- bounded backlog ----------------------------------------------------------------------------


@hooks_only
def test_a_batch_stores_nothing_for_a_vehicle_at_its_bound_and_says_so(make: Any) -> None:
    """max_pending_per_vehicle: the full VIN is refused (listed in the receipt), the others stored;
    a new version of a request the vehicle already holds adds nothing, so it is taken."""
    rig, platform = make(max_pending_per_vehicle=2)
    rig.emqx.publish_batch(["V1"], "task_a_1", "a")
    rig.emqx.publish_batch(["V1"], "task_b_1", "b")
    before = metrics.ROWS_REFUSED.labels("vehicle_backlog_full")._value.get()
    rig.emqx.publish_batch(["V1", "V2", "V3"], "task_c_1", "c", batch_id="b-c")
    [receipt] = platform.wait(event="accepted", request_id="task_c_1")
    assert receipt["refused"] == [{"vin": "V1", "reason": "vehicle_backlog_full"}] and receipt["vins"] == 2
    assert metrics.ROWS_REFUSED.labels("vehicle_backlog_full")._value.get() == before + 1
    assert [r.request_id for r in rig.srv.pending("V1")] == ["task_a_1", "task_b_1"]
    assert counts(rig, "task_c_1", b"c") == {"total": 2, "pending": 2}
    rig.emqx.publish_batch(["V1"], "task_b_1", "b2")  # replaces: no growth
    [replaced] = platform.wait(event="accepted", request_id="task_b_1", sha1=sha1_of(b"b2").hex())
    assert replaced["refused"] == []
    # A retry of the batch_id gets the same receipt, refusals included.
    rig.emqx.publish_batch(["V1", "V2", "V3"], "task_c_1", "c", batch_id="b-c")
    receipts = platform.wait(2, event="accepted", request_id="task_c_1")
    assert receipts[1]["duplicate"] is True and receipts[1]["refused"] == receipt["refused"]
    assert len(rig.srv.pending("V1")) == 2 and rig.srv.vehicles_at(2) == 1
    v1 = rig.online("V1")
    v1.wait_for(2)
    poll(lambda: rig.srv.pending("V1") == [])


# -- attempt limit ------------------------------------------------------------------------------


def test_a_vehicle_that_never_pubacks_fails_after_max_attempts_and_gets_its_next_request(make: Any) -> None:
    """Re-sent after each in-flight timeout up to max_attempts; then failed, and the next goes."""
    rig, _ = make(max_attempts=3, inflight_timeout_s=0.3)
    v1 = rig.online("V1")
    v1.auto_ack = False
    rig.emqx.publish_batch(["V1"], "task_poison_1", "never")
    rig.emqx.publish_batch(["V1"], "task_cfg_1", "cfg")
    poll(lambda: "task_cfg_1" in rids(rig, v1), timeout_s=15)
    # The vehicle PUBACKs nothing: task_cfg_1 goes again each in-flight timeout (0.3 s), which a
    # loaded machine may let pass before the list is read.
    got = rids(rig, v1)
    assert got[:4] == ["task_poison_1"] * 3 + ["task_cfg_1"] and set(got[4:]) <= {"task_cfg_1"}, got
    record = poll(lambda: outcome_of(rig, "V1", "task_poison_1"))  # its commit is lazy
    assert record is not None and record.outcome is outcomes.Outcome.FAILED and record.attempts == 3


# -- responses ----------------------------------------------------------------------------------


def test_response_mode_holds_the_slot_until_the_answer_and_publishes_it(make: Any) -> None:
    """await_response: the PUBACK does not free the slot, the answer does; it is stored in the
    outcome (responded) and published as a `response` event; base64 when not UTF-8."""
    rig, platform = make()
    v1 = rig.online("V1")
    rig.emqx.publish_batch(["V1"], "task_diag_1", "diag", await_response=True, correlation_id="c1")
    rig.emqx.publish_batch(["V1"], "task_diag_2", "diag2", await_response=True)
    v1.wait_for(1)
    poll(lambda: (e := rig.srv.in_flight("V1")) is not None and e.acked_at is not None)  # PUBACKed, held
    assert rids(rig, v1) == ["task_diag_1"]
    answered = v1.respond("task_diag_1", b'{"dtc": []}')
    assert (answered is None) == rig.srv.cfg.events_over_mqtt  # over MQTT no hook call answers it
    [event] = platform.wait(event="response", request_id="task_diag_1")
    assert (event["vin"], event["payload"]) == ("V1", '{"dtc": []}') and "payload_encoding" not in event
    v1.wait_for(2)
    v1.respond("task_diag_2", b"\xff\x00")
    [binary] = platform.wait(event="response", request_id="task_diag_2")
    assert (binary["payload"], binary["payload_encoding"]) == ("/wA=", "base64")
    record = poll(lambda: outcome_of(rig, "V1", "task_diag_1"))
    assert record is not None and record.outcome is outcomes.Outcome.RESPONDED and record.response == b'{"dtc": []}'
    poll(lambda: counts(rig, "task_diag_2", b"diag2") == {"total": 1, "responded": 1})


# Hook-only: its forged answer is told apart by the publisher's clientid in the hook call. Over MQTT
# the broker's ACL refuses it before the server sees it (test_real_emqx_events.py, real EMQX).
@hooks_only
def test_no_answer_within_the_timeout_fails_and_a_late_or_forged_answer_is_ignored(make: Any) -> None:
    """No answer within response_timeout_s: failed, the next request goes; the late answer, and
    one published by another client on the vehicle's response topic, change nothing."""
    # The forged answer's round trip must fit in the timeout (it must not be what freed the slot).
    rig, platform = make(response_timeout_s=2.0, max_response_bytes=8)
    v1, v2 = rig.online("V1"), rig.online("V2")
    rig.emqx.publish_batch(["V1"], "task_diag_3", "d3", await_response=True)
    rig.emqx.publish_batch(["V1"], "task_cfg_3", "c3")
    v1.wait_for(1)
    forged = metrics.RESPONSES.labels("forged")._value.get()
    v2.respond("task_diag_3", b"fake", vin="V1")
    poll(lambda: metrics.RESPONSES.labels("forged")._value.get() == forged + 1)
    assert rids(rig, v1) == ["task_diag_3"]
    v1.wait_for(2, timeout_s=10)
    assert rids(rig, v1) == ["task_diag_3", "task_cfg_3"]
    record = poll(lambda: outcome_of(rig, "V1", "task_diag_3"))
    assert record is not None and record.outcome is outcomes.Outcome.FAILED
    late = metrics.RESPONSES.labels("late")._value.get()
    v1.respond("task_diag_3", b"too late")
    poll(lambda: metrics.RESPONSES.labels("late")._value.get() == late + 1)
    assert counts(rig, "task_diag_3", b"d3") == {"total": 1, "failed": 1}
    assert platform.events(event="response") == []
    # A long answer is cut at max_response_bytes and says so.
    rig.emqx.publish_batch(["V2"], "task_diag_4", "d4", await_response=True)
    v2.wait_for(1)
    v2.respond("task_diag_4", "0123456789é".encode())
    [cut] = platform.wait(event="response", request_id="task_diag_4")
    assert (cut["payload"], cut["truncated"]) == ("01234567", True)
