"""Campaign pacing across 3 PostgreSQL instances, next to a real mosquitto, in real time: the
deliveries of a capped request out at once never exceed max_in_flight fleet-wide, and a rate of
600 per minute holds over the instances together (the one real-time test of the rate: short,
tolerant, polling with a deadline). Hooks spread per client over the instances."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from testkit.emqx_sim import FakeEmqx, Mosquitto, Vehicle
from testkit.harness import SubprocessServer, poll
from tests.integration.test_multi_instance import (
    DELIVERY_CLIENTID,
    INSTANCES,
    Database,
    broker,
    db,
    instances,
    online_fleet,
    rid_of,
)

pytestmark = pytest.mark.slow
__all__ = ["broker", "db"]  # the fixtures of test_multi_instance, used here

TOPIC = "$SDV-FANOUT/policy"
CAP = 4
PER_MINUTE = 600


def firsts_of(fleet: list[Vehicle], rid: str) -> list[float]:
    """When each vehicle first received `rid`, sorted."""
    return sorted(min(r.time for r in v.received if rid_of(r.topic) == rid) for v in fleet if has(v, rid))


def paced_policies(srv: SubprocessServer) -> int:
    """Policies with a rate or cap the instance follows (set here, or read since)."""
    return sum(1 for e in srv.events() if e.get("event") == "campaign_paced")


def has(v: Vehicle, rid: str) -> bool:
    return any(rid_of(r.topic) == rid for r in v.received)


def policy(emqx: FakeEmqx, servers: list[SubprocessServer], request_id: str, **fields: int) -> None:
    """Set a policy through one instance; return once every instance follows it."""
    known = [paced_policies(s) for s in servers]
    reply = emqx.publish(TOPIC, json.dumps({"request_id": request_id, **fields}).encode())
    assert reply is not None and reply.message.headers["allow_publish"] == "false"
    poll(lambda: all(paced_policies(s) > k for s, k in zip(servers, known, strict=True)), timeout_s=10)


def test_three_instances_keep_max_in_flight_and_the_rate_fleet_wide(
    tmp_path: Path, db: Database, broker: Mosquitto
) -> None:
    """Cap 4 over 30 vehicles holding each PUBACK 0.2 s: never more than 4 out in the database,
    every vehicle gets it. 600/min over 30 vehicles: no more than one token at first plus the
    rate since the policy was set (the last start at least 29 / 10 s after it), and not three
    times slower."""
    vins = [f"LPACE{n:012d}" for n in range(30)]
    with instances(tmp_path, db, broker, INSTANCES, "--policy-refresh-s", "0.2") as servers:
        emqx = FakeEmqx([s.port for s in servers], broker.port, delivery_clientid=DELIVERY_CLIENTID, seed=26)
        with emqx:
            emqx.load()
            fleet = online_fleet(emqx, vins, ack_delay_s=0.2)
            policy(emqx, servers, "task_cap_26", max_in_flight=CAP)
            emqx.publish_batch(vins, "task_cap_26", b"fw")
            most = 0
            deadline = time.monotonic() + 60
            while not all(has(v, "task_cap_26") for v in fleet) and time.monotonic() < deadline:
                most = max(most, sum(1 for o in db.out() if o.request_id == "task_cap_26"))
            assert all(has(v, "task_cap_26") for v in fleet)
            assert 1 <= most <= CAP
            set_at = time.time()
            policy(emqx, servers, "task_rate_26", max_per_minute=PER_MINUTE)
            emqx.publish_batch(vins, "task_rate_26", b"cfg")
            poll(lambda: all(has(v, "task_rate_26") for v in fleet), timeout_s=60)
            last = firsts_of(fleet, "task_rate_26")[-1]
            least = (len(vins) - 1) / (PER_MINUTE / 60)
            assert least * 0.95 <= last - set_at <= least * 3, (last - set_at, least)
