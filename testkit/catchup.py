"""The catch-up rig: a real EMQX with one server (a group or two instances) registered as its
ExHook, restartable in place, and the steps the catch-up tests and bench take with it (hold and
release vehicles' PUBACKs, wait until EMQX's hook calls reach a restarted server). The server's
catch-up session is what stores batches EMQX routed while no hook call could reach it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from typing import Any

import asyncpg

from storage.lmdb.store import Store
from testkit.emqx_real import EmqxApiError, EmqxBroker
from testkit.emqx_shared import unregister_exhook
from testkit.emqx_sim import free_port
from testkit.harness import SubprocessServer, Throttle, metric, poll, stop
from testkit.vehicle import Vehicle

EXHOOK = "sdv-fanout"
#: How long EMQX waits for a hook call of a stopped server before it routes the batch.
REQUEST_TIMEOUT = "1s"
DEADLINE_S = 30.0
#: The topics the catch-up session subscribes to (the default batch topics).
FILTERS = {"$SDV-FANOUT", "$SDV-FANOUT/trigger", "$SDV-FANOUT/data/#", "$SDV-FANOUT/cancel"}

#: Names unique within the test process (directories, client ids, databases).
ids = itertools.count()


class Rig:
    """A broker, and one server (a group or two instances) registered with it, restartable in place."""

    def __init__(self, broker: EmqxBroker, workdir: Path, store_url: str) -> None:
        n = next(ids)
        self.broker = broker
        self.port = free_port()
        self.data_dir = workdir / f"lmdb-{n}"
        self.clientid = f"sdv-fanout-catchup-test{n}"
        self.env = {
            "SDV_FANOUT_MQTT_URL": broker.url,
            "SDV_FANOUT_PROCESSES": "2",
            "SDV_FANOUT_CATCHUP_CLIENTID": self.clientid,
            "SDV_FANOUT_INFLIGHT_TIMEOUT_S": "5",
        }
        self.store_url = store_url
        if store_url:
            self.env["SDV_FANOUT_STORE_URL"] = store_url
        #: Every server run of the test, for its logs.
        self.runs: list[SubprocessServer] = []
        self.start()
        broker.register_exhook(
            EXHOOK, f"http://127.0.0.1:{self.port}", pool_size=2, request_timeout=REQUEST_TIMEOUT, auto_reconnect="1s"
        )

    @property
    def srv(self) -> SubprocessServer:
        return self.runs[-1]

    def start(self) -> None:
        self.runs.append(SubprocessServer(self.data_dir, "--listen", f"127.0.0.1:{self.port}", env=self.env))

    def session_held(self) -> bool:
        return session_held(self.broker, self.clientid)

    def rows(self, vins: list[str]) -> int:
        """Pending rows of these VINs, committed (LMDB read-only, or SQL)."""
        if self.store_url:
            return pg_rows(self.store_url, vins)
        with Store(self.data_dir, readonly=True) as store:
            return sum(len(store.pending(v)) for v in vins)

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for run in self.runs for e in run.events() if e.get("event") == name]

    def set_exhook(self, enable: bool) -> None:
        """Enable or disable our ExHook in EMQX (disabled: EMQX calls no hook and routes every batch)."""
        conf = self.broker.api("GET", f"/exhooks/{EXHOOK}")
        body = {k: conf[k] for k in ("name", "url", "pool_size", "request_timeout", "failed_action", "auto_reconnect")}
        self.broker.api("PUT", f"/exhooks/{EXHOOK}", {**body, "enable": enable})
        if enable:
            self.broker.wait_exhook(EXHOOK)

    def close(self) -> None:
        """Leave the broker as found: our ExHook entry goes first (EMQX never retries a server that
        is gone), then the server, then its catch-up session."""
        try:
            unregister_exhook(self.broker, EXHOOK)
        finally:
            stop(self.srv)
        discard_session(self.broker, self.clientid)


def pg_rows(store_url: str, vins: list[str]) -> int:
    """Pending rows of these VINs in a PostgreSQL store."""

    async def count() -> int:
        conn = await asyncpg.connect(store_url)
        try:
            return int(await conn.fetchval("SELECT count(*) FROM rows WHERE vin = ANY($1::text[])", vins))
        finally:
            await conn.close()

    return asyncio.run(count())


def session_held(broker: EmqxBroker, clientid: str) -> bool:
    """The catch-up client connected and subscribed to every batch topic."""
    try:
        client = broker.api("GET", f"/clients/{clientid}")
    except EmqxApiError as exc:
        if exc.status == 404:
            return False
        raise
    subs = broker.api("GET", f"/subscriptions?clientid={clientid}&limit=100")["data"]
    return bool(client.get("connected")) and {s["topic"] for s in subs} >= FILTERS


def discard_session(broker: EmqxBroker, clientid: str) -> None:
    """End a catch-up session: it would queue later tests' batches for a week."""
    try:
        broker.api("DELETE", f"/clients/{clientid}")
    except EmqxApiError as exc:
        if exc.status != 404:
            raise


def batch(vins: list[str], rid: str, **extra: Any) -> bytes:
    return json.dumps({"ids": vins, "request_id": rid, "data": rid, **extra}).encode()


def hold_acks(vehicles: list[Vehicle]) -> None:
    """Vehicles keep their PUBACKs while no hook call can tell the server (EMQX would not retell it)."""
    for v in vehicles:
        v.auto_ack = False


def release_acks(vehicles: list[Vehicle]) -> None:
    """The hooks answer again: PUBACK what was held, and everything from now on."""
    for v in vehicles:
        v.auto_ack = True
        v.ack_held()


def hooks_reach(srv: SubprocessServer, vehicles: list[Vehicle]) -> None:
    """Heartbeat until EMQX's hook calls reach `srv` (it reconnects to a restarted server within its
    auto_reconnect): a PUBACK before that would never be told to it."""
    beat = Throttle(0.5)

    def heard() -> bool:
        if beat.due():
            vehicles[0].heartbeat("heartbeat")
        return metric(srv, "sdv_fanout_heartbeats_total") > 0

    poll(heard, DEADLINE_S, interval_s=0.05)
