"""kill -9 mid-campaign keeps max_in_flight, on both stores: a request capped at 2 deliveries out
has 2 out, never PUBACKed, when `sdv-fanout serve` is SIGKILLed; restarted on the same data with
more of its vehicles online, none of them is sent it while those 2 are still within their
in-flight timeout (LMDB counts them from the send times it keeps; PostgreSQL from each vehicle's
delivery out). A request queued after the capped one, reaching every new vehicle, is the witness
that the capped one was passed over rather than not yet looked at (no sleep decides it)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from storage.lmdb.store import Store
from testkit.emqx_sim import FakeEmqx, Mosquitto, Vehicle
from testkit.harness import SubprocessServer, poll

pytestmark = pytest.mark.slow

CAP = 2
FIRST = [f"LSVCAP00000000{n:03d}" for n in range(CAP)]
LATER = [f"LSVCAP00000001{n:03d}" for n in range(4)]
CAPPED, WITNESS = "task_capped_9", "task_witness_9"


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(tmp_path_factory.mktemp("mosquitto")) as b:
        yield b


def got(cars: list[Vehicle], rid: str) -> int:
    return sum(1 for v in cars for r in v.received if r.topic.endswith("/" + rid))


def tries_kept(data_dir: Path) -> int:
    """Publishes the LMDB store has committed (rows with a `tries` entry)."""
    store = Store(data_dir, readonly=True)
    try:
        return store.counts()["tries"]
    finally:
        store.close()


def test_kill9_keeps_the_deliveries_out_under_max_in_flight(
    tmp_path: Path, broker: Mosquitto, store_env: dict[str, str]
) -> None:
    lmdb = not store_env
    env = {**store_env, "SDV_FANOUT_MQTT_URL": broker.url, "SDV_FANOUT_GC_INTERVAL_S": "0"}
    env["SDV_FANOUT_INFLIGHT_TIMEOUT_S"] = "600"
    data_dir = tmp_path / "lmdb"
    srv = SubprocessServer(data_dir, env=env)
    emqx = FakeEmqx(srv.port, broker.port, strict_rpc=False)
    try:
        emqx.load()
        policy = json.dumps({"request_id": CAPPED, "max_in_flight": CAP}).encode()
        assert emqx.publish("$SDV-FANOUT/policy", policy) is not None
        poll(lambda: srv.logged("campaign_paced"), timeout_s=60)
        holders = emqx.online(FIRST, auto_ack=False)  # they never PUBACK it
        emqx.publish_batch(FIRST + LATER, CAPPED, b"fw")
        poll(lambda: got(holders, CAPPED) == CAP, timeout_s=60)
        if lmdb:  # the publishes are kept by a commit of their own, soon after
            poll(lambda: tries_kept(data_dir) == CAP, timeout_s=60)
    finally:
        srv.kill()
        emqx.close(check=False)
    again = SubprocessServer(data_dir, env=env)
    emqx = FakeEmqx(again.port, broker.port, strict_rpc=False)
    try:
        emqx.load()
        later = emqx.online(LATER, auto_ack=True)
        emqx.publish_batch(LATER, WITNESS, b"cfg")
        poll(lambda: got(later, WITNESS) == len(LATER), timeout_s=60)
        assert got(later, CAPPED) == 0  # the 2 out before the kill still hold the cap
        if lmdb:
            assert again.logged("deliveries_out_carried")
    finally:
        again.kill()
        emqx.close(check=False)
