"""A delivery the broker refuses costs that row an attempt, never the other vehicles their link.

Real mosquitto, real server, real MQTT 5 vehicles (hooks played by testkit/emqx_sim.py). The
poison rows are written straight into LMDB, past ingest validation, as a row from an older
release or a broker stricter than our rules would be.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from storage.lmdb import outcomes
from storage.lmdb.outcomes import Outcome
from testkit.emqx_sim import Mosquitto
from testkit.harness import poll, put
from tests.integration.test_delivery_e2e import Rig, make_rig

#: Mosquitto drops a client that publishes this (a C1 control in the topic, MQTT 5 §1.5.4).
POISON_RID = "task_\u0085_1"
FLEET = [f"VIN{n:03d}" for n in range(12)]


def _failed() -> float:
    return REGISTRY.get_sample_value("sdv_fanout_deliveries_failed_total", {"reason": "broker_refused"}) or 0.0


def _drops(broker: Mosquitto, clientid: str) -> int:
    """Times the broker closed our delivery client's connection (mosquitto's own log)."""
    return len(re.findall(rf"Client {re.escape(clientid)} (?:disconnected|closed its connection)", broker.log()))


@pytest.fixture
def rig(tmp_path: Path, make_server: Any) -> Iterator[Rig]:
    yield from make_rig(tmp_path, make_server, delivery_max_refusals=3)


def test_poison_topic_ends_failed_and_the_fleet_gets_everything(rig: Rig) -> None:
    """A row whose topic makes the broker drop our link is blamed alone, fails after 3 refusals,
    and every other request, the same vehicle's next one included, is delivered."""
    srv = rig.srv.server
    assert srv is not None and srv.delivery is not None
    failed_before = _failed()
    put(srv.committer, srv.store, ["VIN000", "VIN005"], POISON_RID, b"poison", at=1)
    vehicles = [rig.online(vin) for vin in FLEET]
    for n in range(3):
        rig.emqx.publish_batch(FLEET, f"task_ota_{n}", f"firmware {n}".encode())
    for v in vehicles:
        v.wait_for(3, timeout_s=30)
    for v in vehicles:
        assert rig.rids(v) == ["task_ota_0", "task_ota_1", "task_ota_2"], v.vin
    poll(lambda: rig.rows() == 0, timeout_s=10)
    assert _failed() - failed_before == 2
    with srv.store.read() as txn:
        [poisoned] = [
            o for o in outcomes.vehicle_outcomes(txn, srv.store.tables, "VIN000") if o.request_id == POISON_RID
        ]
        delivered = outcomes.vehicle_outcomes(txn, srv.store.tables, "VIN001")
    # Attempts count every hand-over to the delivery link, held ones a drop discarded included.
    assert poisoned.outcome is Outcome.FAILED and poisoned.attempts >= 3
    assert sorted(o.request_id for o in delivered if o.outcome is Outcome.DELIVERED) == [
        "task_ota_0",
        "task_ota_1",
        "task_ota_2",
    ]
    # Each poison row is refused 3 times; the first drop may blame both at once. Status
    # messages about the poison request go to $SDV-FANOUT/status/_unroutable, never its topic.
    # (+2 of slack: a keepalive lost on a loaded machine also drops the link, blaming nobody guilty.)
    assert _drops(rig.broker, srv.delivery.clientid) <= 8


class DenyingMosquitto(Mosquitto):
    """Mosquitto whose ACL refuses publishes to one vehicle's topics (PUBACK 0x87 for MQTT 5)."""

    def _config(self) -> str:
        # Mosquitto reads the ACL after dropping root for its own user: not from tmp_path (0700).
        fd, path = tempfile.mkstemp(prefix="sdv-fanout-acl-")
        with os.fdopen(fd, "w") as acl:
            acl.write("pattern deny agent/VIN003/#\npattern readwrite #\n")
        os.chmod(path, 0o644)
        self.acl_path = Path(path)
        return super()._config() + f"acl_file {path}\n"

    def stop(self, timeout_s: float = 5.0) -> None:
        super().stop(timeout_s)
        acl: Path | None = getattr(self, "acl_path", None)
        if acl is not None:
            acl.unlink(missing_ok=True)


def test_refused_puback_fails_that_row_only(tmp_path: Path, make_server: Any) -> None:
    """A PUBACK reason >= 0x80 fails that vehicle's row after the refusal limit; the rest go on."""
    failed_before = _failed()
    for r in make_rig(tmp_path, make_server, broker_cls=DenyingMosquitto, delivery_max_refusals=2):
        vehicles = [r.online(vin) for vin in FLEET[:6]]
        r.emqx.publish_batch(FLEET[:6], "task_cfg_1", b"config")
        for v in vehicles:
            if v.vin != "VIN003":
                v.wait_for(1)
                assert r.rids(v) == ["task_cfg_1"]
        poll(lambda rig=r: rig.rows() == 0, timeout_s=10)
        assert _failed() - failed_before == 1
        assert vehicles[3].received == []
