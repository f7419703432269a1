"""The rig of bench/e2e_emqx.py: one real EMQX node with a fleet listener whose zone allows one
message in flight, two `sdv-fanout serve` registered as its ExHooks (acks through the hook, acks
through the rule of ack_topic_prefix, side by side on their own topics), the rule, a platform that
publishes batches QoS 1 all at once, raw fleet processes and the raw publisher."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from exhook_server.acks import rule_body
from exhook_server.config import Config
from storage.lmdb.store import Store
from testkit.emqx_real import EmqxBroker, EmqxError
from testkit.emqx_sim import LOOPBACK, free_port
from testkit.harness import SubprocessServer
from testkit.mqtt import Client, run
from testkit.plumbing import (
    Child,
    CpuMeter,
    cycle_stats,
    descendants,
    pending_rows,
    quiesce,
    stop_server,
)
from testkit.rig import FLEET, MAX_PER_PROC

#: The rule-acks server: its own topics, clientids and ExHook name, so both servers run side by side.
RULE_PREFIX, RULE_BATCH, RULE_CLIENTS, RULE_EXHOOK = "rule", "$SDV-FANOUT-RULE", "sdv-fanout-rule-", "sdv-fanout-rule"
RAW_PREFIX, RAW_ACK_PREFIX = "refer", "refer-ack"  # no hook filter of ours matches these
EXHOOK = "sdv-fanout"
OURS_PREFIX = "agent"  # the hook-acks server's request_topic_prefix
RULE_ACKS_TOPIC = f"{RULE_BATCH}/acked"
ACCEPTED_PUBACK = (0, 16)  # success, or "no matching subscribers" (a batch is never routed)


class BatchPublisher(Client):
    """The SDV platform: one MQTT 5 client publishing batches on `$SDV-FANOUT`, QoS 1, all at once."""

    def __init__(self, port: int) -> None:
        super().__init__(port, "sdv-platform")
        self.connect()

    def publish_all(self, topic: str, payloads: Sequence[bytes], deadline_s: float) -> float:
        """Publish every batch; returns the time.time() just before the first; waits for the PUBACKs."""

        async def publish() -> tuple[float, list[int | None]]:
            t0 = time.time()
            return t0, await asyncio.gather(*(self.apublish(topic, p, timeout_s=deadline_s) for p in payloads))

        t0, codes = run(publish(), deadline_s + 1)
        bad = [code for code in codes if code not in ACCEPTED_PUBACK]
        if bad:
            raise RuntimeError(f"platform: batches refused: {bad[:3]}")
        return t0


def batch(vins: list[str], request_id: str, payload: bytes) -> bytes:
    doc = {"ids": vins, "request_id": request_id, "data": base64.b64encode(payload).decode(), "data_encoding": "base64"}
    return json.dumps(doc).encode()


class Rig:
    """EMQX (a fleet listener with max_inflight 1), the two servers (hook acks, rule acks) as its
    ExHooks, the rule, the platform, the fleet and the raw publisher; `close()` stops all of it,
    whatever state it got to."""

    def __init__(self, version: str, args: argparse.Namespace, tmp: Path, vins: list[str]) -> None:
        self.version = version
        self.args = args
        self.tmp = tmp
        self.vins = vins
        self.fleet_port = 0
        self.children: list[Child] = []
        self.fleets: list[Child] = []
        self.broker: EmqxBroker | None = None
        #: "ours" (hook acks) and "ours_rule" (rule acks): server, its pids, its LMDB read-only.
        self.servers: dict[str, SubprocessServer] = {}
        self.server_pids: dict[str, list[int]] = {}
        self.stores: dict[str, Store] = {}
        self.rule_id = ""
        self.platform: BatchPublisher | None = None
        self.pub: Child | None = None

    def start_broker(self, attempts: int = 3) -> EmqxBroker:
        """EMQX with the fleet's listener; new ports on a retry (a port found free may be taken by
        someone else before the node binds it: eaddrinuse)."""
        for attempt in range(1, attempts + 1):
            self.fleet_port = free_port()
            zone = {
                "EMQX_LISTENERS__TCP__FLEET__BIND": f"{LOOPBACK}:{self.fleet_port}",
                "EMQX_LISTENERS__TCP__FLEET__ZONE": "fleet",
                "EMQX_ZONES__FLEET__MQTT__MAX_INFLIGHT": "1",
            }
            try:
                return EmqxBroker(self.version, self.tmp / f"emqx{attempt}", env=zone).start()
            except EmqxError:
                if attempt == attempts:
                    raise
                print(f"EMQX {self.version} did not start (attempt {attempt}); again on new ports", file=sys.stderr)
        raise AssertionError("unreachable")

    def start(self, say: Callable[[str], None]) -> None:
        self.broker = self.start_broker()
        self.emqx_pids = descendants(self.broker.proc.pid)  # type: ignore[union-attr]
        env = {"SDV_FANOUT_MQTT_URL": self.broker.url, "SDV_FANOUT_METRICS_LISTEN": "127.0.0.1:0"}
        env["SDV_FANOUT_PROCESSES"] = str(self.args.server_processes)
        rule_env = {
            "SDV_FANOUT_ACK_TOPIC_PREFIX": RULE_ACKS_TOPIC,
            "SDV_FANOUT_BATCH_TOPIC": RULE_BATCH,
            "SDV_FANOUT_DATA_TOPIC_PREFIX": f"{RULE_BATCH}/data",
            "SDV_FANOUT_TRIGGER_TOPIC": f"{RULE_BATCH}/trigger",
            "SDV_FANOUT_REQUEST_TOPIC_PREFIX": f"{RULE_PREFIX}/{{VIN}}/proxy/request",
            "SDV_FANOUT_MQTT_CLIENTID_PREFIX": RULE_CLIENTS,
        }
        for side, name, extra in (("ours", EXHOOK, {}), ("ours_rule", RULE_EXHOOK, rule_env)):
            lmdb = self.tmp / f"lmdb-{side}"
            server = SubprocessServer(lmdb, "--log-level", self.args.log_level, env={**env, **extra})
            self.servers[side] = server
            self.server_pids[side] = descendants(server.proc.pid)
            self.broker.register_exhook(name, f"http://{LOOPBACK}:{server.port}", pool_size=8)
            self.stores[side] = Store(lmdb, readonly=True)
        self.rule_id = self.broker.api("POST", "/rules", {**self.rule_body(), "enable": False})["id"]
        pids = sum(map(len, self.server_pids.values()))
        say(f"EMQX {self.version} ({self.broker.protocol}) up, both servers registered, the rule created ({pids} pids)")
        self.platform = BatchPublisher(self.broker.mqtt_port)
        procs = max(self.args.procs, -(-len(self.vins) // MAX_PER_PROC))
        for k in range(procs):
            vins = self.vins[k::procs]
            prefixes = f"{OURS_PREFIX},{RULE_PREFIX},{RAW_PREFIX}"
            self.fleets.append(self._spawn(f"fleet{k}", "raw", self.fleet_port, vins, "--prefix", prefixes,
                                           "--clientid-prefix", ""))  # fmt: skip
        self.pub = self._spawn("pub", "pub", self.broker.mqtt_port, self.vins, "--prefix", RAW_PREFIX,
                               "--max-inflight", str(self.args.max_inflight))  # fmt: skip
        for c in self.children:
            c.recv(self.args.deadline_s)  # {"ready": n}: connected and subscribed
        quiesce(self.all_server_pids() + self.emqx_pids, idle_share=0.1)
        say(f"{len(self.vins)} vehicles subscribed in {procs} fleet processes")

    def _spawn(self, name: str, role: str, port: int, vins: list[str], *extra: str) -> Child:
        argv = [*FLEET, "--role", role, "--mqtt-port", str(port), "--vins", ",".join(vins)]
        argv += ["--ack-prefix", RAW_ACK_PREFIX, "--timeout-s", str(self.args.deadline_s), *extra]
        child = Child(name, argv, self.tmp / f"{name}.log")
        self.children.append(child)
        return child

    def rule_body(self) -> dict[str, Any]:
        """The rule for the rule-acks server's settings, as `sdv-fanout ack-rule` prints it."""
        cfg = Config(
            ack_topic_prefix=RULE_ACKS_TOPIC,
            batch_topic=RULE_BATCH,
            data_topic_prefix=f"{RULE_BATCH}/data",
            trigger_topic=f"{RULE_BATCH}/trigger",
            request_topic_prefix=f"{RULE_PREFIX}/{{VIN}}/proxy/request",
            mqtt_clientid_prefix=RULE_CLIENTS,
        )
        major, minor = (int(p) for p in self.version.split(".")[:2])
        return rule_body(cfg, direct_dispatch=(major, minor) >= (5, 8))  # 5.1 fails every action with it

    def set_rule(self, enabled: bool) -> None:
        """Enable the rule for the rule-acks side only: it is evaluated for every PUBACK in the broker."""
        assert self.broker is not None
        self.broker.api("PUT", f"/rules/{self.rule_id}", {"enable": enabled})

    def all_server_pids(self) -> list[int]:
        return [pid for pids in self.server_pids.values() for pid in pids]

    def meter(self, side: str) -> CpuMeter:
        """CPU per process group; "server" is the server measured now (the other one idles)."""
        assert self.pub is not None
        return CpuMeter(
            {
                "server": self.server_pids.get(side, []),
                "emqx": self.emqx_pids,
                "fleet": [c.proc.pid for c in self.fleets],
                "raw publisher": [self.pub.proc.pid],
            }
        )

    def exhook_counts(self, name: str) -> dict[str, int]:
        """EMQX's own count of a server's hook calls: succeeded and failed (timeouts, errors)."""
        assert self.broker is not None
        metrics = self.broker.api("GET", f"/exhooks/{name}").get("metrics", {})
        return {k: int(metrics.get(k, 0)) for k in ("succeed", "failed")}

    def settle(self) -> None:
        """Wait (bounded) for both LMDBs to hold 0 rows and the servers and broker to go idle."""
        deadline = time.monotonic() + self.args.deadline_s
        while self.rows():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.rows()} rows still pending after {self.args.deadline_s} s")
            time.sleep(0.02)  # a progress poll with a deadline
        quiesce(self.all_server_pids() + self.emqx_pids, idle_share=0.1)

    def rows(self) -> int:
        return sum(pending_rows(store) for store in self.stores.values())

    def close(self) -> None:
        close_rig(self.children, self.platform, self.stores, self.broker, self.servers)


