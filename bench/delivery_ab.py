"""Server CPU per delivery, this checkout against another revision, side by side through one real EMQX.

    .venv/bin/python -m bench.delivery_ab [--base main] [--version 5.8.9] [--vehicles 500] [--requests 6]
                                          [--rounds 5] [--profile PATH]

One EMQX (fleet listener with max_inflight 1), two `sdv-fanout serve` (LMDB, one process each) in
the provisioned mode: vehicle events over MQTT, PUBACKs through the ack rule (each server its own
topics, clientids, share group, ExHook and rule, so they run side by side): "this" from the
checkout, "base" from `--base` unpacked (PYTHONPATH). One fleet process set subscribes to both
servers' request topics. Paired rounds, the order alternating; per round and side the platform
publishes `--requests` batches naming every vehicle (only that side's rule enabled), timed until the
fleet holds every delivery. The figure: each server's CPU (utime + stime of its processes) per
delivery, and this / base paired per round. `--profile` py-spies "this" in one more run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from exhook_server.acks import rule_body
from exhook_server.config import Config
from storage.lmdb.store import Store
from testkit.emqx_real import EmqxBroker, find_release
from testkit.emqx_rig import BatchPublisher, batch, close_rig
from testkit.emqx_sim import LOOPBACK, free_port
from testkit.harness import SubprocessServer
from testkit.plumbing import (
    Child,
    CpuMeter,
    Run,
    arm_fleets,
    collect_fleets,
    descendants,
    make_vins,
    pending_rows,
    quiesce,
    thread_cpu_s,
    unpack_tree,
)
from testkit.rig import FLEET, MAX_PER_PROC

SIDES = ("this", "base")


def stime_s(pids: list[int]) -> float:
    """System (kernel) CPU seconds of processes, from /proc."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                total += int(f.read().rsplit(")", 1)[1].split()[12]) / os.sysconf("SC_CLK_TCK")
        except FileNotFoundError:
            continue
    return total


def side_settings(side: str) -> dict[str, str]:
    """A server's own topics, clientids and share group (as flags' env vars), apart from the other's."""
    tag = side.upper()
    return {
        "SDV_FANOUT_VEHICLE_EVENTS": "mqtt",
        "SDV_FANOUT_EVENTS_SHARE_GROUP": f"ab-{side}",
        "SDV_FANOUT_ACK_TOPIC_PREFIX": f"$SDV-FANOUT-{tag}/acked",
        "SDV_FANOUT_BATCH_TOPIC": f"$SDV-FANOUT-{tag}",
        "SDV_FANOUT_DATA_TOPIC_PREFIX": f"$SDV-FANOUT-{tag}/data",
        "SDV_FANOUT_TRIGGER_TOPIC": f"$SDV-FANOUT-{tag}/trigger",
        "SDV_FANOUT_REQUEST_TOPIC_PREFIX": f"{side}/{{VIN}}/proxy/request",
        "SDV_FANOUT_MQTT_CLIENTID_PREFIX": f"sdv-fanout-{side}-",
    }


def side_rule(side: str, version: str) -> dict[str, Any]:
    s = side_settings(side)
    cfg = Config(
        ack_topic_prefix=s["SDV_FANOUT_ACK_TOPIC_PREFIX"],
        batch_topic=s["SDV_FANOUT_BATCH_TOPIC"],
        data_topic_prefix=s["SDV_FANOUT_DATA_TOPIC_PREFIX"],
        trigger_topic=s["SDV_FANOUT_TRIGGER_TOPIC"],
        request_topic_prefix=s["SDV_FANOUT_REQUEST_TOPIC_PREFIX"],
        mqtt_clientid_prefix=s["SDV_FANOUT_MQTT_CLIENTID_PREFIX"],
    )
    body = rule_body(cfg, direct_dispatch=tuple(int(p) for p in version.split(".")[:2]) >= (5, 8))
    return {**body, "name": f"sdv-fanout-acks-{side}", "enable": False}


