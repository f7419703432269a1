"""The strict reference of vehicle events over MQTT: our provisioned default against raw EMQX, same fleet.

    .venv/bin/python -m bench.fleet [--versions 5.8.9,5.9.1] [--vehicles 1000] [--requests 5] [--rounds 5]

Per EMQX version, one broker, one `sdv-fanout serve` (LMDB, the default processes) provisioned by
`sdv-fanout emqx sync` with the EMQX API configured (vehicle_events = auto: mqtt), and one fleet
process: every vehicle on one asyncio loop (a minimal MQTT 5 client below), PUBACKing each
delivery at once. Paired rounds, alternating:

* raw: one publisher process sends each vehicle its next message when that vehicle's PUBACK
  went out (the fleet tells it over a pipe, not through the broker), QoS 1, a window of 32; our
  ack rule is disabled meanwhile and EMQX's ExHook metrics show no call of ours during the round;
* ours: the platform publishes `--requests` batches naming every vehicle; counted from the
  first batch publish until the fleet holds every delivery (ingest included).

Then CPU per heartbeat (EMQX + server, utime+stime from /proc) against raw EMQX routing the same
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
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WINDOW = 1000  # unacknowledged QoS 1 publishes of the raw publisher at most


# -- a minimal MQTT 5 client (QoS 0/1, no keepalive, no properties) ------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n % 128, n // 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("!H", len(raw)) + raw


def _packet(kind: int, body: bytes) -> bytes:
    return bytes([kind]) + _varint(len(body)) + body


class Mqtt(asyncio.Protocol):
    """One MQTT 5 connection: `on_publish(topic, payload)` per message (QoS 1 PUBACKed at once),
    `on_puback(pid)` per PUBACK of ours."""

    def __init__(self, clientid: str, username: str = "") -> None:
        self.clientid, self.username = clientid, username
        self.on_publish: Any = None
        self.on_puback: Any = None
        self._buf = b""
        self._pid = 0
        self.connected = asyncio.get_running_loop().create_future()
        self.subacked: asyncio.Future[None] | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        flags = 0x02 | (0x80 if self.username else 0)
        body = _s("MQTT") + bytes([5, flags]) + struct.pack("!H", 0) + b"\x00" + _s(self.clientid)
        if self.username:
            body += _s(self.username)
        transport.write(_packet(0x10, body))

    def next_pid(self) -> int:
        self._pid = self._pid % 65535 + 1
        return self._pid

    def subscribe(self, filters: list[tuple[str, int]]) -> asyncio.Future[None]:
        self.subacked = asyncio.get_running_loop().create_future()
        body = struct.pack("!H", self.next_pid()) + b"\x00" + b"".join(_s(f) + bytes([q]) for f, q in filters)
        assert self.transport is not None
        self.transport.write(_packet(0x82, body))
        return self.subacked

    def publish(self, topic: str, payload: bytes, qos: int = 1) -> int:
        pid = self.next_pid() if qos else 0
        body = _s(topic) + (struct.pack("!H", pid) if qos else b"") + b"\x00" + payload
        assert self.transport is not None
        self.transport.write(_packet(0x30 | qos << 1, body))
        return pid

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data
        pos, end = 0, len(buf)
        while pos + 2 <= end:
            length, shift, i = 0, 0, pos + 1
            while i < end:
                byte = buf[i]
                length |= (byte & 0x7F) << shift
                i += 1
                if not byte & 0x80:
                    break
                shift += 7
            else:
                break
            if i + length > end:
                break
            self._handle(buf[pos], buf[i : i + length])
            pos = i + length
        self._buf = buf[pos:]

    def _handle(self, kind: int, body: bytes) -> None:
        t = kind & 0xF0
        if t == 0x30:
            n = struct.unpack_from("!H", body)[0]
            topic = body[2 : 2 + n].decode()
            pos = 2 + n
            if kind & 0x06:
                pid = body[pos : pos + 2]
                pos += 2
                assert self.transport is not None
                self.transport.write(b"\x40\x02" + pid)
            plen = body[pos]  # properties: shorter than 128 bytes here
            self.on_publish(topic, body[pos + 1 + plen :])
        elif t == 0x40 and self.on_puback is not None:
            self.on_puback(struct.unpack_from("!H", body)[0])
        elif t == 0x20 and not self.connected.done():
            self.connected.set_result(body[1] == 0)
        elif t == 0x90 and self.subacked is not None and not self.subacked.done():
            self.subacked.set_result(None)


async def connect(port: int, clientid: str, username: str = "") -> Mqtt:
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_connection(lambda: Mqtt(clientid, username), "127.0.0.1", port)
    assert await proto.connected, f"{clientid}: CONNACK refused"
    return proto


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
    beat_sent: dict[tuple[int, int], float] = {}
    beat_lat: list[float] = []
    beats_done = asyncio.Event()

    def on_delivery(vin: str) -> Any:
        def handle(topic: str, payload: bytes) -> None:
            rid = topic.rsplit("/", 1)[1]
            key = (vin, rid)
            if key in state["seen"]:
                state["dups"] += 1
            state["seen"].add(key)
            if last_rid.get(vin, "") > rid:
                order_ok[0] = False
            last_rid[vin] = rid
            if state["signal"]:
                os.write(signal_fd, (vin + "\n").encode())
            state["got"] += 1
            if state["got"] >= state["armed"]:
                state["last"] = time.time()
                done.set()

        return handle

    clients = []
    for i, vin in enumerate(vins):
        c = await connect(args.port, vin)
        c.on_publish = on_delivery(vin)

        def on_puback(pid: int, i: int = i) -> None:
            sent = beat_sent.pop((i, pid), None)
            if sent is not None:
                beat_lat.append(time.perf_counter() - sent)
                if not beat_sent:
                    beats_done.set()

        c.on_puback = on_puback
        await c.subscribe([(f"agent/{vin}/proxy/request/+", 1)])
        clients.append(c)
    _emit({"ready": len(clients)})
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
            beats_done.clear()
            started = time.perf_counter()
            for k in range(cmd["n"]):
                i = k % len(clients)
                delay = started + k / cmd["rate"] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                pid = clients[i].publish(f"ecp/{vins[i]}/heartbeat", b"{}")
                beat_sent[(i, pid)] = time.perf_counter()
            await asyncio.wait_for(beats_done.wait(), 120)
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
    pub.on_puback = lambda pid: free.release()
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
            pub.publish(f"agent/{vin}/proxy/request/{cmd['round']}-{k:04d}", payload)
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
from bench.fleet import connect
async def main():
    c = await connect(int(sys.argv[1]), "plain-subscriber")
    c.on_publish = lambda t, p: None
    await c.subscribe([("ecp/+/heartbeat", 0)])
    print("ready", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


async def platform_main(args: argparse.Namespace) -> None:
    vins = vins_of(args.prefix, args.vehicles)
    pub = await connect(args.port, "sdv-platform-bench")
    acked: dict[int, asyncio.Future[None]] = {}
    pub.on_puback = lambda pid: acked.pop(pid).set_result(None)
    _emit({"ready": 1})
    async for cmd in _commands():
        for k in range(cmd["requests"]):
            doc = {"ids": vins, "request_id": f"task_{cmd['round']}_{k:04d}", "data": "x" * 64}
            pid = pub.publish("$SDV-FANOUT", json.dumps(doc).encode())
            acked[pid] = asyncio.get_running_loop().create_future()
            await acked[pid]
        _emit({"published": cmd["requests"]})


def markdown(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The figures as a table: medians over the rounds, ratios ours / reference."""
    lines = [
        f"{args.vehicles} vehicles x {args.requests} requests per round, {args.rounds} paired rounds;"
        f" {args.beats} heartbeats per CPU round at {args.beat_rate:.0f}/s.",
        "",
        "| EMQX | raw deliveries/s | ours | ratio | CPU µs/heartbeat: raw | ours | ratio"
        " | heartbeat PUBACK p50: server running | SIGSTOPped |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        d, c, h = r["deliveries_per_s"], r["cpu_us_per_heartbeat"], r["heartbeat_puback_p50_ms"]
        lines.append(
            f"| {r['version']} | {d['raw']:,.0f} | {d['ours']:,.0f} | {r['deliveries_ratio']:.2f}x"
            f" | {c['raw']:.0f} | {c['ours']:.0f} | {r['cpu_ratio']:.2f}x"
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
    p.add_argument("--beats", type=int, default=5000, help="heartbeats per CPU round")
    p.add_argument("--beat-rate", type=float, default=2000.0, help="heartbeats per second")
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