def close_rig(
    children: Iterable[Any], platform: Any, stores: Mapping[Any, Any], broker: Any, servers: Mapping[Any, Any]
) -> None:
    """Stop a rig's parts in order: the fleet's children, the platform's client, the stores, the
    broker, then the servers."""
    for c in children:
        c.stop()
    if platform is not None:
        platform.close()
    for store in stores.values():
        store.close()
    if broker is not None:
        broker.stop()
    for server in servers.values():
        stop_server(server)


def result(t0: float, done: list[dict[str, Any]], meter: CpuMeter) -> dict[str, Any]:
    """deliveries/s from the first publish to the fleet's last PUBACK; CPU per delivery from the
    meter (started before the first publish, read once the fleets reported, a poll later)."""
    shares = meter.shares()
    n = sum(d["distinct"] for d in done)
    seconds = max(d["last_done"] for d in done) - t0
    cpu_s = {g: v * meter.wall_s for g, v in shares.items()}
    return {
        "seconds": seconds,
        "deliveries_per_s": n / seconds,
        **cycle_stats(done),
        "duplicates": sum(d["count"] - d["distinct"] for d in done),
        "cpu": {g: v / seconds for g, v in cpu_s.items()},  # share of one core while measured
        "cpu_us_per_delivery": {g: v / n * 1e6 for g, v in cpu_s.items()},
    }
