"""End to end through a real EMQX: sdv-fanout's deliveries/s next to the broker's own QoS 1 with one
message in flight per vehicle, same fleet, same broker, same run; EMQX 5.8.9 (ExHook v2) and 5.9.1 (v3).

Per broker version: one EMQX node (testkit/emqx_real.py), one `sdv-fanout serve` (delivery to that
broker) registered on it as ExHook server (pool_size 8, as deploy/emqx has it), and one fleet of N
paho MQTT 5 vehicles (clientid = VIN, in bench/e2e_fleet.py processes) on a listener of their own
whose zone sets `mqtt.max_inflight = 1`, each subscribed to `agent/<VIN>/proxy/request/+` and
`refer/<VIN>/proxy/request/+` and PUBACKing every message as it arrives. Each round measures, in an
order that alternates round by round:

* ours (hook acks): the platform (a paho client on the default listener) publishes K batches
  `{"ids": [all N VINs], "request_id": ..., "data": <base64 payload>}` on `$SDV-FANOUT`, QoS 1.
  EMQX hands each to our OnMessagePublish (stored durably, not routed); we deliver each
  (VIN, request) on `agent/...`, one in flight per VIN, the next after EMQX's `message.acked`.
* ours (rule acks): the same through a second server with `ack_topic_prefix` (its own batch topic
  `$SDV-FANOUT-RULE`, delivery topics `rule/...`, LMDB and ExHook registration): the next request
  goes after the rule `sdv-fanout ack-rule` prints republished the PUBACK to its delivery client.
  The rule is enabled during this side's runs only, so no other side pays for its evaluation.
* raw, broker-paced (the reference of the ratio): one paho publisher (window 50, like our delivery
  client) sends the same K x N QoS 1 messages, same payload size, to `refer/<VIN>/proxy/request/<rid>`
  at once. The vehicles' zone lets EMQX keep one unacknowledged message per session and queue the
  rest in the session, so a vehicle's next message leaves the broker as soon as its PUBACK is in.
* raw, closed loop: the same publisher sends a VIN's next message only when the vehicle's QoS 0
  signal says it PUBACKed the previous one (bench/e2e.py's raw (b)).

deliveries/s = K x N / (first publish -> the fleet's last PUBACK of the phase).

Why broker-paced is the raw limit for "one in flight per vehicle": EMQX enforces the rule inside the
session that takes the PUBACK, with no round trip to any client, so nothing on this broker and fleet
delivers one-at-a-time faster; ours/raw is the share of that limit we reach. The closed loop adds a
client round trip per delivery, as our path does (PUBACK -> message.acked hook -> our next publish),
so it is the kinder reference, shown next to it. Why `refer/` for raw: on `agent/` each raw PUBACK
would make EMQX call our `message.acked` hook (filter `agent/+/proxy/request/+`), synchronously in the
vehicle's channel, charging raw with part of our cost; no hook filter matches `refer/`. Both servers
are registered all along (each sees the fleet's presence hooks for its own topics); during a
measurement the other one is idle.

Before the rounds each side runs once unrecorded (one request per VIN). After each measurement the
server and the broker are left to go idle (LMDB back to 0 rows for ours) before the next one starts.
CPU of every process group is sampled per measurement. `--profile PATH` then samples the server with
py-spy during one more ours run and prints its busiest functions. Markdown tables to stdout, progress
to stderr, --json for the numbers.

    .venv/bin/python -m bench.e2e_emqx [--versions 5.8.9,5.9.1] [--vehicles 500] [--requests 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import paho.mqtt
import paho.mqtt.client as mqtt
import structlog
from paho.mqtt.enums import CallbackAPIVersion

from exhook_server.acks import rule_body
from exhook_server.config import Config
from storage.lmdb.store import Store
from testkit.emqx_real import EmqxBroker, EmqxError, find_release
from testkit.emqx_sim import LOOPBACK, free_port
from testkit.harness import SubprocessServer
from testkit.plumbing import (
    Child,
    CpuMeter,
    arm_fleets,
    collect_fleets,
    cycle_stats,
    dec,
    descendants,
    machine_meta,
    make_vins,
    min_med_max,
    num,
    pending_rows,
    quiesce,
    share,
    stop_server,
)

FLEET = [sys.executable, "-m", "bench.e2e_fleet"]
MAX_PER_PROC = 300  # paho's select() loop: about 330 clients per process
EXHOOK = "sdv-fanout"
OURS_PREFIX = "agent"  # the hook-acks server's request_topic_prefix
#: The rule-acks server: its own topics, clientids and ExHook name, so both servers run side by side.
RULE_PREFIX, RULE_BATCH, RULE_CLIENTS, RULE_EXHOOK = "rule", "$SDV-FANOUT-RULE", "sdv-fanout-rule-", "sdv-fanout-rule"
RULE_ACKS_TOPIC = f"{RULE_BATCH}/acked"
RAW_PREFIX, RAW_ACK_PREFIX = "refer", "refer-ack"  # no hook filter of ours matches these
ACCEPTED_PUBACK = (0, 16)  # success, or "no matching subscribers" (a batch is never routed)
SIDES = ("ours", "ours_rule", "raw_paced", "raw_loop")
OURS = ("ours", "ours_rule")
LABELS = {"ours": "ours (hook acks)", "ours_rule": "ours (rule acks)", "raw_paced": "raw paced", "raw_loop": "raw loop"}


# -- the rig: one broker version ------------------------------------------------------------------


class Platform:
    """The SDV platform: one paho MQTT 5 client publishing batches on `$SDV-FANOUT`, QoS 1."""

    def __init__(self, port: int) -> None:
        self.acked = threading.Semaphore(0)
        self.bad: list[str] = []
        connected = threading.Event()
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="sdv-platform", protocol=mqtt.MQTTv5)
        c.max_inflight_messages_set(50)
        c.on_connect = lambda *_a: connected.set()
        c.on_publish = self._on_publish
        c.connect(LOOPBACK, port, keepalive=60, clean_start=True)
        c.loop_start()
        self.client = c
        if not connected.wait(10):
            raise RuntimeError("platform: no CONNACK")

    def _on_publish(self, _c: Any, _u: Any, mid: int, rc: Any, _props: Any) -> None:
        if rc.value not in ACCEPTED_PUBACK:
            self.bad.append(f"mid {mid}: {rc}")
        self.acked.release()

    def publish(self, topic: str, payloads: Sequence[bytes], deadline_s: float) -> float:
        """Publish every batch; returns the time.time() just before the first; waits for the PUBACKs."""
        t0 = time.time()
        for payload in payloads:
            self.client.publish(topic, payload, qos=1)
        deadline = time.monotonic() + deadline_s
        for _ in payloads:
            if not self.acked.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise RuntimeError("platform: a batch got no PUBACK")
        if self.bad:
            raise RuntimeError(f"platform: batches refused: {self.bad[:3]}")
        return t0

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


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
        self.platform: Platform | None = None
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
        self.platform = Platform(self.broker.mqtt_port)
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
        for c in self.children:
            c.stop()
        if self.platform is not None:
            self.platform.close()
        for store in self.stores.values():
            store.close()
        if self.broker is not None:
            self.broker.stop()
        for server in self.servers.values():
            stop_server(server)


# -- measurements ---------------------------------------------------------------------------------


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


def run_ours(rig: Rig, side: str, tag: str, seed: int, requests: int | None = None) -> dict[str, Any]:
    """One measurement of a server: "ours" (hook acks) or "ours_rule" (rule acks, rule enabled meanwhile)."""
    assert rig.platform is not None
    rule = side == "ours_rule"
    exhook, topic = (RULE_EXHOOK, RULE_BATCH) if rule else (EXHOOK, "$SDV-FANOUT")
    k = requests or rig.args.requests
    rng = random.Random(seed)
    payloads = [batch(rig.vins, f"task_{tag}_{i}", rng.randbytes(rig.args.payload_bytes)) for i in range(k)]
    if rule:
        rig.set_rule(True)
    try:
        arm_fleets(rig.fleets, k, rig.args.deadline_s)
        hooks0 = rig.exhook_counts(exhook)
        meter = rig.meter(side)
        t0 = rig.platform.publish(topic, payloads, rig.args.deadline_s)
        done = collect_fleets(rig.fleets, len(rig.vins) * k, rig.args.deadline_s)
        out = result(t0, done, meter)
        rig.settle()
    finally:
        if rule:
            rig.set_rule(False)
    hooks1 = rig.exhook_counts(exhook)  # once idle: EMQX counts a call when it is answered
    out["hook_calls"] = hooks1["succeed"] - hooks0["succeed"]
    out["hook_failures"] = hooks1["failed"] - hooks0["failed"]
    return out


def run_raw(rig: Rig, loop: bool, tag: str, seed: int, requests: int | None = None) -> dict[str, Any]:
    assert rig.pub is not None
    k = requests or rig.args.requests
    arm_fleets(rig.fleets, k, rig.args.deadline_s, signal=loop)
    meter = rig.meter("raw")
    rids = [f"task_{tag}_{i}" for i in range(k)]
    rig.pub.send({"cmd": "run", "mode": "b" if loop else "a", "rids": rids, "payload_bytes": rig.args.payload_bytes,
                  "seed": seed, "deadline_s": rig.args.deadline_s})  # fmt: skip
    res = rig.pub.recv(rig.args.deadline_s + 30)["done"]
    if not res["ok"]:
        raise RuntimeError(f"raw publisher did not finish: {res}")
    done = collect_fleets(rig.fleets, len(rig.vins) * k, rig.args.deadline_s)
    out = result(res["first"], done, meter)
    rig.settle()
    return out


def cost(side: dict[str, Any]) -> float:
    """CPU µs per delivery of every process of the rig (not the rest of the machine)."""
    return float(side["cpu_us_per_delivery"]["total"])


def measure(rig: Rig, side: str, tag: str, seed: int, requests: int | None = None) -> dict[str, Any]:
    if side in OURS:
        return run_ours(rig, side, tag, seed, requests)
    return run_raw(rig, side == "raw_loop", tag, seed, requests)


def run_version(
    version: str, args: argparse.Namespace, tmp: Path, vins: list[str], say: Callable[[str], None]
) -> dict[str, Any]:
    rig = Rig(version, args, tmp, vins)
    rounds: list[dict[str, Any]] = []
    profile = ""
    try:
        rig.start(say)
        for side in SIDES:
            measure(rig, side, f"warm{side[-1]}", args.seed, requests=1)
        for r in range(args.rounds):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            res: dict[str, Any] = {"order": " → ".join(order)}
            for i, side in enumerate(order):
                res[side] = measure(rig, side, f"r{r}{side[-1]}", args.seed + 100 * r + i)
            for ours, key in (("ours", ""), ("ours_rule", "rule_")):
                res[f"ratio_{key}paced"] = res[ours]["deliveries_per_s"] / res["raw_paced"]["deliveries_per_s"]
                res[f"ratio_{key}loop"] = res[ours]["deliveries_per_s"] / res["raw_loop"]["deliveries_per_s"]
                # All the bench's processes' CPU per delivery, raw over ours: what the ratio would be
                # on a machine they saturate alone (the rest of the machine's load moves it little).
                res[f"cost_ratio_{key}paced"] = cost(res["raw_paced"]) / cost(res[ours])
            rounds.append(res)
            rates = ", ".join(f"{LABELS[side]} {res[side]['deliveries_per_s']:,.0f}/s" for side in SIDES)
            say(
                f"EMQX {version} round {r + 1}/{args.rounds}: {rates}; over raw paced: hook "
                f"{res['ratio_paced']:.2f}, rule {res['ratio_rule_paced']:.2f}"
            )
        if args.profile:
            profile = "\n\n".join(
                run_profile(rig, side, Path(f"{args.profile}.{version}.{side}.txt"), say) for side in OURS
            )
        assert rig.broker is not None
        protocol = rig.broker.protocol
        processes = max(1, len(rig.server_pids["ours"]) - 1)  # a parent with children only runs several
    finally:
        rig.close()
    return {"version": version, "protocol": protocol, "server_processes": processes, "rounds": rounds,
            "summary": summarise(rounds), "profile": profile}  # fmt: skip


def run_profile(rig: Rig, side: str, out: Path, say: Callable[[str], None]) -> str:
    """py-spy on one server (all its processes) during one more run of its side, 4 x --requests."""
    from bench.hooks import top_functions

    server = rig.servers[side]
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        raise SystemExit("py-spy is not installed: .venv/bin/pip install py-spy")
    cmd = [str(spy), "record", "--rate", "200", "--format", "raw", "--subprocesses", "-o", str(out)]
    # --native pauses the server for each sample (slower, but shows where grpc's C core spends);
    # otherwise read the stacks without pausing it, and native time counts for its Python caller.
    cmd.append("--native" if rig.args.profile_native else "--nonblocking")
    spy_proc = subprocess.Popen([*cmd, "--pid", str(server.proc.pid)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)  # fmt: skip
    try:
        time.sleep(1.0)  # py-spy attaches
        res = run_ours(rig, side, f"prof{side[-1]}", rig.args.seed + 99, requests=4 * rig.args.requests)
    finally:
        spy_proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        try:
            spy_proc.wait(60)
        except subprocess.TimeoutExpired:
            spy_proc.kill()
            spy_proc.wait(10)
    if not out.exists():
        err = spy_proc.stderr.read().decode(errors="replace") if spy_proc.stderr else ""
        raise SystemExit(f"py-spy wrote nothing:\n{err}")
    say(f"profiled {side}: {res['deliveries_per_s']:,.0f} deliveries/s under py-spy: {out}")
    label = LABELS[side]
    return f"{label}: {res['deliveries_per_s']:,.0f} deliveries/s while sampled. " + top_functions(out.read_text(), 15)


# -- report ---------------------------------------------------------------------------------------


def summarise(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    series = {f"{side}_deliveries_per_s": [r[side]["deliveries_per_s"] for r in rounds] for side in SIDES}
    for ours, key in (("ours", ""), ("ours_rule", "rule_")):
        series[f"ratio_{ours}_over_raw_paced"] = [r[f"ratio_{key}paced"] for r in rounds]
        series[f"ratio_{ours}_over_raw_loop"] = [r[f"ratio_{key}loop"] for r in rounds]
        series[f"cost_ratio_raw_paced_over_{ours}"] = [r[f"cost_ratio_{key}paced"] for r in rounds]
        for group in ("server", "emqx"):
            series[f"{ours}_{group}_us_per_delivery"] = [r[ours]["cpu_us_per_delivery"][group] for r in rounds]
    series["raw_paced_emqx_us_per_delivery"] = [r["raw_paced"]["cpu_us_per_delivery"]["emqx"] for r in rounds]
    return {k: {"min": min(v), "median": statistics.median(v), "max": max(v)} for k, v in series.items()}


def version_markdown(v: dict[str, Any], meta: dict[str, Any]) -> str:
    rounds = v["rounds"]
    n, k = meta["vehicles"], meta["requests"]

    def col(side: str, key: str) -> str:
        return min_med_max([r[side][key] for r in rounds], num if key == "deliveries_per_s" else dec)

    def cpu(side: str, group: str) -> list[float]:
        return [r[side]["cpu_us_per_delivery"][group] for r in rounds]

    def ratio(key: str) -> str:
        return min_med_max([r[key] for r in rounds], dec)

    def per(side: str, key: str, by: float, fmt: Callable[[float], str]) -> str:
        return min_med_max([r[side][key] / by for r in rounds], fmt)

    lines = [
        f"### EMQX {v['version']} (ExHook {v['protocol']}): {n:,} vehicles x {k} requests = {n * k:,} deliveries "
        f"per measurement, {len(rounds)} rounds",
        "",
        "| metric | min | median | max |",
        "|---|---:|---:|---:|",
        f"| ours, hook acks ($SDV-FANOUT batch → ExHook → LMDB → MQTT → PUBACK → message.acked → next) "
        f"deliveries/s | {col('ours', 'deliveries_per_s')} |",
        f"| ours, rule acks (… → PUBACK → rule → MQTT ack message → next) deliveries/s | "
        f"{col('ours_rule', 'deliveries_per_s')} |",
        f"| raw, broker-paced (EMQX max_inflight 1 queues per session) deliveries/s | "
        f"{col('raw_paced', 'deliveries_per_s')} |",
        f"| raw, closed loop (next on the vehicle's signal) deliveries/s | {col('raw_loop', 'deliveries_per_s')} |",
        f"| **ratio ours (hook acks) / raw broker-paced** (paired per round) | {ratio('ratio_paced')} |",
        f"| **ratio ours (rule acks) / raw broker-paced** (paired per round) | {ratio('ratio_rule_paced')} |",
        f"| ratio ours (hook acks) / raw closed loop (paired per round) | {ratio('ratio_loop')} |",
        f"| ratio ours (rule acks) / raw closed loop (paired per round) | {ratio('ratio_rule_loop')} |",
        f"| CPU per delivery, all the rig's processes: raw broker-paced / ours hook acks (paired) | "
        f"{ratio('cost_ratio_paced')} |",
        f"| CPU per delivery, all the rig's processes: raw broker-paced / ours rule acks (paired) | "
        f"{ratio('cost_ratio_rule_paced')} |",
        f"| ours hook acks: per-vehicle cycle (receive → next receive) p50 ms | {col('ours', 'cycle_p50_ms')} |",
        f"| ours rule acks: per-vehicle cycle p50 ms | {col('ours_rule', 'cycle_p50_ms')} |",
        f"| ours hook acks: per-vehicle cycle p99 ms | {col('ours', 'cycle_p99_ms')} |",
        f"| ours rule acks: per-vehicle cycle p99 ms | {col('ours_rule', 'cycle_p99_ms')} |",
        f"| raw broker-paced: per-vehicle cycle p50 ms | {col('raw_paced', 'cycle_p50_ms')} |",
        f"| raw closed loop: per-vehicle cycle p50 ms | {col('raw_loop', 'cycle_p50_ms')} |",
        f"| ours hook acks: hook calls EMQX counted as answered, per delivery | "
        f"{per('ours', 'hook_calls', n * k, dec)} |",
        f"| ours rule acks: hook calls EMQX counted as answered, per delivery | "
        f"{per('ours_rule', 'hook_calls', n * k, dec)} |",
        f"| ours hook acks: hook calls EMQX counted as failed | {per('ours', 'hook_failures', 1, num)} |",
        f"| ours rule acks: hook calls EMQX counted as failed | {per('ours_rule', 'hook_failures', 1, num)} |",
        "",
        "CPU per delivery (median over rounds, µs of CPU per delivery, and share of one core):",
        "",
        "| process | " + " | ".join(f"{LABELS[side]} µs | core" for side in SIDES) + " |",
        "|---|" + "---:|---:|" * len(SIDES),
    ]
    for label, group in (
        (f"sdv-fanout server measured ({v['server_processes']} process(es))", "server"),
        (f"EMQX {v['version']}", "emqx"),
        ("fleet (vehicles)", "fleet"),
        ("raw publisher", "raw publisher"),
        ("this bench (the platform client for ours)", "bench"),
        ("**all of the above**", "total"),
        ("other processes on the machine (the idle server included)", "other processes"),
    ):
        cells = []
        for side in SIDES:
            us = statistics.median(cpu(side, group))
            core = statistics.median(r[side]["cpu"][group] for r in rounds)
            cells += [num(us), share(core)]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    lines += [
        "",
        "| round | order | hook /s | rule /s | raw paced /s | raw loop /s | hook/paced | rule/paced | hook/loop "
        "| rule/loop |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(rounds, 1):
        rates = " | ".join(f"{r[side]['deliveries_per_s']:,.0f}" for side in SIDES)
        lines.append(
            f"| {i} | {r['order']} | {rates} | {r['ratio_paced']:.2f} | {r['ratio_rule_paced']:.2f} | "
            f"{r['ratio_loop']:.2f} | {r['ratio_rule_loop']:.2f} |"
        )
    dups = sum(r[s]["duplicates"] for r in rounds for s in SIDES)
    lines += ["", f"Duplicate deliveries over all rounds: {dups}."]
    if v["profile"]:
        lines += ["", f"#### Where the servers' time goes (py-spy, EMQX {v['version']})", "", v["profile"]]
    return "\n".join(lines)


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "### Summary: ours / raw EMQX QoS 1 with one message in flight per vehicle (medians, min to max)",
        "",
        "| EMQX | ExHook | acks | ours deliveries/s | raw broker-paced /s | **ours / paced** | raw closed loop /s | "
        "ours / loop | CPU cost raw paced / ours | server µs/delivery | EMQX µs/delivery |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v in results:
        s = v["summary"]

        def m(key: str, fmt: Callable[[float], str], s: dict[str, dict[str, float]] = s) -> str:
            return f"{fmt(s[key]['median'])} ({fmt(s[key]['min'])} to {fmt(s[key]['max'])})"

        for ours, acks in (("ours", "hook"), ("ours_rule", "rule")):
            lines.append(
                f"| {v['version']} | {v['protocol']} | {acks} | {m(f'{ours}_deliveries_per_s', num)} | "
                f"{m('raw_paced_deliveries_per_s', num)} | **{m(f'ratio_{ours}_over_raw_paced', dec)}** | "
                f"{m('raw_loop_deliveries_per_s', num)} | {m(f'ratio_{ours}_over_raw_loop', dec)} | "
                f"{m(f'cost_ratio_raw_paced_over_{ours}', dec)} | {m(f'{ours}_server_us_per_delivery', num)} | "
                f"{m(f'{ours}_emqx_us_per_delivery', num)} |"
            )
    lines += [
        "",
        f"Fleet: {meta['vehicles']:,} paho MQTT 5 vehicles (clientid = VIN) in {meta['procs']} processes on a "
        f"listener with `mqtt.max_inflight = 1`, {meta['requests']} requests per vehicle per measurement, payload "
        f"{meta['payload_bytes']} B; raw publisher window {meta['max_inflight']}; server processes "
        f"{', '.join(str(v['server_processes']) for v in results)} (each of the two servers); ExHook pool_size 8; "
        f"raw broker-paced EMQX µs/delivery "
        f"{', '.join(num(v['summary']['raw_paced_emqx_us_per_delivery']['median']) for v in results)}. "
        f"{meta['cpus']} CPUs shared by "
        f"broker, servers, fleet and bench; 1-min load average {meta['loadavg_1m_before']:.2f} before, "
        f"{meta['loadavg_1m_after']:.2f} after; {meta['wall_s']:.0f} s wall. Seed {meta['seed']}.",
    ]
    for v in results:
        lines += ["", version_markdown(v, meta)]
    return "\n".join(lines)


# -- main -----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--versions", default="5.8.9,5.9.1", help="EMQX versions, one after the other (default both)")
    p.add_argument("--vehicles", type=int, default=500, help="vehicles in the fleet (default 500)")
    p.add_argument("--requests", type=int, default=5, help="requests per vehicle per measurement (default 5)")
    p.add_argument("--rounds", type=int, default=3, help="paired rounds per version (default 3)")
    p.add_argument("--procs", type=int, default=2, help="fleet processes (default 2; <= 300 vehicles each)")
    p.add_argument("--payload-bytes", type=int, default=256, help="delivered payload size (default 256)")
    p.add_argument("--max-inflight", type=int, default=50, help="raw publisher window (server default: 50)")
    p.add_argument("--server-processes", type=int, default=1,
                   help="SDV_FANOUT_PROCESSES (default 1, the fastest on 2 shared cores; 0: one per CPU)")  # fmt: skip
    p.add_argument("--deadline-s", type=float, default=120, help="give up on a phase after this (default 120)")
    p.add_argument("--seed", type=int, default=20240611)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="server log level (default info, as in production)")  # fmt: skip
    p.add_argument("--profile", metavar="PATH", help="also py-spy the server in one more ours run (PATH.<version>.txt)")
    p.add_argument("--profile-native", action="store_true", help="--profile with native frames (py-spy --native)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    p.add_argument("--keep-tmp", action="store_true", help="keep the tmp dir (logs, LMDB) after a successful run")
    args = p.parse_args(argv)
    if min(args.vehicles, args.requests, args.rounds, args.procs) < 1:
        p.error("--vehicles, --requests, --rounds and --procs must be positive")
    versions = [v.strip() for v in args.versions.split(",") if v.strip()]
    missing = [v for v in versions if find_release(v) is None]
    if missing:
        p.error(f"no EMQX release for {', '.join(missing)} (see /work/shared/emqx/README.md)")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the finally blocks
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # the launcher's log lines
    wall0 = time.monotonic()
    load_before = os.getloadavg()[0]
    vins = make_vins(args.seed, args.vehicles)
    tmp_root = Path(tempfile.mkdtemp(prefix="sdv-bench-e2e-emqx-"))
    completed = False  # a failed run keeps its tmp dir for the post-mortem

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - wall0:6.1f} s] {msg}", file=sys.stderr, flush=True)

    results = []
    try:
        for version in versions:
            (tmp_root / version).mkdir()
            results.append(run_version(version, args, tmp_root / version, vins, say))
        completed = True
    finally:
        if args.keep_tmp or not completed:
            print(f"kept {tmp_root} (EMQX, server and fleet logs, LMDB)", file=sys.stderr)
        else:
            shutil.rmtree(tmp_root, ignore_errors=True)
    meta = {
        "versions": versions,
        "vehicles": args.vehicles,
        "requests": args.requests,
        "rounds": args.rounds,
        "procs": max(args.procs, -(-args.vehicles // MAX_PER_PROC)),
        "payload_bytes": args.payload_bytes,
        "max_inflight": args.max_inflight,
        "seed": args.seed,
        "log_level": args.log_level,
        **machine_meta(load_before, wall0),
        "paho": paho.mqtt.__version__,
    }
    print(markdown(results, meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "versions": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
