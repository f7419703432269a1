"""Exports carry when each delivery was first sent, on both stores (a real server, mosquitto, the
EMQX-faithful driver): a row published twice (its first delivery lost with the vehicle's clean
reconnect) and then PUBACKed ends `delivered` with the time of its first publish, not its last;
a row never published ends with none."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from testkit.harness import poll
from tests.integration.test_delivery_e2e import Rig, make_rig


@pytest.fixture
def store_kind(each_store: str) -> str:
    """Every test here runs on both stores."""
    return each_store


@pytest.fixture
def rig(tmp_path: Path, make_server: Any) -> Iterator[Rig]:
    yield from make_rig(tmp_path, make_server)


def test_an_outcome_carries_its_first_send_time_in_the_export(rig: Rig, tmp_path: Path) -> None:
    v = rig.emqx.vehicle("VINSENT1")
    v.auto_ack = False
    v.connect()
    v.subscribe()
    rig.emqx.publish_batch(["VINSENT1", "VINSENT2"], "task_ota_1", b"fw")
    [first] = v.wait_for(1)
    v.auto_ack = True
    v.reconnect(clean_start=True)  # the first delivery is lost with the old session
    v.subscribe()
    v.wait_for(2)
    poll(lambda: rig.srv.pending("VINSENT1") == [])
    rig.emqx.publish_batch(["VINSENT2"], "task_ota_1", b"fw2")  # VINSENT2's fw never went: superseded
    poll(lambda: [r.sha1 for r in rig.srv.pending("VINSENT2")] != [])
    assert rig.srv.server is not None
    out = tmp_path / "export"
    rig.srv.run(rig.srv.server.backend.export(str(out), lambda n: None))
    outcomes = {(r["vin"], r["outcome"]): r for r in pq.read_table(out / "outcomes").to_pylist()}
    delivered = outcomes["VINSENT1", "delivered"]
    assert delivered["attempts"] == 2
    assert delivered["stored_ms"] <= delivered["sent_ms"] <= first.time * 1000 + 1  # the first publish
    assert outcomes["VINSENT2", "superseded"]["sent_ms"] is None
