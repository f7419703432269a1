"""kill -9 mid-campaign keeps an abort: a `sdv-fanout serve` SIGKILLed while it walks an aborted
request's cancel (chunks of 10 rows) restarts on the same data (an LMDB data dir, or a PostgreSQL
database) with the abort in force: the walk resumes until no row of the request is pending, and a
batch of it is refused `aborted`, before and after the crash."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from exhook_server._proto import admin_pb2
from testkit.harness import ExHookClient, SubprocessServer, admin_call, poll

pytestmark = pytest.mark.slow

RID = "task_ota_kill9"
CRITERION = {"outcome": "expired", "ratio": 0.5, "min_finished": 10}
SERVER_ENV = {
    "SDV_FANOUT_EXPIRY_SWEEP_INTERVAL_S": "0.2",
    "SDV_FANOUT_CANCEL_CHUNK_ROWS": "10",
    "SDV_FANOUT_GC_INTERVAL_S": "0",
}


def pending(srv: SubprocessServer) -> int:
    reply = admin_call(srv.admin_port, "GetRequest", admin_pb2.GetRequestRequest(request_id=RID))
    return sum(g.counts.pending for g in reply.generations)


def refused(srv: SubprocessServer) -> bool:
    """A batch of RID sent now is refused `aborted` (the server's log says so)."""
    ExHookClient(srv.port).batch(["LKILLNEW00000001"], RID, "fw-2")
    return any(e.get("event") == "batch_rejected" and e.get("reason") == "aborted" for e in srv.events())


def test_an_abort_and_its_cancel_outlive_kill_9(tmp_path: Path, store_env: dict[str, str]) -> None:
    data_dir = tmp_path / "lmdb"
    env = {**store_env, **SERVER_ENV}
    srv = SubprocessServer(data_dir, env=env)
    try:
        doc = json.dumps({"abort": [CRITERION]})
        admin_call(srv.admin_port, "SetPolicy", admin_pb2.SetPolicyRequest(request_id=RID, policy=doc))
        hook = ExHookClient(srv.port)
        soon = int(time.time() * 1000) + 1500
        hook.batch([f"LKILLEXP{n:08d}" for n in range(20)], RID, "fw", expires_at=soon)
        for start in range(0, 6000, 2000):
            hook.batch([f"LKILLROW{n:08d}" for n in range(start, start + 2000)], RID, "fw")
        poll(lambda: srv.logged("campaign_aborted"), timeout_s=30)
        assert refused(srv)
    finally:
        srv.kill()  # mid-walk: 6,000 rows in chunks of 10
    again = SubprocessServer(data_dir, env=env)
    try:
        poll(lambda: pending(again) == 0, timeout_s=60)
        assert again.logged("cancel_resumed")
        got = admin_call(again.admin_port, "GetPolicy", admin_pb2.GetPolicyRequest(request_id=RID))
        assert json.loads(got.aborted)["criterion"] == CRITERION
        assert refused(again)
        assert not again.logged("campaign_aborted")  # recorded once, before the crash
    finally:
        again.kill()
