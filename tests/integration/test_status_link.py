"""Receipts across a broker link that black-holes, then resets: each one written meanwhile reaches
the platform after the reconnect, or is counted in sdv_fanout_status_dropped_total.

Real mosquitto, the real server with its delivery client connected through tests/blackhole.py (real
sockets on loopback), batches arriving as EMQX's ExHook calls, and a platform subscribed at QoS 1
to the status topic directly at the broker, counting what arrives.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import REGISTRY

from testkit.emqx_sim import Mosquitto, running_mosquitto
from testkit.harness import ExHookClient, poll
from tests.blackhole import BlackholeProxy
from tests.integration.test_status_topic import Platform

RECEIPTS = 200
_REASONS = ("queue_count", "queue_bytes", "too_large", "refused", "link_dropped", "shutdown")


def dropped(kind: str = "accepted", reasons: tuple[str, ...] = _REASONS) -> float:
    return sum(
        REGISTRY.get_sample_value("sdv_fanout_status_dropped_total", {"kind": kind, "reason": r}) or 0.0
        for r in reasons
    )


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with running_mosquitto(tmp_path_factory.mktemp("mosquitto"), verbose=False) as b:
        yield b


@pytest.fixture
def proxy(broker: Mosquitto) -> Iterator[BlackholeProxy]:
    with BlackholeProxy(broker.port) as p:
        yield p


@pytest.fixture
def platform(broker: Mosquitto) -> Iterator[Platform]:
    p = Platform(broker.port)
    yield p
    p.close()


@pytest.mark.parametrize(
    "bounds",
    [{}, {"status_queue_max": 50}, {"status_queue_max_bytes": 32 << 10}],
    ids=["default-bounds", "queue-of-50", "queue-of-32KiB"],
)
def test_receipts_written_into_a_black_hole_arrive_after_the_reset_or_are_counted(
    make_server: Any, proxy: BlackholeProxy, platform: Platform, bounds: dict[str, int]
) -> None:
    """200 receipts written while the link black-holes, then the link resets: each one arrives
    once the delivery client has reconnected, or is counted dropped (only when a bound was hit)."""
    srv = make_server(mqtt_url=proxy.url, **bounds)
    poll(lambda: srv.server.delivery is not None and srv.server.delivery.connected)
    before, before_bytes = dropped(), dropped(reasons=("queue_bytes",))
    proxy.blackhole()
    client = ExHookClient(srv.port)
    try:
        for n in range(RECEIPTS):
            client.batch([f"VINBH{n:012d}"], f"task_bh_{n}", "fw")
    finally:
        client.close()
    poll(lambda: proxy.swallowed > 0)  # receipts went into the hole
    assert proxy.reset() >= 1

    def arrived() -> set[str]:
        return {d["request_id"] for d in platform.events(event="accepted") if d["request_id"].startswith("task_bh_")}

    poll(lambda: len(arrived()) + dropped() - before >= RECEIPTS, timeout_s=20)
    counted = dropped() - before
    assert len(arrived()) + counted == RECEIPTS
    if not bounds:
        assert counted == 0
    elif "status_queue_max" in bounds:
        # The first WINDOW were in flight, the newest waited; those between made room.
        assert counted == RECEIPTS - bounds["status_queue_max"]
    else:
        assert counted > 0 and dropped(reasons=("queue_bytes",)) - before_bytes == counted
