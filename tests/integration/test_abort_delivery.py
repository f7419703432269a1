"""Automatic abort in the delivery path, on both stores: vehicles answering "failed" cross a
campaign's `answer_failed` criterion while the rest of its rows wait; the rest ends cancelled
(reason aborted), one `aborted` event goes out, its later batches are refused until a new policy
re-opens it, and `request R` and `policy R` show the abort. Real mosquitto, the EMQX-faithful
hook driver."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from exhook_server import cli
from testkit.harness import poll
from tests.integration.test_delivery_e2e import Rig, make_rig
from tests.integration.test_status_topic import Platform

TOPIC = "$SDV-FANOUT/policy"
RID = "task_ota_7"
CRITERION = {"outcome": "answer_failed", "ratio": 0.5, "min_finished": 10}


@pytest.fixture
def store_kind(each_store: str) -> str:
    """Every test here runs on both stores."""
    return each_store


@pytest.fixture
def rig(tmp_path: Path, make_server: Any) -> Iterator[tuple[Rig, Platform]]:
    gen = make_rig(tmp_path, make_server, policy_refresh_s=0.2, cancel_chunk_rows=200)
    rig = next(gen)
    platform = Platform(rig.broker.port)
    try:
        yield rig, platform
    finally:
        platform.close()
        with pytest.raises(StopIteration):
            next(gen)


def policy(rig: Rig, **fields: Any) -> None:
    reply = rig.emqx.publish(TOPIC, json.dumps({"request_id": RID, **fields}).encode())
    assert reply is not None and reply.message.headers["allow_publish"] == "false"


def test_failing_answers_abort_the_campaign_under_load(rig: tuple[Rig, Platform], capsys: Any) -> None:
    """20 online vehicles answer "failed" (min_finished 10): the 1,980 rows not yet sent end
    cancelled with reason aborted; deliveries out finish as they will; one `aborted` event; a later
    batch is refused `aborted` until a new policy, after which it is delivered."""
    r, platform = rig
    before = REGISTRY.get_sample_value("sdv_fanout_aborts_total") or 0.0
    policy(r, abort=[CRITERION])
    online = [f"VIN{i:05d}" for i in range(20)]
    vehicles = [r.online(vin) for vin in online]
    r.emqx.publish_batch([f"VIN{i:05d}" for i in range(2000)], RID, "fw-1", await_response=True)
    for v in vehicles:
        v.wait_for(1)
        v.respond(RID, b'{"status": "failed", "error": "flash_write"}')
    [cancelled] = platform.wait(event="cancelled", request_id=RID)
    [aborted] = platform.events(event="aborted", request_id=RID)
    assert aborted["criterion"] == CRITERION
    counts = aborted["counts"]
    assert counts["answer_failed"] >= 10 and counts["answer_failed"] / counts["finished"] >= 0.5
    assert cancelled["reason"] == "aborted" and cancelled["cancelled"] >= 1980 - 20
    poll(lambda: r.rows() == 0)  # nothing left: the answers of deliveries out ended them too
    assert REGISTRY.get_sample_value("sdv_fanout_aborts_total") == before + 1

    r.emqx.publish_batch(["VIN00000"], RID, "fw-2")
    [rejected] = platform.wait(event="rejected", request_id=RID)
    assert rejected["reason"] == "aborted"
    assert r.rows() == 0
    assert r.srv.server is not None
    cfg = r.srv.server.cfg
    # Offline on PostgreSQL (an LMDB environment cannot be opened twice in one process).
    offline = [["--store-url", cfg.store_url]] if cfg.store_url else []
    for where in (["--server", f"127.0.0.1:{r.srv.server.admin_port}"], *offline):
        assert cli.main(["request", RID, "--json", *where]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["aborted"]["criterion"] == CRITERION and shown["policy"] == {"abort": [CRITERION]}
        assert cli.main(["policy", RID, "--json", *where]) == 0
        assert json.loads(capsys.readouterr().out)["aborted"]["counts"]["answer_failed"] >= 10

    policy(r, max_in_flight=100)  # re-opens R
    r.emqx.publish_batch(["VIN00000"], RID, "fw-2")
    platform.wait(event="accepted", request_id=RID)
    vehicles[0].wait_for(2)
    assert len(platform.events(event="aborted")) == 1
