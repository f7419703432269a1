"""Automatic abort across 3 `sdv-fanout serve` instances on one PostgreSQL, next to a real mosquitto:
vehicles whose hooks land on a random instance per call answer "failed" at once, so the outcomes
that cross the criterion are judged on several instances together. Exactly one `aborted` event
goes out fleet-wide, every row not yet sent ends cancelled, and every instance refuses the
request's next batch (reason `aborted`)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from testkit.emqx_sim import FakeEmqx, Mosquitto, Vehicle
from testkit.harness import poll
from tests.integration.test_multi_instance import (
    DELIVERY_CLIENTID,
    INSTANCES,
    Database,
    broker,
    db,
    instances,
    metric,
    online_fleet,
)
from tests.integration.test_status_topic import Platform

__all__ = ["broker", "db"]  # the fixtures this module uses

pytestmark = pytest.mark.slow

RID = "task_fleet_abort_1"
CRITERION = {"outcome": "answer_failed", "ratio": 0.5, "min_finished": 20}


def test_three_instances_abort_once_and_all_refuse(tmp_path: Path, db: Database, broker: Mosquitto) -> None:
    """60 online vehicles answer "failed" through random instances: one `aborted` event and one
    count of sdv_fanout_aborts_total over the three, the 3,000 offline rows cancelled, and a batch
    of R sent to each instance refused `aborted`."""
    online = [f"LABORT{n:011d}" for n in range(60)]
    offline = [f"LWAIT{n:012d}" for n in range(3000)]
    with instances(tmp_path, db, broker, INSTANCES, "--policy-refresh-s", "0.2") as servers:
        platform = Platform(broker.port)
        emqx = FakeEmqx(
            [s.port for s in servers], broker.port, delivery_clientid=DELIVERY_CLIENTID, routing="random", seed=26
        )
        try:
            with emqx:
                emqx.load()
                reply = emqx.publish(
                    "$SDV-FANOUT/policy", json.dumps({"request_id": RID, "abort": [CRITERION]}).encode()
                )
                assert reply is not None and reply.message.headers["allow_publish"] == "false"
                fleet = online_fleet(emqx, online, ack_delay_s=0.0)  # the policy reached every instance meanwhile
                for start in range(0, len(offline), 1000):
                    emqx.publish_batch(offline[start : start + 1000], RID, "fw", await_response=True)
                emqx.publish_batch(online, RID, "fw", await_response=True)

                def answer(v: Vehicle) -> None:
                    v.wait_for(1)
                    v.respond(RID, b'{"status": "failed"}')

                with ThreadPoolExecutor(16) as pool:
                    list(pool.map(answer, fleet))
                [cancelled] = platform.wait(event="cancelled", request_id=RID)
                assert cancelled["reason"] == "aborted" and cancelled["cancelled"] >= len(offline)
                poll(db.settled, timeout_s=30, interval_s=0.1)
                [aborted] = platform.events(event="aborted", request_id=RID)
                assert aborted["criterion"] == CRITERION
                assert sum(metric(s, "sdv_fanout_aborts_total") for s in servers) == 1
                for s in servers:  # each instance refuses, whatever it had seen
                    one = FakeEmqx([s.port], broker.port, delivery_clientid=DELIVERY_CLIENTID, node="other@127.0.0.1")
                    with one:
                        one.load()
                        reply = one.publish_batch(online[:1], RID, "fw-2")
                        assert reply is not None and reply.message.headers["allow_publish"] == "false"
                poll(lambda: len(platform.events(event="rejected", request_id=RID)) == INSTANCES)
                assert {e["reason"] for e in platform.events(event="rejected", request_id=RID)} == {"aborted"}
                assert db.pending_rows() == 0
                assert len(platform.events(event="aborted")) == 1
        finally:
            platform.close()
