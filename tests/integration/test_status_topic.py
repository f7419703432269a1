"""The platform hears back: receipts, duplicates, rejections and progress on the status topic.

Real mosquitto, real server, real MQTT 5 vehicles (hooks played by testkit/emqx_sim.py), and a
platform client subscribed to `$SDV-FANOUT/status/#` as a platform would be.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from exhook_server import cli
from storage.lmdb.batches import sha1_of
from storage.model import now_ms
from testkit.harness import poll
from tests.integration.test_delivery_e2e import Rig, make_rig
from tests.integration.test_ingest import REJECTIONS


class Platform:
    """A platform's status subscriber: every status message, in arrival order."""

    def __init__(self, port: int) -> None:
        self.messages: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self.seen: list[tuple[str, dict[str, Any]]] = []
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="platform-status", protocol=mqtt.MQTTv5)
        subscribed = queue.Queue[bool]()
        client.on_message = lambda c, u, m: self.messages.put((m.topic, json.loads(m.payload)))
        client.on_subscribe = lambda c, u, mid, rc, props: subscribed.put(True)
        client.connect("127.0.0.1", port)
        client.subscribe("$SDV-FANOUT/status/#", qos=1)
        client.loop_start()
        subscribed.get(timeout=10)
        self.client = client

    def events(self, **match: Any) -> list[dict[str, Any]]:
        """Every message so far whose fields equal `match`."""
        while not self.messages.empty():
            self.seen.append(self.messages.get_nowait())
        return [doc for _, doc in self.seen if all(doc.get(k) == v for k, v in match.items())]

    def wait(self, n: int = 1, **match: Any) -> list[dict[str, Any]]:
        return poll(lambda: (found := self.events(**match)) and len(found) >= n and found, timeout_s=30)  # type: ignore[no-any-return]

    def topics(self, **match: Any) -> list[str]:
        self.events()
        return [t for t, doc in self.seen if all(doc.get(k) == v for k, v in match.items())]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


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
def rig(tmp_path: Path, make_server: Any) -> Iterator[Rig]:
    yield from make_rig(tmp_path, make_server, progress_interval_s=0.2)


@pytest.fixture
def platform(rig: Rig) -> Iterator[Platform]:
    p = Platform(rig.broker.port)
    yield p
    p.close()


@hooks_only
def test_a_stored_batch_gets_an_accepted_receipt_with_its_correlation_id(rig: Rig, platform: Platform) -> None:
    """After the commit: accepted, the blob's sha1, rows stored, no refusals, the correlation_id echoed."""
    rig.emqx.publish_batch(["V1", "V2"], "task_ota_1", "fw", correlation_id="c-42")
    [receipt] = platform.wait(event="accepted", request_id="task_ota_1")
    assert receipt["sha1"] == sha1_of(b"fw").hex() and receipt["vins"] == 2 and receipt["refused"] == []
    assert receipt["correlation_id"] == "c-42" and receipt["ts_ms"] > 0
    assert platform.topics(event="accepted") == ["$SDV-FANOUT/status/task_ota_1"]


@hooks_only
def test_a_rejected_batch_says_why_on_its_topic_or_on_rejected(rig: Rig, platform: Platform) -> None:
    """A usable request id gets `rejected` on its own topic; an unusable one on `_rejected`."""
    rig.emqx.publish_batch(["V/1"], "task_bad_1", "x", correlation_id="c-1")
    rig.emqx.publish_batch(["V1"], "task\u0085_1", "x")
    [on_topic] = platform.wait(event="rejected", request_id="task_bad_1")
    assert on_topic["reason"] == "bad_vin" and on_topic["correlation_id"] == "c-1"
    [anonymous] = platform.wait(event="rejected", request_id=None)
    assert anonymous["reason"] == "bad_request_id"
    assert "$SDV-FANOUT/status/_rejected" in platform.topics(event="rejected")


@hooks_only
def test_a_retried_batch_id_is_not_delivered_again(rig: Rig, platform: Platform) -> None:
    """The same batch_id after delivery: nothing stored, no second delivery, the receipt again marked duplicate."""
    v = rig.online("V1")
    rig.emqx.publish_batch(["V1"], "task_ota_1", "fw", batch_id="b-1")
    v.wait_for(1)
    poll(lambda: rig.rows() == 0)
    rig.emqx.publish_batch(["V1"], "task_ota_1", "fw", batch_id="b-1")
    receipts = platform.wait(2, event="accepted", request_id="task_ota_1")
    assert [r.get("duplicate") for r in receipts] == [None, True]
    assert receipts[1]["sha1"] == receipts[0]["sha1"] and receipts[1]["vins"] == 1
    assert rig.rows() == 0 and len(v.received) == 1


@hooks_only
def test_a_preview_counts_the_online_vehicles_and_sends_nothing(rig: Rig, platform: Platform) -> None:
    """dry_run: a preview with the batch's online VINs (dispatch's presence), no row, no delivery."""
    v = rig.online("V1")
    poll(lambda: rig.srv.run(rig.srv.server.dispatcher.group_online()) == ["V1"])  # presence is recorded
    rig.emqx.publish_batch(["V1", "V2"], "task_ota_1", "fw", dry_run=True)
    [preview] = platform.wait(event="preview", request_id="task_ota_1")
    assert (preview["would_store"], preview["online_now"], preview["rejected_vins"]) == (2, 1, [])
    rig.emqx.publish_batch(["V1"], "task_ota_2", "fw2")
    v.wait_for(1)
    assert rig.rids(v) == ["task_ota_2"] and platform.events(event="accepted", request_id="task_ota_1") == []


