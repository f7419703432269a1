"""kill -9 mid-campaign keeps pacing, on both stores: a request at 1 per minute has started one
delivery when `sdv-fanout serve` is SIGKILLed; restarted on the same data, the rate holds (on
PostgreSQL the bucket is a table row, so nothing more starts; on LMDB the bucket starts again
with its one token, so one more does) and the vehicles' next request goes meanwhile. A request
queued after the paced one, reaching every vehicle, is the witness that the paced one was
passed over rather than not yet looked at (no sleep decides it)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.emqx_sim import FakeEmqx, Mosquitto, Vehicle
from testkit.harness import SubprocessServer, poll

pytestmark = pytest.mark.slow

VINS = [f"LSVPACE0000000{n:03d}" for n in range(4)]
PACED, WITNESS_1, WITNESS_2 = "task_paced_9", "task_next_9", "task_after_9"


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(tmp_path_factory.mktemp("mosquitto")) as b:
        yield b


@pytest.fixture(params=["lmdb", "postgresql"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


def got(cars: list[Vehicle], rid: str) -> int:
    return sum(1 for v in cars for r in v.received if r.topic.endswith("/" + rid))


def test_kill9_mid_campaign_keeps_the_rate(
    tmp_path: Path, broker: Mosquitto, store_kind: str, request: pytest.FixtureRequest
) -> None:
    """1/min, two server processes: one start before the kill; after it, none more (PostgreSQL) or one (LMDB's fresh
    bucket), while the vehicles' later requests go."""
    env = {"SDV_FANOUT_MQTT_URL": broker.url, "SDV_FANOUT_GC_INTERVAL_S": "0", "SDV_FANOUT_PROCESSES": "2"}
    if store_kind == "postgresql":
        cluster = request.getfixturevalue("pg_cluster")
        env["SDV_FANOUT_STORE_URL"] = cluster.new_database(f"kill9_pacing_{os.getpid()}")
    data_dir = tmp_path / "lmdb"
    srv = SubprocessServer(data_dir, env=env)
    try:
        emqx = FakeEmqx(srv.port, broker.port, strict_rpc=False)
        emqx.load()
        policy = json.dumps({"request_id": PACED, "max_per_minute": 1}).encode()
        assert emqx.publish("$SDV-FANOUT/policy", policy) is not None
        # Both processes follow it (the other one from its next reload, within policy_refresh_s).
        poll(lambda: sum(1 for e in srv.events() if e.get("event") == "campaign_paced") >= 2, timeout_s=10)
        before = emqx.online(VINS)
        emqx.publish_batch(VINS, PACED, b"fw")
        emqx.publish_batch(VINS, WITNESS_1, b"cfg")
        poll(lambda: got(before, WITNESS_1) == len(VINS), timeout_s=20)
        # Its one token may come with the pacer's first lease, after the witness went (until then
        # the paced request is passed over like a held one).
        poll(lambda: got(before, PACED) >= 1, timeout_s=20)
        assert got(before, PACED) == 1
    finally:
        srv.kill()
        emqx.close(check=False)
    again = SubprocessServer(data_dir, env=env)
    try:
        emqx = FakeEmqx(again.port, broker.port, strict_rpc=False)
        emqx.load()
        after = emqx.online(VINS)
        emqx.publish_batch(VINS, WITNESS_2, b"cfg2")
        poll(lambda: got(after, WITNESS_2) == len(VINS), timeout_s=20)
        if store_kind == "lmdb":  # the fresh bucket's one token, maybe after the witness
            poll(lambda: got(after, PACED) >= 1, timeout_s=20)
        assert got(after, PACED) == (1 if store_kind == "lmdb" else 0)
    finally:
        again.kill()
        emqx.close(check=False)