class AbRig:
    """The broker, both servers, their rules, the platform and the fleet; `close` stops all of it."""

    def __init__(self, args: argparse.Namespace, tmp: Path, vins: list[str]) -> None:
        self.args, self.tmp, self.vins = args, tmp, vins
        self.broker: EmqxBroker | None = None
        self.servers: dict[str, SubprocessServer] = {}
        self.pids: dict[str, list[int]] = {}
        self.stores: dict[str, Store] = {}
        self.rules: dict[str, str] = {}
        self.fleets: list[Child] = []
        self.platform: BatchPublisher | None = None

    def start(self, say: Any) -> None:
        args = self.args
        fleet_port = free_port()
        zone = {
            "EMQX_LISTENERS__TCP__FLEET__BIND": f"{LOOPBACK}:{fleet_port}",
            "EMQX_LISTENERS__TCP__FLEET__ZONE": "fleet",
            "EMQX_ZONES__FLEET__MQTT__MAX_INFLIGHT": "1",
        }
        self.broker = EmqxBroker(args.version, self.tmp / "emqx", env=zone).start()
        self.emqx_pids = descendants(self.broker.proc.pid)  # type: ignore[union-attr]
        base_tree = unpack_tree(args.base, self.tmp / "base-tree")
        for side in SIDES:
            env = {
                "SDV_FANOUT_MQTT_URL": self.broker.url,
                "SDV_FANOUT_PROCESSES": "1",
                **side_settings(side),
            }
            if side == "base":
                env["PYTHONPATH"] = str(base_tree)
            lmdb = self.tmp / f"lmdb-{side}"
            server = SubprocessServer(lmdb, "--log-level", args.log_level, env=env)
            self.servers[side] = server
            self.pids[side] = descendants(server.proc.pid)
            self.broker.register_exhook(f"sdv-fanout-{side}", f"http://{LOOPBACK}:{server.port}", pool_size=8)
            self.stores[side] = Store(lmdb, readonly=True)
            self.rules[side] = self.broker.api("POST", "/rules", side_rule(side, args.version))["id"]
        self.platform = BatchPublisher(self.broker.mqtt_port)
        procs = max(args.procs, -(-len(self.vins) // MAX_PER_PROC))
        for k in range(procs):
            argv = [*FLEET, "--role", "raw", "--mqtt-port", str(fleet_port), "--vins", ",".join(self.vins[k::procs])]
            argv += ["--prefix", ",".join(SIDES), "--clientid-prefix", "", "--timeout-s", str(args.deadline_s)]
            self.fleets.append(Child(f"fleet{k}", argv, self.tmp / f"fleet{k}.log"))
        for c in self.fleets:
            c.recv(args.deadline_s)
        quiesce([*self.pids["this"], *self.pids["base"], *self.emqx_pids], idle_share=0.1)
        say(f"EMQX {args.version} up; this and base ({args.base}) registered; {len(self.vins)} vehicles subscribed")

    def run(self, side: str, tag: str, seed: int, requests: int) -> dict[str, Any]:
        """One measurement of one side: its rule on, `requests` batches, until the fleet has all."""
        assert self.broker is not None and self.platform is not None
        rng = random.Random(seed)
        topic = side_settings(side)["SDV_FANOUT_BATCH_TOPIC"]
        size = self.args.payload_bytes
        payloads = [batch(self.vins, f"task_{tag}_{i}", rng.randbytes(size)) for i in range(requests)]
        self.broker.api("PUT", f"/rules/{self.rules[side]}", {"enable": True})
        try:
            arm_fleets(self.fleets, requests, self.args.deadline_s)
            meter = CpuMeter({"server": self.pids[side], "emqx": self.emqx_pids})
            threads0 = thread_cpu_s(self.pids[side])
            sys0 = stime_s(self.pids[side])
            t0 = self.platform.publish_all(topic, payloads, self.args.deadline_s)
            done = collect_fleets(self.fleets, len(self.vins) * requests, self.args.deadline_s)
            shares = meter.shares()
            threads = thread_cpu_s(self.pids[side])
            sys1 = stime_s(self.pids[side])
            self.settle()
        finally:
            self.broker.api("PUT", f"/rules/{self.rules[side]}", {"enable": False})
        n = sum(d["distinct"] for d in done)
        seconds = max(d["last_done"] for d in done) - t0
        mains = set(self.pids[side])
        return {
            "deliveries_per_s": n / seconds,
            "server_us": shares["server"] * meter.wall_s / n * 1e6,
            "emqx_us": shares["emqx"] * meter.wall_s / n * 1e6,
            "server_sys_us": (sys1 - sys0) / n * 1e6,  # of server_us: in the kernel (socket calls, fsync)
            # The event loop's thread (each process's main thread) and the rest (LMDB writer, gRPC).
            "server_loop_us": sum(c - threads0.get(t, 0.0) for t, c in threads.items() if t in mains) / n * 1e6,
            "server_threads_us": sum(c - threads0.get(t, 0.0) for t, c in threads.items() if t not in mains) / n * 1e6,
            "other_share": shares["other processes"],
            "duplicates": sum(d["count"] - d["distinct"] for d in done),
        }

    def settle(self) -> None:
        deadline = time.monotonic() + self.args.deadline_s
        while sum(pending_rows(s) for s in self.stores.values()):
            if time.monotonic() > deadline:
                raise RuntimeError("rows still pending")
            time.sleep(0.02)  # a progress poll with a deadline
        quiesce([*self.pids["this"], *self.pids["base"], *self.emqx_pids], idle_share=0.1)

    def profile(self, out: Path, say: Any) -> None:
        spy = Path(sys.executable).parent / "py-spy"
        if not spy.exists():
            raise SystemExit("py-spy is not installed: .venv/bin/pip install py-spy")
        cmd = [str(spy), "record", "--rate", "500", "--format", "raw", "--nonblocking", "-o", str(out)]
        proc = subprocess.Popen([*cmd, "--pid", str(self.servers["this"].proc.pid)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            time.sleep(1.0)  # py-spy attaches
            # As measured (the same queue lengths: a queue's scan grows with it), a few times over.
            for k in range(4):
                res = self.run("this", f"prof{k}", self.args.seed + 99 + k, self.args.requests)
        finally:
            proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            proc.wait(60)
        say(f"profiled this: {res['deliveries_per_s']:,.0f} deliveries/s under py-spy: {out}")

    def close(self) -> None:
        close_rig(self.fleets, self.platform, self.stores, self.broker, self.servers)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="main", help="git revision to compare with (default main)")
    p.add_argument("--version", default="5.8.9", help="EMQX version (default 5.8.9)")
    p.add_argument("--vehicles", type=int, default=500)
    p.add_argument("--procs", type=int, default=2, help="fleet processes (<= 300 vehicles each)")
    p.add_argument("--requests", type=int, default=6, help="batches (requests per vehicle) per measurement")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--payload-bytes", type=int, default=256)
    p.add_argument("--deadline-s", type=float, default=120)
    p.add_argument("--seed", type=int, default=20261129)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--profile", metavar="PATH", help="also py-spy 'this' (raw format) in one more run")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if find_release(args.version) is None:
        p.error(f"no EMQX release for {args.version}")
    ctx = Run("delivery-ab")
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    vins = make_vins(args.seed, args.vehicles)
    rounds: list[dict[str, Any]] = []
    with ctx.keeping(False, "EMQX, server and fleet logs, LMDB"):
        rig = AbRig(args, ctx.tmp, vins)
        try:
            rig.start(ctx.say)
            for side in SIDES:
                rig.run(side, f"warm{side}", args.seed, 1)
            for r in range(args.rounds):
                order = SIDES if r % 2 == 0 else SIDES[::-1]
                res: dict[str, Any] = {"order": " → ".join(order)}
                for i, side in enumerate(order):
                    res[side] = rig.run(side, f"r{r}{side}", args.seed + 100 * r + i, args.requests)
                res["ratio_us"] = res["this"]["server_us"] / res["base"]["server_us"]
                rounds.append(res)
                this, base = res["this"], res["base"]
                ctx.say(
                    f"round {r + 1}/{args.rounds} ({res['order']}): server µs/delivery this {this['server_us']:.0f}"
                    f" ({this['server_loop_us']:.0f} loop) base {base['server_us']:.0f} ({base['server_loop_us']:.0f}"
                    f" loop) (x{res['ratio_us']:.2f}); deliveries/s this {this['deliveries_per_s']:,.0f}"
                    f" base {base['deliveries_per_s']:,.0f}"
                )
            if args.profile:
                rig.profile(Path(args.profile), ctx.say)
        finally:
            rig.close()

    def med(side: str, key: str) -> float:
        return statistics.median(r[side][key] for r in rounds)

    ratios = sorted(r["ratio_us"] for r in rounds)
    summary = {
        "server_us": {s: med(s, "server_us") for s in SIDES},
        "emqx_us": {s: med(s, "emqx_us") for s in SIDES},
        "server_loop_us": {s: med(s, "server_loop_us") for s in SIDES},
        "server_threads_us": {s: med(s, "server_threads_us") for s in SIDES},
        "server_sys_us": {s: med(s, "server_sys_us") for s in SIDES},
        "deliveries_per_s": {s: med(s, "deliveries_per_s") for s in SIDES},
        "ratio_us": {"min": ratios[0], "median": statistics.median(ratios), "max": ratios[-1]},
        "duplicates": sum(r[s]["duplicates"] for r in rounds for s in SIDES),
        **ctx.meta(),
    }
    us, loop, rest = summary["server_us"], summary["server_loop_us"], summary["server_threads_us"]
    rate, emqx = summary["deliveries_per_s"], summary["emqx_us"]
    print(
        f"server CPU µs/delivery (medians of {args.rounds} paired rounds, EMQX {args.version}, "
        f"{args.vehicles} vehicles x {args.requests}): this {us['this']:.0f}, base {args.base} {us['base']:.0f}"
        f" (event loop thread: this {loop['this']:.0f}, base {loop['base']:.0f}; other threads: this"
        f" {rest['this']:.0f}, base {rest['base']:.0f}; in the kernel: this {summary['server_sys_us']['this']:.0f},"
        f" base {summary['server_sys_us']['base']:.0f}); this/base paired {ratios[0]:.2f} /"
        f" {summary['ratio_us']['median']:.2f} / {ratios[-1]:.2f}; deliveries/s this {rate['this']:,.0f} base"
        f" {rate['base']:,.0f}; EMQX µs/delivery this {emqx['this']:.0f} base {emqx['base']:.0f};"
        f" duplicates {summary['duplicates']}; load average {summary['loadavg_1m_before']:.1f} before,"
        f" {summary['loadavg_1m_after']:.1f} after"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary, "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