def test_progress_completed_and_request_carry_the_generations_latencies(
    rig: Rig, platform: Platform, capsys: Any
) -> None:
    """stored -> PUBACK (the vehicle away at least 300 ms) and PUBACK -> answer percentiles, from the
    store: in `completed` (with the last delivery's) and in `request R --json`."""
    published = now_ms()
    rig.emqx.publish_batch(["V1"], "task_ota_9", "fw", await_response=True)
    platform.wait(event="accepted", request_id="task_ota_9")
    poll(lambda: now_ms() - published >= 300)  # the vehicle stays away this long at least
    v = rig.online("V1")
    v.wait_for(1)
    v.respond("task_ota_9", b'{"status": "succeeded"}')
    [done] = platform.wait(event="completed", request_id="task_ota_9")
    bound = (now_ms() - published) * 1.05
    delivered, answered = done["latency_ms"]["delivered"], done["latency_ms"]["answered"]
    assert 0.95 * 300 <= delivered["p50"] == delivered["p99"] <= bound and 0 <= answered["p50"] <= bound
    assert rig.srv.server is not None
    cfg = rig.srv.server.cfg
    offline = [["--store-url", cfg.store_url]] if cfg.store_url else []
    for where in (["--server", f"127.0.0.1:{rig.srv.server.admin_port}"], *offline):
        assert cli.main(["request", "task_ota_9", "--json", *where]) == 0
        [generation] = json.loads(capsys.readouterr().out)["generations"]
        assert generation["latency_ms"] == done["latency_ms"]


@hooks_only
def test_a_parked_trigger_gets_its_receipt_when_its_data_arrives(rig: Rig, platform: Platform) -> None:
    """Plugin format: no receipt while the trigger waits; accepted, with its tags, once the data is stored."""
    trigger = {"ids": ["V1"], "request_id": "task_cfg_1", "data_id": "d1", "batch_id": "b-9", "correlation_id": "c-9"}
    rig.emqx.publish("$SDV-FANOUT/trigger", json.dumps(trigger).encode())
    assert platform.events(event="accepted") == []
    rig.emqx.publish("$SDV-FANOUT/data/d1", b"config")
    [receipt] = platform.wait(event="accepted", request_id="task_cfg_1")
    assert (receipt["batch_id"], receipt["correlation_id"]) == ("b-9", "c-9")
    assert receipt["sha1"] == sha1_of(b"config").hex()


def test_progress_reaches_completed_for_an_online_fleet(rig: Rig, platform: Platform) -> None:
    """A campaign to an online fleet reports progress and then completed, with every pair delivered."""
    fleet = [f"V{n}" for n in range(8)]
    vehicles = [rig.online(vin) for vin in fleet]
    rig.emqx.publish_batch(fleet, "task_ota_7", "fw7")
    for v in vehicles:
        v.wait_for(1)
    [done] = platform.wait(event="completed", request_id="task_ota_7")
    assert done["counts"]["total"] == 8 and done["counts"]["delivered"] == 8 and done["counts"]["pending"] == 0
    assert platform.events(event="progress", request_id="task_ota_7")


@hooks_only
def test_a_reused_request_id_with_new_data_is_counted_apart(rig: Rig, platform: Platform) -> None:
    """New data under an old request id: its own generation, the old pending row counted superseded."""
    rig.emqx.publish_batch(["V1"], "task_ota_1", "old")
    rig.emqx.publish_batch(["V1"], "task_ota_1", "new")
    old, new = sha1_of(b"old").hex(), sha1_of(b"new").hex()

    def old_superseded() -> dict[str, Any] | None:
        # The old generation's first progress may say pending 1 (sent before the new batch came).
        seen = platform.events(event="progress", request_id="task_ota_1", sha1=old)
        return seen[-1] if seen and seen[-1]["counts"]["superseded"] == 1 else None

    old_progress = poll(old_superseded, timeout_s=30)
    assert old_progress["counts"]["superseded"] == 1 and old_progress["counts"]["pending"] == 0
    new_progress = platform.wait(event="progress", request_id="task_ota_1", sha1=new)[-1]
    assert new_progress["counts"]["pending"] == 1 and new_progress["counts"]["total"] == 1


@hooks_only
@pytest.mark.parametrize(("reason", "topic", "payload"), REJECTIONS)
def test_every_rejection_reason_gets_a_rejected_receipt(
    rig: Rig, platform: Platform, reason: str, topic: str, payload: bytes
) -> None:
    """Whatever the reason code, the platform gets `rejected` with it, on the request's topic when
    the batch names a usable request id, else on `_rejected`."""
    rig.emqx.publish(topic, payload)
    [receipt] = platform.wait(event="rejected")
    assert receipt["reason"] == reason
    [where] = platform.topics(event="rejected")
    rid = receipt["request_id"]
    assert where == f"$SDV-FANOUT/status/{rid if rid is not None else '_rejected'}"
