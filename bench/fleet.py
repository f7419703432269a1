"""The strict reference of vehicle events over MQTT: our provisioned default against raw EMQX, same fleet.

    .venv/bin/python -m bench.fleet [--versions 5.8.9,5.9.1] [--vehicles 1000] [--requests 5] [--rounds 5]

Per EMQX version, one broker, one `sdv-fanout serve` (LMDB, the default processes) provisioned by
`sdv-fanout emqx sync` with the EMQX API configured (vehicle_events = auto: mqtt), and one fleet
process: every vehicle on one asyncio loop (testkit/vehicle.py), PUBACKing each
delivery at once. Paired rounds, alternating:

* raw: one publisher process sends each vehicle its next message when that vehicle's PUBACK
  went out (the fleet tells it over a pipe, not through the broker), QoS 1, a window of 32; our
  ack rule is disabled meanwhile and EMQX's ExHook metrics show no call of ours during the round;
* ours: the platform publishes `--requests` batches naming every vehicle; counted from the
  first batch publish until the fleet holds every delivery (ingest included).

Then CPU per heartbeat (EMQX + server, utime+stime from /proc; once the server is quiet after the
delivery rounds, its idle CPU reported apart) against raw EMQX routing the same
heartbeats to one plain subscriber (measured before our server exists), and a heartbeat's
publish -> PUBACK with the server running and SIGSTOPped. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from testkit.mqtt import connect
from testkit.vehicle import Delivery, Vehicle

WINDOW = 1000  # unacknowledged QoS 1 publishes of the raw publisher at most


def vins_of(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:05d}" for i in range(n)]


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _commands() -> Any:
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        yield json.loads(line)


# -- the fleet process -----------------------------------------------------------------------------


async def fleet_main(args: argparse.Namespace) -> None:
    vins = vins_of(args.prefix, args.vehicles)
    signal_fd = args.signal_fd
    state: dict[str, Any] = {"armed": 0, "got": 0, "last": 0.0, "signal": False, "seen": set(), "dups": 0}
    order_ok = [True]
    last_rid: dict[str, str] = {}
    done = asyncio.Event()
    beat_lat: list[float] = []

    def on_delivery(vin: str) -> Any:
        def handle(d: Delivery) -> None:
            key = (vin, d.request_id)
            if key in state["seen"]:
                state["dups"] += 1
            state["seen"].add(key)
            if last_rid.get(vin, "") > d.request_id:
                order_ok[0] = False
            last_rid[vin] = d.request_id
            if state["signal"]:
                os.write(signal_fd, (vin + "\n").encode())
            state["got"] += 1
            if state["got"] >= state["armed"]:
                state["last"] = time.time()
                done.set()

        return handle

    async def beat(v: Vehicle) -> None:
        sent = time.perf_counter()
        await v.aheartbeat("heartbeat")
        beat_lat.append(time.perf_counter() - sent)

    vehicles = [Vehicle(args.port, vin) for vin in vins]
    for v in vehicles:
        v.on_delivery = on_delivery(v.vin)
        await v.aonline()
    _emit({"ready": len(vehicles)})
    async for cmd in _commands():
        if cmd["cmd"] == "expect":
            state.update(armed=cmd["n"], got=0, signal=cmd.get("signal", False), seen=set(), dups=0)
            order_ok[0] = True
            last_rid.clear()
            done.clear()
            _emit({"armed": True})
            await asyncio.wait_for(done.wait(), cmd.get("deadline_s", 300))
            _emit({"done": {"last": state["last"], "dups": state["dups"], "in_order": order_ok[0]}})
        elif cmd["cmd"] == "beats":  # `n` heartbeats spread over the fleet at `rate` per second
            beat_lat.clear()
            started = time.perf_counter()
            beats = []
            for k in range(cmd["n"]):
                delay = started + k / cmd["rate"] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                beats.append(asyncio.create_task(beat(vehicles[k % len(vehicles)])))
            await asyncio.wait_for(asyncio.gather(*beats), 120)
            lat = sorted(beat_lat)
            _emit(
                {
                    "beats": {
                        "n": len(lat),
                        "p50_ms": lat[len(lat) // 2] * 1e3,
                        "p99_ms": lat[int(len(lat) * 0.99)] * 1e3,
                    }
                }
            )
        elif cmd["cmd"] == "quit":
            break


# -- the raw publisher process -----------------------------------------------------------------------


async def raw_main(args: argparse.Namespace) -> None:
    vins = vins_of(args.prefix, args.vehicles)
    pub = await connect(args.port, "raw-publisher")
    free = asyncio.Semaphore(WINDOW)
    queue: asyncio.Queue[str] = asyncio.Queue()
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(args.signal_fd, "rb", 0))

    async def signals() -> None:
        while line := await reader.readline():
            queue.put_nowait(line.decode().strip())

    pump = asyncio.create_task(signals())
    _emit({"ready": 1})
    async for cmd in _commands():
        if cmd["cmd"] != "run":
            break
        nxt = dict.fromkeys(vins, 0)
        payload = b"x" * cmd.get("payload_bytes", 64)
        for vin in vins:
            queue.put_nowait(vin)
        sent, total = 0, len(vins) * cmd["requests"]
        while sent < total:
            vin = await queue.get()
            k = nxt[vin]
            if k >= cmd["requests"]:
                continue
            nxt[vin] = k + 1
            await free.acquire()
            acked = pub.publish(f"agent/{vin}/proxy/request/{cmd['round']}-{k:04d}", payload)
            assert acked is not None
            acked.add_done_callback(lambda _f: free.release())
            sent += 1
        _emit({"sent": sent})
    pump.cancel()


# -- the driver ----------------------------------------------------------------------------------------


def cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total


def settle(pids: Callable[[], list[int]], quiet: float = 0.03, within_s: float = 30.0, span_s: float = 3.0) -> float:
    """Wait (at most `within_s`) until the processes use less than `quiet` of a core over a second;
    then their CPU over `span_s`, in ms per second (what they cost doing nothing)."""
    tck = os.sysconf("SC_CLK_TCK")
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        t0 = cpu_ticks(pids())
        time.sleep(1.0)
        if (cpu_ticks(pids()) - t0) / tck < quiet:
            break
    t0 = cpu_ticks(pids())
    time.sleep(span_s)
    return (cpu_ticks(pids()) - t0) / tck / span_s * 1000


class Child:
    """A role of this file in its own process, spoken to in JSON lines."""

    def __init__(self, role: str, *extra: str, pass_fds: tuple[int, ...] = ()) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.fleet", role, *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            pass_fds=pass_fds,
        )

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench.fleet child exited ({self.proc.poll()})")
        out: dict[str, Any] = json.loads(line)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def run_version(version: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from testkit.emqx_real import _descendants, running_emqx
    from testkit.emqx_sim import free_port
    from testkit.harness import BIN, SubprocessServer, poll

    out: dict[str, Any] = {"version": version}
    n, reqs = args.vehicles, args.requests
    with running_emqx(version, workdir) as broker:
        emqx_pids = [broker.proc.pid, *(p for p, _ in _descendants(broker.proc.pid))] if broker.proc else []
        read_fd, write_fd = os.pipe()
        fleet = Child("fleet", "--port", str(broker.mqtt_port), "--vehicles", str(n), "--signal-fd", str(write_fd),
                      pass_fds=(write_fd,))  # fmt: skip
        raw = Child("raw", "--port", str(broker.mqtt_port), "--vehicles", str(n), "--signal-fd", str(read_fd),
                    pass_fds=(read_fd,))  # fmt: skip
        srv = None
        plain = None
        try:
            fleet.read(), raw.read()
            # CPU per heartbeat, raw: EMQX routing the fleet's heartbeats to one plain subscriber.
            plain = subprocess.Popen(
                [sys.executable, "-c", _PLAIN_SUBSCRIBER, str(broker.mqtt_port)], stdout=subprocess.PIPE, text=True
            )
            assert plain.stdout is not None and plain.stdout.readline().strip() == "ready"
            raw_cpu = []
            for _ in range(args.rounds):
                t0 = cpu_ticks(emqx_pids)
                fleet.send(cmd="beats", n=args.beats, rate=args.beat_rate)
                fleet.read()
                raw_cpu.append((cpu_ticks(emqx_pids) - t0) / os.sysconf("SC_CLK_TCK") / args.beats * 1e6)
            plain.kill()
            plain.wait(10)

            key, secret = broker.create_api_key("bench-fleet")
            port = free_port()
            env = {
                "SDV_FANOUT_MQTT_URL": broker.url,
                "SDV_FANOUT_EMQX_API_URL": f"http://127.0.0.1:{broker.api_port}",
                "SDV_FANOUT_EMQX_API_KEY": key,
                "SDV_FANOUT_EMQX_API_SECRET": secret,
                "SDV_FANOUT_EMQX_EXHOOK_URL": f"http://127.0.0.1:{port}",
                "SDV_FANOUT_LOG_LEVEL": "warning",
                **({"SDV_FANOUT_PROCESSES": str(args.processes)} if args.processes else {}),
            }
            srv = SubprocessServer(workdir / "lmdb", "--listen", f"127.0.0.1:{port}", env=env)
            sync = subprocess.run([str(BIN / "sdv-fanout"), "emqx", "sync"], env={**os.environ, **env},
                                  capture_output=True, text=True, timeout=60)  # fmt: skip
            assert sync.returncode == 0, sync.stdout + sync.stderr
            poll(lambda: broker.api("GET", "/exhooks/sdv-fanout")["node_status"][0]["status"] == "connected", 30)
            rule = next(r["id"] for r in broker.api("GET", "/rules")["data"] if r["name"] == "sdv-fanout-acks")
            server_pids = lambda: [srv.proc.pid, *(p for p, _ in _descendants(srv.proc.pid))]  # noqa: E731
            platform = Child("platform", "--port", str(broker.mqtt_port), "--vehicles", str(n))
            platform.read()
            # The fleet connected before the server existed: its heartbeats (over MQTT) say it is online.
            fleet.send(cmd="beats", n=n, rate=args.beat_rate)
            fleet.read()
            poll(lambda: broker.api("GET", "/exhooks/sdv-fanout") is not None, 5)

            def exhook_calls() -> int:
                metrics = broker.api("GET", "/exhooks/sdv-fanout")["metrics"]
                return int(metrics.get("succeed", 0)) + int(metrics.get("failed", 0))

            rates: dict[str, list[float]] = {"raw": [], "ours": []}
            checks: list[dict[str, Any]] = []
            for r in range(args.rounds):
                # raw: our rule off, no ExHook call of ours expected
                broker.api("PUT", f"/rules/{rule}", {"enable": False})
                calls = exhook_calls()
                fleet.send(cmd="expect", n=n * reqs, signal=True)
                fleet.read()
                t0 = time.time()
                raw.send(cmd="run", round=f"raw{r:02d}", requests=reqs)
                raw.read()
                done = fleet.read()["done"]
                rates["raw"].append(n * reqs / (done["last"] - t0))
                checks.append({"arm": "raw", "round": r, **done, "exhook_calls": exhook_calls() - calls})
                broker.api("PUT", f"/rules/{rule}", {"enable": True})
                # ours: batches from the platform, counted from the first publish
                fleet.send(cmd="expect", n=n * reqs, signal=False)
                fleet.read()
                t0 = time.time()
                platform.send(cmd="batches", round=f"ours{r:02d}", requests=reqs)
                platform.read()
                done = fleet.read()["done"]
                rates["ours"].append(n * reqs / (done["last"] - t0))
                checks.append({"arm": "ours", "round": r, **done})
            out["deliveries_per_s"] = {k: statistics.median(v) for k, v in rates.items()}
            out["deliveries_ratio"] = out["deliveries_per_s"]["ours"] / out["deliveries_per_s"]["raw"]
            out["rounds"] = rates
            out["checks"] = checks

            # The delivery rounds leave work behind (housekeeping, latencies, progress): wait until
            # the server is quiet, so the heartbeat rounds measure heartbeats, then its idle cost.
            out["server_idle_cpu_ms_per_s"] = settle(server_pids)
            ours_cpu, server_cpu = [], []
            per_beat = 1e6 / os.sysconf("SC_CLK_TCK") / args.beats
            for _ in range(args.rounds):
                e0, s0 = cpu_ticks(emqx_pids), cpu_ticks(server_pids())
                fleet.send(cmd="beats", n=args.beats, rate=args.beat_rate)
                fleet.read()
                server = cpu_ticks(server_pids()) - s0
                ours_cpu.append((cpu_ticks(emqx_pids) - e0 + server) * per_beat)
                server_cpu.append(server * per_beat)
            out["cpu_us_per_heartbeat"] = {
                "raw": statistics.median(raw_cpu),
                "ours": statistics.median(ours_cpu),
                "ours_server_only": statistics.median(server_cpu),
            }
            out["cpu_ratio"] = out["cpu_us_per_heartbeat"]["ours"] / out["cpu_us_per_heartbeat"]["raw"]

            latency: dict[str, list[float]] = {"running": [], "stopped": []}
            for _ in range(args.rounds):
                for state in ("running", "stopped"):
                    pids = server_pids()
                    if state == "stopped":
                        for pid in pids:
                            os.kill(pid, signal.SIGSTOP)
                    try:
                        fleet.send(cmd="beats", n=200, rate=200)
                        latency[state].append(fleet.read()["beats"]["p50_ms"])
                    finally:
                        if state == "stopped":
                            for pid in pids:
                                os.kill(pid, signal.SIGCONT)
            out["heartbeat_puback_p50_ms"] = {k: statistics.median(v) for k, v in latency.items()}
            platform.stop()
        finally:
            for child in (fleet, raw):
                child.stop()
            if plain is not None and plain.poll() is None:
                plain.kill()
            if srv is not None:
                srv.terminate()
            os.close(read_fd)
            os.close(write_fd)
    return out


_PLAIN_SUBSCRIBER = """
import asyncio, sys
from testkit.mqtt import connect
async def main():
    c = await connect(int(sys.argv[1]), "plain-subscriber")
    await c.subscribe([("ecp/+/heartbeat", 0)])
    print("ready", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


async def platform_main(args: argparse.Namespace) -> None:
    vins = vins_of(args.prefix, args.vehicles)
    pub = await connect(args.port, "sdv-platform-bench")
    _emit({"ready": 1})
    async for cmd in _commands():
        for k in range(cmd["requests"]):
            doc = {"ids": vins, "request_id": f"task_{cmd['round']}_{k:04d}", "data": "x" * 64}
            acked = pub.publish("$SDV-FANOUT", json.dumps(doc).encode())
            assert acked is not None
            await acked
        _emit({"published": cmd["requests"]})


def markdown(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The figures as a table: medians over the rounds, ratios ours / reference."""
    lines = [
        f"{args.vehicles} vehicles x {args.requests} requests per round, {args.rounds} paired rounds;"
        f" {args.beats} heartbeats per CPU round at {args.beat_rate:.0f}/s.",
        "",
        "| EMQX | raw deliveries/s | ours | ratio | CPU µs/heartbeat: raw | ours | ratio | of which the server"
        " | server idle, CPU ms/s | heartbeat PUBACK p50: server running | SIGSTOPped |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        d, c, h = r["deliveries_per_s"], r["cpu_us_per_heartbeat"], r["heartbeat_puback_p50_ms"]
        lines.append(
            f"| {r['version']} | {d['raw']:,.0f} | {d['ours']:,.0f} | {r['deliveries_ratio']:.2f}x"
            f" | {c['raw']:.0f} | {c['ours']:.0f} | {r['cpu_ratio']:.2f}x | {c['ours_server_only']:.0f}"
            f" | {r['server_idle_cpu_ms_per_s']:.1f}"
            f" | {h['running']:.2f} ms | {h['stopped']:.2f} ms |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", nargs="?", default="bench", choices=["bench", "fleet", "raw", "platform"])
    p.add_argument("--versions", default="5.8.9,5.9.1")
    p.add_argument("--vehicles", type=int, default=1000)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    # 10 s rounds: long against the server's periodic work (a tick every 50 ms, housekeeping every second).
    p.add_argument("--beats", type=int, default=20000, help="heartbeats per CPU round")
    p.add_argument("--beat-rate", type=float, default=2000.0, help="heartbeats per second")
    p.add_argument("--processes", type=int, default=0, help="server processes (0: the server's default)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--prefix", default="BENCHVIN")
    p.add_argument("--signal-fd", type=int, default=-1)
    p.add_argument("--json", default="", help="also write the results here as JSON")
    args = p.parse_args()
    if args.role != "bench":
        role = {"fleet": fleet_main, "raw": raw_main, "platform": platform_main}[args.role]
        asyncio.run(role(args))
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        for version in args.versions.split(","):
            results.append(run_version(version, args, Path(tmp) / version))
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=1) + "\n")
    print(markdown(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
