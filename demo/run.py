"""`make demo`: sdv-fanout working end to end on one machine, in about half a minute.

What runs (all on 127.0.0.1, all stopped at the end, also on Ctrl-C):

* a broker (demo/brokers.py): the real **EMQX** when a release is at hand (5.8.9 first), which
  calls the server's hooks itself; else a real **mosquitto** with testkit/emqx_sim.py playing
  EMQX's ExHook side. `--broker auto|emqx|sim` chooses; the first lines say which runs;
* the real server, `sdv-fanout serve` (`--processes`, default one per CPU), as a child process
  with delivery enabled to that broker;
* a **fleet** of real MQTT 5 vehicles in a few child processes (demo/fleet.py): each
  connects and subscribes to `agent/<VIN>/proxy/request/+`, takes a little time before each
  PUBACK, heartbeats now and then; some come online late, some drop and reconnect clean, some
  drop before their PUBACK and resume their persistent session; most answer the requests that
  await an answer on `agent/<VIN>/proxy/response/<request_id>`, the others never do;
* a **platform** (this process) publishing fan-out batches on `$SDV-FANOUT`, each with a
  `batch_id` and a `correlation_id` (a few re-sent on purpose with the same `batch_id`, one bad
  batch; diagnostics with `await_response: true`; one campaign it cancels on
  `$SDV-FANOUT/cancel` while it is delivered; one request with an `expires_at` that passes
  while its vehicles are offline), and listening on `$SDV-FANOUT/status/#` as a platform would
  (demo/platform.py);
* after it, a campaign-control act (demo/campaigns.py): a paced campaign, one aborted by failing
  vehicles, one waiting for its window, a high-priority recall overtaking a queued update.

Live progress comes from the vehicles (what they received and acknowledged), from the server's
LMDB, opened read-only while the server runs (rows still pending), and from the status topic
(receipts per batch, progress and `completed` per generation, the vehicles' answers, what the
cancel stopped). The run ends when every row has its outcome and the status topic has said so,
or at the deadline; then a summary. Exit code 0 when every row reached its own vehicle with its
latest payload (but the cancelled and the expired ones), none is left in LMDB, no vehicle ever had
more than one request in flight, every batch got exactly one receipt, every generation reported
`completed` with the counts the vehicles and the platform made (delivered, superseded,
responded, failed, cancelled, expired), every answer was relayed with its payload, nobody got the
cancelled request after its `cancelled` event nor the expired one at all, and the server shut
down cleanly; 1 otherwise. demo/README.md explains the scenario and the numbers.

    .venv/bin/python -m demo.run [--vehicles 200 --batches 36 --interval 0.75 --seed 7 --keep]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import structlog

from demo import campaigns
from demo.brokers import BATCH_TOPIC, CANCEL_TOPIC, Broker, Choice, batch_payload, cancel_payload, choose, make_broker
from demo.fleet import sha16
from demo.platform import (
    STATUS_FILTER,
    Cancel,
    FleetFacts,
    Generation,
    Heard,
    Sent,
    StatusFeed,
    StatusView,
    check_cancel,
    check_expiry,
    check_generations,
    check_receipts,
    check_responses,
)
from exhook_server.config import Config
from storage.lmdb.store import Store
from testkit.emqx_real import EmqxError
from testkit.emqx_sim import LOOPBACK
from testkit.vehicle import REQUEST_PREFIX, RESPONSE_PREFIX

ROOT = Path(__file__).resolve().parent.parent
VIN_FORMAT = "SDVDEMO{:010d}"  # 17 characters, like a real VIN
#: Batches numbered n with n % RETRY_EVERY == RETRY_AT are sent a second time with their batch_id.
RETRY_EVERY, RETRY_AT = 9, 3
#: Generations shown under the status line on a terminal.
SHOWN_GENERATIONS = 4
#: Diagnostics whose result the platform needs: their batches carry `await_response: true`. Half
#: of them, so that the vehicles that never answer (response_timeout_s each) keep the run short.
AWAITED_DIAGS = ("read_dtc all", "battery_health")
#: The expiring request's `expires_at` is this long after its publish ("a few seconds ahead").
EXPIRES_IN_S = 2.0
#: Its vehicles (the late ones) come online this long after it expired, at the earliest.
EXPIRY_MARGIN_S = 1.0
#: The server's `expiry_sweep_interval_s` in the demo: expired rows end soon after `expires_at`.
EXPIRY_SWEEP_S = 0.25


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# =============================================================================================
# The demo: scenario, processes, live progress, summary
# =============================================================================================


@dataclass
class Batch:
    n: int
    kind: str
    request_id: str
    vins: list[str]
    data: str | bytes
    label: str
    replaces: bool = False
    await_response: bool = False  # the vehicle's answer ends each pair, not its PUBACK
    cancelled: bool = False  # the platform cancels it while it is delivered
    expires_in_s: float | None = None  # `expires_at` this long after the publish

    @property
    def checked_apart(self) -> bool:
        """Cancelled or expiring: not every row reaches its vehicle, and it has checks of its own."""
        return self.cancelled or self.expires_in_s is not None

    @property
    def payload(self) -> bytes:
        """What each vehicle receives: the UTF-8 of `data`, or the bytes (sent base64)."""
        return self.data if isinstance(self.data, bytes) else self.data.encode()

    @property
    def sha1(self) -> str:
        return hashlib.sha1(self.payload, usedforsecurity=False).hexdigest()

    @property
    def batch_id(self) -> str:
        """The platform's id for this batch: a retry carries the same one, and stores nothing."""
        return f"batch-{self.n:03d}" if self.n else f"batch-{self.kind}"


@dataclass
class Send:
    """One publish of the platform: a batch, a retry of one (same batch_id), or the bad batch."""

    at: float  # seconds into the run
    batch: Batch
    retry: bool = False
    bad: bool = False
    cancel: bool = False  # not the batch: `{"request_id"}` on the cancel topic

    @property
    def correlation_id(self) -> str:
        """Echoed in every status message about this publish (a retry has its own)."""
        suffix = "-retry" if self.retry else "-cancel" if self.cancel else ""
        return f"corr-{self.batch.batch_id.removeprefix('batch-')}" + suffix


def bad_batch(vins: list[str]) -> Batch:
    """A platform bug: one VIN with a '/' (a topic level separator) rejects the whole batch."""
    return Batch(0, "bad", "task_bad_1", [*vins[:3], "SDVDEMO/000000000"], "read_dtc all", "a VIN with a '/'")


def rollout_batch(vins: list[str]) -> Batch:
    """A campaign to the whole fleet that the platform cancels while it is being delivered."""
    data = json.dumps({"feature": "eco_routing", "enabled": True}, sort_keys=True)
    return Batch(0, "rollout", "task_rollout_1", list(vins), data, "feature flag rollout", cancelled=True)


def locate_batch(vins: list[str]) -> Batch:
    """A request worth nothing a few seconds later, to vehicles that are offline until after that."""
    label = f"location request, expires_at {EXPIRES_IN_S:g} s ahead"
    return Batch(0, "locate", "task_locate_1", list(vins), "report_location", label, expires_in_s=EXPIRES_IN_S)


def plan_sends(batches: list[Batch], bad: Batch, interval: float) -> list[Send]:
    """Batch i at i * interval; a retry of every RETRY_EVERY-th batch (the same batch_id, as a
    platform re-sends a batch whose receipt it has not seen) and the bad batch between two batches."""
    sends = [Send(i * interval, b) for i, b in enumerate(batches)]
    sends += [Send((b.n + 0.5) * interval, b, retry=True) for b in batches if b.n % RETRY_EVERY == RETRY_AT]
    sends.append(Send((len(batches) // 2 + 0.5) * interval, bad, bad=True))
    return sorted(sends, key=lambda s: s.at)


def plan_batches(rng: random.Random, vins: list[str], count: int) -> list[Batch]:
    """A platform's day, deterministic for a seed: OTA campaigns by region (one firmware image
    shared by two request ids), config pushes and diagnostics (half of them awaiting the vehicle's
    answer) to subsets (a few payloads shared by many batches), and every 7th batch re-sends an
    earlier request id with new data."""
    # 24 KiB each: delta updates, not whole images, so that the demo stays light on a laptop.
    firmware = {ver: rng.randbytes(24 * 1024) for ver in ("4.2.0", "4.2.1", "4.3.0")}
    configs = [
        json.dumps({"telemetry_interval_s": s, "log_level": lvl, "geofence": g}, sort_keys=True)
        for s, lvl, g in ((30, "info", "eu"), (10, "debug", "eu"), (60, "info", "us"))
    ]
    diags = ["read_dtc all", "battery_health", "tire_pressure", "ecu_versions"]
    north, south = vins[0::2], vins[1::2]
    counters: Counter[str] = Counter()
    batches: list[Batch] = []

    def add(kind: str, ids: list[str], data: str | bytes, label: str) -> None:
        counters[kind] += 1
        n, rid = len(batches) + 1, f"task_{kind}_{counters[kind]}"
        # A report is worth its answer: the vehicle's answer, not its PUBACK, ends the pair.
        batches.append(Batch(n, kind, rid, ids, data, label, await_response=data in AWAITED_DIAGS))

    def pick(lo: float, hi: float) -> list[str]:
        k = max(1, round(len(vins) * rng.uniform(lo, hi)))
        chosen = set(rng.sample(vins, k))
        return [v for v in vins if v in chosen]

    fw_versions = list(firmware)
    for i in range(count):
        earlier = [b for b in batches if b.kind in ("cfg", "ota") and not b.replaces]
        if i % 7 == 6 and earlier:
            old = earlier[(i // 7) % len(earlier)]
            if old.kind == "cfg":
                data: str | bytes = json.dumps({"base": old.request_id, "fix": i, "telemetry_interval_s": 20})
                label = f"corrected config, replaces {old.request_id}"
            else:
                data = rng.randbytes(24 * 1024)
                label = f"firmware hotfix, replaces {old.request_id}"
            batches.append(Batch(len(batches) + 1, old.kind, old.request_id, old.vins, data, label, replaces=True))
        elif i % 3 == 0:
            ver = fw_versions[(counters["ota"] // 2) % len(fw_versions)]
            region, ids = ("north", north) if counters["ota"] % 2 == 0 else ("south", south)
            if len(vins) < 4:
                region, ids = "all", vins
            add("ota", ids, firmware[ver], f"firmware {ver}, {region} region")
        elif i % 3 == 1:
            cfg = counters["cfg"] % len(configs)
            add("cfg", pick(0.5, 1.0), configs[cfg], f"config profile {cfg + 1}")
        else:
            cmd = diags[counters["diag"] % len(diags)]
            add("diag", pick(0.1, 0.4), cmd, f"diagnostic {cmd!r}")
    return batches


@dataclass
class FleetProc:
    k: int
    proc: subprocess.Popen[str]
    vins: list[str]
    ready: threading.Event = field(default_factory=threading.Event)
    ready_count: int = 0
    progress: dict[str, Any] = field(default_factory=dict)
    final: dict[str, Any] | None = None
    got_final: threading.Event = field(default_factory=threading.Event)
    reader: threading.Thread | None = None

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ValueError):
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "p" in msg:
                self.progress = msg["p"]
            elif "ready" in msg:
                self.ready_count = msg["ready"]
                self.ready.set()
            elif "final" in msg:
                self.final = msg["final"]
                self.got_final.set()
        self.ready.set()
        self.got_final.set()


class Status:
    """A few status lines, redrawn in place on a terminal; plain lines every ~2 s otherwise (CI logs)."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self.shown = 0  # lines of the block on the screen, the cursor at the end of the last one
        self.last_plain = 0.0

    def _erase(self) -> str:
        # Clear the line, then move up and clear, for every line of the block.
        text = "\r\x1b[2K" + "\x1b[1A\x1b[2K" * max(0, self.shown - 1) if self.tty and self.shown else ""
        self.shown = 0
        return text

    def update(self, lines: list[str], force: bool = False) -> None:
        if self.tty:
            width = shutil.get_terminal_size().columns - 1  # no line may wrap: the erase counts lines
            sys.stdout.write(self._erase() + "\n".join(line[:width] for line in lines))
            sys.stdout.flush()
            self.shown = len(lines)
        elif force or time.monotonic() - self.last_plain >= 2.0:
            self.last_plain = time.monotonic()
            print("\n".join(lines), flush=True)

    def event(self, text: str) -> None:
        sys.stdout.write(self._erase())
        print(text, flush=True)

    def done(self) -> None:
        if self.tty and self.shown:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self.shown = 0


@dataclass
class Published:
    """What the platform sent, for checking what the vehicles got."""

    batches: int = 0
    rows: int = 0
    logical_bytes: int = 0
    blobs: dict[str, int] = field(default_factory=dict)  # sha16 -> size
    expected: dict[tuple[str, str], str] = field(default_factory=dict)  # (vin, request_id) -> latest sha16
    #: (vin, rid, sha16) -> k, the batch's place in publish order: each delivery is the oldest
    #: pending row of its vehicle, so k never goes down on a vehicle.
    version: dict[tuple[str, str, str], int] = field(default_factory=dict)
    wall: dict[int, float] = field(default_factory=dict)  # k -> time.time() of its answer
    sent: list[Sent] = field(default_factory=list)  # every publish, retries and the bad batch included
    cancels: list[Cancel] = field(default_factory=list)
    ingest_ms: list[float] = field(default_factory=list)
    first_at: float = 0.0
    last_at: float = 0.0

    def record(self, s: Send, at: float, answered: float, expires_at_ms: int | None = None) -> None:
        """A publish the broker took (`at`, `answered`: time.time() before and after)."""
        b = s.batch
        sent = Sent(
            b.n, b.request_id, b.sha1, tuple(b.vins), b.batch_id, s.correlation_id, s.retry, s.bad, at, answered
        )
        self.sent.append(dataclasses.replace(sent, await_response=b.await_response, expires_at_ms=expires_at_ms))
        self.last_at = time.monotonic()
        if not s.retry and not s.bad:
            self.add(b, answered - at)

    def add(self, b: Batch, took_s: float) -> None:
        self.batches += 1
        k = self.batches
        self.rows += len(b.vins)
        digest = sha16(b.payload)
        self.blobs[digest] = len(b.payload)
        self.logical_bytes += len(b.payload) * len(b.vins)
        for vin in b.vins:
            if not b.checked_apart:
                self.expected[vin, b.request_id] = digest
            self.version[vin, b.request_id, digest] = k
        self.wall[k] = time.time()
        self.ingest_ms.append(took_s * 1000)
        self.last_at = time.monotonic()
        self.first_at = self.first_at or self.last_at


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.status = Status()
        self.tmp = Path(tempfile.mkdtemp(prefix="sdv-fanout-demo-"))
        self.log_dir = Path(args.log_dir).resolve()
        self.broker: Broker | None = None
        self.server: subprocess.Popen[bytes] | None = None
        self.server_log_path = self.log_dir / "server.log"
        self.server_log: IO[bytes] | None = None
        self.metrics_port = 0
        self.store: Store | None = None
        self.fleet: list[FleetProc] = []
        self.t0 = time.monotonic()
        self.last_draw = 0.0
        self.came_online: dict[str, float] = {}  # role -> time.time() of its "online" command
        self.server_exit: int | None = None  # set by stop() once SIGTERM was answered in time
        self.feed: StatusFeed | None = None  # the platform's status subscriber
        self.view = StatusView()  # what it heard, per request
        self.batch_of: dict[tuple[str, str], Batch] = {}  # (request_id, sha1) -> the batch that made it
        self.sends: list[Send] = []
        self.answering: frozenset[str] = frozenset()  # VINs that answer requests awaiting an answer
        self.responded_to: set[str] = set()  # request ids whose first response was shown

    # -- helpers ------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def say(self, text: str) -> None:
        self.status.event(f"[{self.elapsed():5.1f}s] {text}")

    def pending_rows(self) -> int:
        """Rows in the server's LMDB right now (each is a request not yet acknowledged), read-only."""
        assert self.store is not None
        with self.store.read() as txn:
            return int(txn.stat(self.store.tables.ids)["entries"])

    def fleet_total(self, key: str, agg: Any = sum) -> int:
        return int(agg(f.progress.get(key, 0) for f in self.fleet)) if self.fleet else 0

    # -- start-up -----------------------------------------------------------------------------
    def start_broker(self, choice: Choice) -> Broker:
        self.broker = make_broker(choice, self.log_dir)
        self.broker.start()
        return self.broker

    def start_server(self, broker: Broker) -> tuple[int, int]:
        """`sdv-fanout serve` delivering to `broker`; returns its gRPC port and process count."""
        data_dir = self.tmp / "lmdb"
        ready = self.tmp / "ready.json"
        exe = Path(sys.executable).parent / "sdv-fanout"
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "exhook_server.cli"]
        cmd += ["serve", "--listen", "127.0.0.1:0", "--data-dir", str(data_dir), "--ready-file", str(ready)]
        cmd += ["--log-format", "json", "--log-level", "info"]
        # Only our settings: an SDV_FANOUT_* variable of the caller's shell must not change the demo.
        env = {k: v for k, v in os.environ.items() if not k.startswith("SDV_FANOUT_")}
        env["SDV_FANOUT_MQTT_URL"] = broker.url
        if self.args.processes is not None:
            env["SDV_FANOUT_PROCESSES"] = str(self.args.processes)
        # Progress on the status topic at this pace (the server's default, 5 s, is for campaigns).
        env["SDV_FANOUT_PROGRESS_INTERVAL_S"] = f"{self.args.progress_interval:g}"
        settings = {f.name for f in dataclasses.fields(Config)}
        # A vehicle that never answers costs its queue response_timeout_s (the server's 300 s is
        # for the field); an expired row ends within a quarter of a second, a campaign policy holds in
        # every server process as soon.
        for name, value in (
            ("response_timeout_s", self.args.response_timeout),
            ("expiry_sweep_interval_s", EXPIRY_SWEEP_S),
            ("policy_refresh_s", campaigns.POLICY_REFRESH_S),
        ):
            if name in settings:
                env[f"SDV_FANOUT_{name.upper()}"] = f"{value:g}"
        for name in ("metrics_listen", "admin_listen"):  # never a fixed default port
            if name in settings:
                env[f"SDV_FANOUT_{name.upper()}"] = f"{LOOPBACK}:0"
        self.server_log = open(self.server_log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.server = subprocess.Popen(cmd, stdout=self.server_log, stderr=subprocess.STDOUT, env=env, cwd=self.tmp)
        deadline = time.monotonic() + 30
        while True:
            if self.server.poll() is not None:
                raise RuntimeError(f"sdv-fanout serve exited with {self.server.returncode}; see {self.server_log_path}")
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                info = json.loads(ready.read_text())
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"sdv-fanout serve did not start within 30 s; see {self.server_log_path}")
            time.sleep(0.05)
        self.metrics_port = int(info.get("metrics_port") or 0)
        self.store = Store(data_dir, readonly=True)
        return int(info["port"]), len(info.get("pids") or [info["pid"]])

    def wait_delivery_clients(self, broker: Broker, count: int) -> list[str]:
        """Wait until `count` delivery clients (one per server process) are connected to the broker.

        Counted on the broker's side, by clientid prefix: with several server processes each
        child has its own client, and none of them carries the parent's pid.
        """
        deadline = time.monotonic() + 15
        while True:
            seen = broker.delivery_clients()
            if len(seen) >= count:
                return seen
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{len(seen)} of the server's {count} delivery clients connected to the broker within 15 s"
                )
            if self.server is not None and self.server.poll() is not None:
                raise RuntimeError(f"sdv-fanout serve exited; see {self.server_log_path}")
            time.sleep(0.05)

    def start_fleet(
        self, specs: list[dict[str, Any]], broker: Broker, clientid: str, await_response: list[str]
    ) -> None:
        nproc = max(1, math.ceil(len(specs) / self.args.per_proc))
        for k in range(nproc):
            part = specs[k::nproc]
            err = open(self.log_dir / f"fleet-{k}.log", "wb")  # noqa: SIM115 - the child has its own copy
            proc = subprocess.Popen(
                [sys.executable, "-m", "demo.fleet"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                cwd=ROOT,
                text=True,
                bufsize=1,
            )
            err.close()
            fp = FleetProc(k, proc, [s["vin"] for s in part])
            fp.reader = threading.Thread(target=fp.read, name=f"fleet-{k}", daemon=True)
            fp.reader.start()
            self.fleet.append(fp)
            fp.send(
                {
                    **broker.fleet_spec(clientid),
                    "vehicles": part,
                    "await_response": await_response,
                    "response_timeout_s": self.args.response_timeout,
                }
            )
        deadline = time.monotonic() + 90
        for fp in self.fleet:
            while not fp.ready.wait(0.5):
                if time.monotonic() > deadline:
                    raise RuntimeError("the fleet did not come online within 90 s")
            if not fp.ready_count:
                raise RuntimeError(f"fleet process {fp.k} failed; see {self.log_dir / f'fleet-{fp.k}.log'}")

    def scrape_metrics(self) -> dict[str, float]:
        """The server's Prometheus counters (empty when this build has no metrics endpoint)."""
        if not self.metrics_port:
            return {}
        from prometheus_client.parser import text_string_to_metric_families

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            return {}
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return out

    # -- the run ------------------------------------------------------------------------------
    def make_fleet(self, vins: list[str]) -> list[dict[str, Any]]:
        a = self.args
        order = list(range(len(vins)))
        self.rng.shuffle(order)
        counts = [("late", round(len(vins) * a.late)), ("reconnect", round(len(vins) * a.reconnect))]
        counts.append(("resume", round(len(vins) * a.resume)))
        roles = ["online"] * len(vins)
        at = 0
        for role, n in counts:
            for i in order[at : at + n]:
                roles[i] = role
            at += n
        specs = []
        held = 0
        for vin, role in zip(vins, roles, strict=True):
            spec: dict[str, Any] = {
                "vin": vin,
                "role": role,
                "ack_ms": self.rng.randint(5, 40),
                "hb_s": self.rng.uniform(3.0, 6.0),
                "hb_phase_s": self.rng.uniform(0.5, 3.0),
                "back_s": round(self.rng.uniform(1.0, 2.5), 2),
            }
            if role == "reconnect":
                spec["hold"] = held % 2 == 0  # half of them drop while holding an unacked request
                held += 1
            specs.append(spec)
        # Who answers, from a generator of its own: the rest of the scenario stays as it was.
        rng = random.Random(f"{a.seed}/answers")
        answering = set(rng.sample(vins, round(len(vins) * a.answer)))
        for spec in specs:
            spec["answers"] = spec["vin"] in answering
            spec["answer_ms"] = rng.randint(20, 200)  # running the diagnostic
            spec["dtc"] = sorted(rng.sample(["P0420", "P0171", "U0100", "B1000", "C0035"], rng.randint(0, 2)))
        self.answering = frozenset(answering)
        return specs

    def run(self) -> int:
        a = self.args
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for old in [*self.log_dir.glob("fleet-*.log"), *self.log_dir.glob("mosquitto-*"), self.server_log_path]:
            old.unlink(missing_ok=True)
        for old in self.log_dir.glob("emqx-*"):  # an earlier run's EMQX node (data and logs)
            shutil.rmtree(old, ignore_errors=True)
        vins = [VIN_FORMAT.format(n) for n in range(1, a.vehicles + 1)]
        specs = self.make_fleet(vins)
        batches = plan_batches(self.rng, vins, a.batches)
        bad = bad_batch(vins)
        self.sends = sends = plan_sends(batches, bad, a.interval)
        window = (len(batches) - 1) * a.interval
        by_role = {r: [s["vin"] for s in specs if s["role"] == r] for r in ("online", "late", "reconnect", "resume")}
        # The rollout goes to everyone about a fifth into the run and is cancelled two batches
        # later; the location request goes to the offline vehicles at once and expires before
        # they come online (later than ~45 % of the run when the run is short).
        rollout = rollout_batch(vins)
        rollout_at = (max(1, round(0.2 * (len(batches) - 1))) + 0.25) * a.interval
        cancel_at = rollout_at + max(2 * a.interval, 0.5)
        sends += [Send(rollout_at, rollout), Send(cancel_at, rollout, cancel=True)]
        late_at = max(0.45 * window, cancel_at + 1.0)
        locate: Batch | None = None
        if by_role["late"]:
            locate = locate_batch(by_role["late"])
            sends.append(Send(0.5 * a.interval, locate))
            late_at = max(late_at, 0.5 * a.interval + EXPIRES_IN_S + EXPIRY_MARGIN_S)
        sends.sort(key=lambda s: s.at)
        firsts = [s.batch for s in sends if not s.retry and not s.bad and not s.cancel]
        self.batch_of = {(b.request_id, b.sha1): b for b in firsts}
        events = [(0.30 * window, "reconnect"), (late_at, "late"), (0.60 * window, "resume")]
        events = sorted(e for e in events if by_role[e[1]])

        print(f"sdv-fanout demo: seed {a.seed}, {len(vins)} vehicles, {len(batches)} batches, one every {a.interval} s")
        choice = choose(a.broker, a.emqx_version)
        if choice.kind == "emqx":
            print(f"  broker    the real EMQX {choice.version} ({choice.why}); starting it...", flush=True)
        else:
            print(f"  broker    the simulator: mosquitto + testkit/emqx_sim.py ({choice.why})", flush=True)
        broker = self.start_broker(choice)
        for line in broker.describe():
            print(f"            {line}")
        port, nproc = self.start_server(broker)
        how_many = f"{nproc} process(es)" + (" (one per CPU)" if a.processes in (None, 0) else "")
        print(f"  server    sdv-fanout serve, {how_many}, gRPC {LOOPBACK}:{port}, LMDB {self.tmp / 'lmdb'}")
        print(f"            log {self.server_log_path}")
        clientids = self.wait_delivery_clients(broker, nproc)
        print(f"            delivery clients connected to the broker: {', '.join(clientids)}")
        hooks = broker.attach(port)
        if broker.kind == "emqx":
            print(f"  ExHook    EMQX registered and connected the server, which asked for {len(hooks)} hooks:")
        else:
            print(f"  ExHook    testkit/emqx_sim.py loaded the provider, which asked for {len(hooks)} hooks:")
        print(f"            {', '.join(hooks)}")
        self.feed = StatusFeed(broker.mqtt_port)
        self.feed.start()
        awaited = sorted({b.request_id for b in batches if b.await_response})
        self.start_fleet(specs, broker, clientids[0], awaited)
        n = {r: len(v) for r, v in by_role.items()}
        print(
            f"  fleet     {len(vins)} MQTT 5 vehicles in {len(self.fleet)} process(es), subscribed to "
            f"{REQUEST_PREFIX.replace('{VIN}', '<VIN>')}/+ (PUBACK after 5-40 ms, heartbeat every 3-6 s)"
            + (" on EMQX" if broker.kind == "emqx" else " through FakeEmqx")
        )
        print(
            f"            {len(vins) - n['late']} online now, {n['late']} offline until ~{late_at:.0f} s; "
            f"{n['reconnect']} will reconnect clean (~{0.30 * window:.0f} s), {n['resume']} will resume a "
            f"persistent session (~{0.60 * window:.0f} s)"
        )
        print(
            f"            {len(self.answering)} answer a request that awaits it on "
            f"{RESPONSE_PREFIX.replace('{VIN}', '<VIN>')}/<request_id> (QoS 1, 20-200 ms after the PUBACK); "
            f"{len(vins) - len(self.answering)} never answer (the server gives up after {a.response_timeout:g} s)"
        )
        first = batches[0]
        example = json.dumps({"ids": [*first.vins[:2], "..."], "request_id": first.request_id})[:-1]
        print(
            f"  platform  publishes on {BATCH_TOPIC}: {example}, "
            f'"data": "<{human_bytes(len(first.payload))}, base64>", "data_encoding": "base64", '
            f'"batch_id": "{first.batch_id}", "correlation_id": "{sends[0].correlation_id}"}}'
        )
        retried = [s.batch.n for s in sends if s.retry]
        print(
            f"            re-sends {len(retried)} batch(es) with the same batch_id ({', '.join(map(str, retried))}) "
            f"and one bad batch ({bad.request_id}: {bad.label}); subscribed to {STATUS_FILTER} (QoS 1, "
            f"{self.feed.clientid}): receipts, progress every {a.progress_interval:g} s, completed, "
            "responses, cancelled"
        )
        print(
            f'            {" and ".join(map(repr, AWAITED_DIAGS))} diagnostics carry "await_response": true '
            f"({len(awaited)} requests); {rollout.request_id} "
            f"({rollout.label}) to all {len(vins)} at ~{rollout_at:.0f} s is cancelled on {CANCEL_TOPIC} at "
            f"~{cancel_at:.0f} s"
            + (
                f"; {locate.request_id} to the {len(locate.vins)} offline vehicles at ~{0.5 * a.interval:.0f} s "
                f'carries "expires_at" {EXPIRES_IN_S:g} s ahead'
                if locate is not None
                else "; no vehicle is offline, so no request expires"
            )
        )
        print()

        pub = Published()
        self.t0 = time.monotonic()
        next_event = next_send = 0
        while next_send < len(sends) or next_event < len(events):
            now = self.elapsed()
            while next_event < len(events) and events[next_event][0] <= now:
                self.scenario(events[next_event][1], by_role[events[next_event][1]], specs)
                next_event += 1
            if next_send < len(sends) and sends[next_send].at <= now:
                self.publish(broker, sends[next_send], pub, by_role["late"] if now < late_at else [])
                next_send += 1
            self.show(pub, len(firsts))
            time.sleep(0.02)

        # Drained: nothing pending in LMDB, every vehicle online, nothing received and not yet acked.
        deadline = pub.last_at + a.drain_timeout
        idle_since: float | None = None
        drained_at: float | None = None
        while time.monotonic() < deadline:
            rows = self.show(pub, len(firsts))
            idle = rows == 0 and not self.fleet_total("unacked") and not self.fleet_total("busy")
            if idle and self.fleet_total("online") == len(vins):
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since >= 0.6:  # the same in two reports of every fleet process
                    drained_at = idle_since
                    break
            else:
                idle_since = None
            time.sleep(0.1)
        # What the status topic says lags the store by up to progress_interval_s (then QoS 1 on
        # its way): wait for every receipt and every generation's `completed`.
        settle_s = max(5.0, 4 * a.progress_interval)
        settle = time.monotonic() + settle_s
        while drained_at is not None and not self.status_settled() and time.monotonic() < settle:
            self.show(pub, len(firsts))
            time.sleep(0.05)
        rows = self.show(pub, len(firsts), force=True)
        self.status.done()
        if drained_at is None:
            print(f"deadline: {rows:,} rows still pending {a.drain_timeout:g} s after the last batch")
        elif not self.status_settled():
            print(f"the status topic did not report every receipt and completion within {settle_s:g} s of the drain")

        metrics = self.scrape_metrics()
        for fp in self.fleet:
            fp.send({"cmd": "stop"})
        for fp in self.fleet:
            fp.got_final.wait(30)
        drain_s = None if drained_at is None else max(0.0, drained_at - pub.last_at)
        code = self.summary(vins, specs, firsts, pub, rows, drain_s, metrics)
        if a.campaigns and self.feed is not None:
            act = campaigns.Act(self, broker, clientids[0], self.feed.take)
            code = max(code, act.run(a.response_timeout))
        return code

    def publish(self, broker: Broker, send: Send, pub: Published, offline: list[str]) -> None:
        """One publish of the platform; returns once the server stored it (or rejected it: the
        answer is the same), or took the cancel. `offline`: the vehicles not online yet."""
        b = send.batch
        at = time.time()
        if send.cancel:
            broker.publish(CANCEL_TOPIC, cancel_payload(b.request_id, send.correlation_id))
            waiting = len(set(b.vins) & set(offline))
            pub.cancels.append(Cancel(b.request_id, send.correlation_id, at, time.time(), waiting))
            self.say(
                f"platform cancels {b.request_id} on {CANCEL_TOPIC}: "
                + json.dumps({"request_id": b.request_id, "correlation_id": send.correlation_id})
                + f" ({waiting} of its {len(b.vins)} vehicles are offline, their rows pending)"
            )
            return
        fields: dict[str, Any] = {"batch_id": b.batch_id, "correlation_id": send.correlation_id}
        if b.await_response:
            fields["await_response"] = True
        expires_at_ms = None
        if b.expires_in_s is not None:
            expires_at_ms = fields["expires_at"] = int((at + b.expires_in_s) * 1000)
        broker.publish(BATCH_TOPIC, batch_payload(b.vins, b.request_id, b.data, **fields))
        pub.record(send, at, time.time(), expires_at_ms)
        if b.replaces and not send.retry:
            self.say(f"batch {b.n} reuses {b.request_id} with new data for {len(b.vins)} vehicles: {b.label}")
        elif b.cancelled and not send.retry:
            self.say(f"batch {b.request_id} ({b.label}) for all {len(b.vins)} vehicles: the platform will cancel it")
        elif b.expires_in_s is not None and not send.retry:
            self.say(
                f"batch {b.request_id} ({b.label}) for the {len(b.vins)} offline vehicles: "
                f'"expires_at": {expires_at_ms}, before any of them comes online'
            )

    def scenario(self, role: str, vins: list[str], specs: list[dict[str, Any]]) -> None:
        held = sum(1 for s in specs if s["role"] == role and s.get("hold"))
        text = {
            "late": f"{len(vins)} vehicles that were offline connect and subscribe: their queues wait in LMDB",
            "reconnect": f"{len(vins)} vehicles lose their connection ({held} of them while holding back a PUBACK) and "
            "reconnect clean 1-2.5 s later",
            "resume": f"{len(vins)} vehicles with a persistent session drop before their PUBACK and resume it "
            "1-2.5 s later",
        }[role]
        self.say(text)
        cmd = "online" if role == "late" else "drop"
        if role == "late":
            self.came_online[role] = time.time()
        back = {s["vin"]: s["back_s"] for s in specs}
        mine = set(vins)
        for fp in self.fleet:
            part = [v for v in fp.vins if v in mine]
            if part:
                fp.send({"cmd": cmd, "vins": part, "back_s": {v: back[v] for v in part}})

    def show(self, pub: Published, total: int, force: bool = False) -> int:
        self.listen()
        rows = self.pending_rows()
        now = time.monotonic()
        if force or now - self.last_draw >= 0.5:
            self.last_draw = now
            lines = [
                f"[{self.elapsed():5.1f}s] batches {pub.batches}/{total}  rows {pub.rows:,}  pending {rows:,}  "
                f"delivered {self.fleet_total('received'):,}  acked {self.fleet_total('acked'):,}  "
                f"online {self.fleet_total('online')}/{self.args.vehicles}  "
                f"in-flight max {self.fleet_total('max_inflight', max)}",
                *self.status_lines(),
            ]
            self.status.update(lines, force=force)
        return rows

    # -- the status topic, as the platform hears it -------------------------------------------
    def listen(self) -> None:
        """Fold what the status subscriber heard; say what a platform would act on."""
        if self.feed is None:
            return
        for heard in self.feed.take():
            self.view.add(heard)
            text = self.notable(heard)
            if text:
                self.say(text)

    def notable(self, heard: Heard) -> str | None:
        """An event line for a duplicate or rejected receipt and for a generation's `completed`."""
        doc = heard.doc
        rid, event = doc.get("request_id"), doc.get("event")
        if event == "accepted" and doc.get("duplicate"):
            return (
                f"status {rid}: accepted, duplicate: true ({doc.get('batch_id')} re-sent, "
                f"correlation_id {doc.get('correlation_id')}): nothing stored again, nothing delivered twice"
            )
        if event == "rejected":
            bad = next((s.batch for s in self.sends if s.correlation_id == doc.get("correlation_id")), None)
            why = f" ({bad.label} in its ids)" if bad is not None else ""
            return f"status {rid}: rejected, reason {doc.get('reason')}{why}: nothing of the batch stored"
        if event == "cancelled":
            return (
                f"status {rid}: cancelled ({doc.get('correlation_id')}): {doc.get('cancelled')} rows cancelled, "
                f"{doc.get('in_flight')} of them already on their way: nobody else gets it"
            )
        if event == "response" and str(rid) not in self.responded_to:  # the first answer of each request
            self.responded_to.add(str(rid))
            return (
                f"status {rid}: response from {doc.get('vin')} (sha1 {str(doc.get('sha1'))[:8]}): "
                f"{doc.get('payload')}" + (" (and more, counted below)" if len(self.responded_to) == 1 else "")
            )
        if event == "completed":
            counts = doc.get("counts") or {}
            b = self.batch_of.get((str(rid), str(doc.get("sha1"))))
            made = f"batch {b.n}, " if b is not None and b.n else ""
            done = "responded" if b is not None and b.await_response else "delivered"
            tail = {
                "superseded": "superseded by a newer version before delivery",
                "failed": f"failed (no answer within {self.args.response_timeout:g} s)",
                "cancelled": "cancelled",
                "expired": "expired",
            }
            return (
                f"status {rid} ({made}sha1 {str(doc.get('sha1'))[:8]}): completed, {counts.get(done, 0):,} "
                f"of {counts.get('total', 0):,} {done}"
                + "".join(f", {counts[k]:,} {text}" for k, text in tail.items() if counts.get(k))
            )
        return None

    def status_lines(self) -> list[str]:
        """Receipts and generations under the status line: on a terminal, the generations that
        changed last, one a line; in a log, one line."""
        v = self.view
        active = sorted((g for g in v.gens.values() if not g.done), key=lambda g: -g.changed_at)
        done = sum(1 for g in v.gens.values() if g.done)
        head = (
            f"         status topic: receipts {v.accepted():,} accepted, {v.accepted(duplicate=True)} duplicate, "
            f"{v.rejected()} rejected; generations {done}/{len(v.gens)} completed; "
            f"{v.events['progress']:,} progress messages; {len(v.responses):,} responses"
            + (f"; {len(v.cancels)} cancelled" if v.cancels else "")
        )
        if not self.status.tty:
            if active:
                shown = ", ".join(
                    f"{g.request_id} {g.counts.get(self.done_outcome(g), 0)}/{g.counts.get('total', 0)}"
                    for g in active[:SHOWN_GENERATIONS]
                )
                more = f" (+{len(active) - SHOWN_GENERATIONS} more)" if len(active) > SHOWN_GENERATIONS else ""
                head += f"; in progress (delivered or responded/total): {shown}{more}"
            return [head]
        lines = [head]
        for g in active[:SHOWN_GENERATIONS]:
            lines.append("           " + self.generation_line(g))
        if len(active) > SHOWN_GENERATIONS:
            lines.append(f"           ... and {len(active) - SHOWN_GENERATIONS} more in progress")
        return lines

    def done_outcome(self, g: Generation) -> str:
        """What a good end of a pair of this generation is called: `responded` when it awaits answers."""
        b = self.batch_of.get((g.request_id, g.sha1))
        return "responded" if b is not None and b.await_response else "delivered"

    def generation_line(self, g: Generation) -> str:
        b = self.batch_of.get((g.request_id, g.sha1))
        c = g.counts
        other = "".join(f"  {k} {c[k]:>4,}" for k in ("responded", "failed", "cancelled", "expired") if c.get(k))
        return (
            f"{g.request_id:<14} {'batch ' + str(b.n) if b and b.n else '':<9} sha1 {g.sha1[:8]}  "
            f"total {c.get('total', 0):>5,}  delivered {c.get('delivered', 0):>5,}  pending {c.get('pending', 0):>5,}  "
            f"superseded {c.get('superseded', 0):>4,}{other}"
        )

    def status_settled(self) -> bool:
        """Has the status topic said everything it should: a receipt for every batch publish,
        `completed` for every generation the platform created, a `response` for every answer the
        vehicles published and `cancelled` for every cancel?"""
        self.listen()
        v = self.view
        if len(v.receipts) < sum(not s.cancel for s in self.sends):
            return False
        if len(v.responses) < self.fleet_total("answered") or len(v.cancels) < sum(s.cancel for s in self.sends):
            return False
        return all((g := v.gens.get(key)) is not None and g.done for key in self.batch_of)

    # -- results ------------------------------------------------------------------------------
    def server_events(self) -> Counter[str]:
        counts: Counter[str] = Counter()
        if self.server_log is not None and not self.server_log.closed:
            self.server_log.flush()
        with contextlib.suppress(FileNotFoundError), open(self.server_log_path, "rb") as f:
            for line in f:
                try:
                    ev = json.loads(line)
                except ValueError:
                    counts["level:other"] += 1  # not structlog's: a traceback, say
                    continue
                counts[ev.get("event", "?")] += 1
                counts["level:" + ev.get("level", "?")] += 1
                if ev.get("event") == "batch_stored":
                    counts["rows_replaced"] += int(ev.get("replaced", 0))
                elif ev.get("event") == "delivery_failed":
                    counts[f"delivery_failed:{ev.get('reason')}"] += 1
        return counts

    def summary(
        self,
        vins: list[str],
        specs: list[dict[str, Any]],
        batches: list[Batch],
        pub: Published,
        pending: int,
        drain_s: float | None,
        metrics: dict[str, float],
    ) -> int:
        finals: dict[str, Any] = {}
        errors: list[str] = []
        error_count = 0
        for fp in self.fleet:
            if fp.final is None:
                errors.append(f"fleet process {fp.k} sent no report")
                error_count += 1
                continue
            finals.update(fp.final["vehicles"])
            errors += fp.final["errors"]
            error_count += fp.final["error_count"]
        broker_lines: list[tuple[str, str]] = []
        if self.broker is not None:
            broker_lines = self.broker.summary()
            errors += self.broker.errors()
            error_count += len(self.broker.errors())

        role = {s["vin"]: s["role"] for s in specs}
        deliveries = acked = held = heartbeats = foreign = out_of_order = max_inflight = 0
        dups: Counter[str] = Counter()  # why a vehicle got the same request and payload again
        unexplained: Counter[tuple[str, str]] = Counter()  # (request_id, sha16) -> "otherwise" duplicates
        acks: dict[str, list[tuple[str, str, float]]] = {}  # VIN -> its PUBACKs (request_id, sha16, time)
        received: dict[str, list[tuple[str, str, float]]] = {}  # VIN -> its PUBLISHes (request_id, sha16, time)
        answers: dict[str, list[tuple[str, str, str, float]]] = {}  # VIN -> its answers (rid, sha16, body, time)
        fate: Counter[str] = Counter()
        missing: list[tuple[str, str]] = []
        late_backlog: list[int] = []
        late_drain: list[float] = []
        stamps: list[float] = []
        for vin in vins:
            f = finals.get(vin)
            if f is None:
                missing.append((vin, "*"))
                continue
            max_inflight = max(max_inflight, f["max_inflight"])
            acked += f["acked"]
            acks[vin] = [(rid, digest, t) for rid, digest, t in f["ax"]]
            received[vin] = [(rid, digest, t) for rid, digest, t in f["rx"]]
            answers[vin] = [(rid, digest, body, t) for rid, digest, body, t in f.get("answers", [])]
            held += f["held_count"]
            heartbeats += f["heartbeats"]
            held_keys = {(rid, d) for rid, d in f["held"]}
            awaiting_keys = {(rid, d) for rid, d in f.get("awaiting", [])}
            seen: Counter[tuple[str, str]] = Counter()
            last = 0
            backlog: list[float] = []
            online_at = self.came_online.get("late", 0.0)
            for rid, digest, t in f["rx"]:
                deliveries += 1
                stamps.append(t)
                n = pub.version.get((vin, rid, digest))
                if n is None:
                    foreign += 1  # on another VIN's topic, or a payload never sent to this VIN
                    continue
                out_of_order += n < last  # each delivery is the oldest pending row: batch numbers never go down
                last = max(last, n)
                seen[rid, digest] += 1
                if seen[rid, digest] > 1:
                    if (rid, digest) in held_keys:
                        dups["resumed" if role[vin] == "resume" else "clean"] += 1
                    elif (rid, digest) in awaiting_keys:
                        dups["awaiting"] += 1  # PUBACKed, its answer awaited, when the connection dropped
                    else:
                        dups["unexpected"] += 1
                        unexplained[rid, digest] += 1
                if role[vin] == "late" and pub.wall[n] < online_at:
                    backlog.append(t)
            missing += [(vin, rid) for (v, rid), d in pub.expected.items() if v == vin and (rid, d) not in seen]
            for key in held_keys:  # what became of a request unacked when its connection dropped
                if seen[key] > 1:
                    fate["again"] += 1
                elif pub.expected.get((vin, key[0])) != key[1]:
                    fate["replaced"] += 1  # a newer version of the request went out instead
                else:
                    fate["lost"] += 1
            if role[vin] == "late" and backlog:
                late_backlog.append(len(backlog))
                late_drain.append(max(backlog) - online_at)
        stamps.sort()
        peak = lo = 0
        for hi, t in enumerate(stamps):
            while t - stamps[lo] > 1.0:
                lo += 1
            peak = max(peak, hi - lo + 1)
        span = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0

        stats = self.store.stats() if self.store is not None else None
        ev = self.server_events()
        kinds = Counter(b.kind for b in batches)
        roles = Counter(role.values())
        unique_bytes = sum(pub.blobs.values())
        ingest = sorted(pub.ingest_ms)
        delivered_all = not missing
        retried = {(s.batch.request_id, sha16(s.batch.payload)) for s in self.sends if s.retry}
        receipts = check_receipts(self.view, pub.sent, sum(unexplained[k] for k in retried))
        facts = FleetFacts(received, acks, answers, self.answering)
        progress = check_generations(self.view, pub.sent, facts, pub.cancels)
        responses = check_responses(self.view, pub.sent, facts, self.args.response_timeout)
        cancels = [check_cancel(self.view, c, pub.sent, facts) for c in pub.cancels]
        expiry = check_expiry(self.view, pub.sent, facts)
        heard_errors = (self.feed.malformed if self.feed is not None else []) + [
            f"unexpected status message on {h.topic}: {h.doc}" for h in self.view.other
        ]
        server_errors = ev["level:error"] + ev["level:critical"] + ev["level:other"]
        timeouts = ev["delivery_failed:response_timeout"]  # one warning per request never answered
        ok = pending == 0 and delivered_all and max_inflight <= 1 and foreign == 0 and not fate["lost"]
        ok = ok and receipts.ok and progress.ok and not heard_errors
        ok = ok and responses.ok and all(c.ok for c in cancels) and expiry.ok
        n_dups = sum(dups.values())

        table: list[tuple[str, str]] = [
            (
                "vehicles",
                f"{len(vins)}: {roles['online']} online throughout, {roles['late']} came online late, "
                f"{roles['reconnect']} reconnected clean, {roles['resume']} resumed a persistent session; "
                f"{heartbeats:,} heartbeats",
            ),
            (
                "batches",
                f"{pub.batches} ({kinds['ota']} ota, {kinds['cfg']} cfg, {kinds['diag']} diag of which "
                f"{sum(b.await_response for b in batches)} awaited an answer, {kinds['rollout']} rollout cancelled "
                f"halfway, {kinds['locate']} locate that expired; "
                f"{sum(b.replaces for b in batches)} reused an earlier request id with new data); "
                f"{sum(s.retry for s in self.sends)} re-sent with the same batch_id, 1 bad; server log: "
                f"{ev['batch_stored']} batch_stored, {ev['batch_duplicate']} batch_duplicate, "
                f"{ev['batch_rejected']} batch_rejected",
            ),
            (
                "ingest",
                (
                    "each PUBACK from EMQX came after the server's hook had committed to LMDB: "
                    if self.broker is not None and self.broker.kind == "emqx"
                    else "each hook answered after its LMDB commit: "
                )
                + f"{ingest[len(ingest) // 2]:.1f} ms median, {ingest[-1]:.1f} ms max",
            ),
            (
                "rows",
                f"{pub.rows:,} (VIN, request) rows written for {len(pub.expected):,} distinct pairs; "
                f"{ev['rows_replaced']:,} replaced a row still pending",
            ),
            (
                "unique blobs",
                f"{len(pub.blobs)} payloads, each stored once (LMDB data table: {stats.blobs if stats else '?'}): "
                f"{human_bytes(pub.logical_bytes)} of row payloads in {human_bytes(unique_bytes)}, "
                f"dedup ratio {pub.logical_bytes / max(unique_bytes, 1):,.0f}x",
            ),
            (
                "deliveries",
                f"{deliveries:,} received by vehicles, {acked:,} PUBACKed; {held} were unacked when their "
                "connection dropped"
                + (f": {fate['again']} came again" if held else "")
                + (f", {fate['replaced']} were replaced by a newer version first" if fate["replaced"] else "")
                + (f", {fate['lost']} NEVER came again" if fate["lost"] else ""),
            ),
            (
                "duplicates",
                f"{n_dups} (same request and payload twice to one vehicle): {dups['resumed']} redelivered by "
                f"the broker on session resume, {dups['clean']} re-sent by the server after a clean reconnect, "
                + (
                    f"{dups['awaiting']} re-sent after a clean reconnect while the server awaited the answer, "
                    if dups["awaiting"]
                    else ""
                )
                + f"{dups['unexpected']} otherwise",
            ),
            ("max in flight", f"{max_inflight} per vehicle (must be 1)"),
            (
                "order",
                "oldest first on every vehicle" if not out_of_order else f"{out_of_order} deliveries out of order",
            ),
        ]
        if late_backlog:
            table.append(
                (
                    "late vehicles",
                    f"{len(late_backlog)} got their backlog ({min(late_backlog)}-{max(late_backlog)} requests) "
                    f"within {max(late_drain):.1f} s of coming online",
                )
            )
        table += [
            (
                "throughput",
                f"{deliveries / span:,.0f} deliveries/s on average over {span:.1f} s (batches are paced), "
                f"peak {peak:,} in one second"
                if span
                else "n/a",
            ),
            (
                "time to drain",
                f"{drain_s:.1f} s after the last batch (batches took {pub.last_at - pub.first_at:.1f} s)"
                if drain_s is not None
                else f"not drained within {self.args.drain_timeout:g} s of the last batch",
            ),
        ]
        if metrics:
            acked_m = {k: v for k, v in metrics.items() if k.startswith("sdv_fanout_deliveries_acked_total{")}
            table.append(
                (
                    "server metrics",
                    f"deliveries sent {metrics.get('sdv_fanout_deliveries_sent_total', 0):,.0f}, "
                    f"re-sent {metrics.get('sdv_fanout_deliveries_resent_total', 0):,.0f}; acks "
                    + ", ".join(f"{k.split('=')[1][:-1]} {v:,.0f}" for k, v in sorted(acked_m.items())),
                )
            )
        if foreign:
            table.append(("foreign", f"{foreign} deliveries on another VIN's topic or never published to it"))
        table += broker_lines
        table += [
            ("receipts", receipts.line),
            ("completed", progress.line),
            ("responses", responses.line),
            *(("cancelled", c.line) for c in cancels),
            ("expired", expiry.line),
            (
                "every row delivered",
                (
                    "yes (but the cancelled and the expired ones, above)"
                    if delivered_all
                    else f"NO: {len(missing):,} (VIN, request) pairs without their latest payload"
                )
                + f"; {pending:,} rows pending in LMDB",
            ),
            (
                "errors",
                f"{error_count} in the fleet and broker, {len(heard_errors)} on the status topic; server log: "
                f"{ev['level:warning']} warnings"
                + (
                    f" (the bad batch's batch_rejected, {timeouts} delivery_failed reason=response_timeout)"
                    if ev["level:warning"] == ev["batch_rejected"] + timeouts and ev["batch_rejected"] > 0
                    else ""
                )
                + f", {server_errors} errors",
            ),
        ]
        print()
        print("Summary")
        width = max(len(k) for k, _ in table)
        for k, v in table:
            print(f"  {k:<{width}}  {v}")
        checks = [receipts, progress, responses, *cancels, expiry]
        for e in [*errors[:5], *(p for c in checks for p in c.problems[:5]), *heard_errors[:5]]:
            print(f"  ! {e}")
        for vin, rid in missing[:5]:
            print(f"  ! {vin} has not received the latest {rid}")
        print()
        if ok:
            print("PASS: every row reached its vehicle, was acknowledged and deleted, one in flight per vehicle")
            print("PASS: every batch got one receipt, every generation reported completed with the vehicles' counts")
            print(
                "PASS: every answer was relayed with its payload, the cancel stopped its campaign, "
                "the expired request reached no vehicle"
            )
        else:
            print("FAIL: see above")
        return 0 if ok else 1

    # -- teardown -------------------------------------------------------------------------------
    def shutdown_clean(self) -> bool:
        """Say how the server stopped; a traceback or an error line on SIGTERM reads as a crash."""
        if self.server is None:
            return True
        ev = self.server_events()
        bad = ev["level:error"] + ev["level:critical"] + ev["level:other"]
        if self.server_exit == 0 and not bad:
            print("server stopped cleanly on SIGTERM: exit 0, no error in its log")
            return True
        print(f"server did NOT stop cleanly: exit {self.server_exit}, {bad} error lines in {self.server_log_path}")
        return False

    def stop(self) -> None:
        if self.feed is not None:
            self.feed.stop()
        for fp in self.fleet:
            fp.send({"cmd": "stop"})
            with contextlib.suppress(OSError, ValueError):
                assert fp.proc.stdin is not None
                fp.proc.stdin.close()
        for fp in self.fleet:
            try:
                fp.proc.wait(20)
            except subprocess.TimeoutExpired:
                fp.proc.kill()
                fp.proc.wait(5)
            if fp.reader is not None:
                fp.reader.join(5)
        if self.store is not None:
            self.store.close()
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            try:
                self.server_exit = self.server.wait(20)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait(5)
        if self.server_log is not None:
            self.server_log.close()
        if self.broker is not None:
            self.broker.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="demo/run.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--vehicles", type=int, default=200, help="fleet size (default 200)")
    p.add_argument("--batches", type=int, default=36, help="batches the platform publishes (default 36)")
    p.add_argument("--interval", type=float, default=0.75, help="seconds between batches (default 0.75)")
    p.add_argument("--seed", type=int, default=7, help="random seed: same seed, same scenario (default 7)")
    p.add_argument("--late", type=float, default=0.10, help="share of vehicles offline at first (default 0.10)")
    p.add_argument("--reconnect", type=float, default=0.075, help="share that reconnect clean (default 0.075)")
    p.add_argument("--resume", type=float, default=0.05, help="share that resume a session (default 0.05)")
    p.add_argument("--answer", type=float, default=0.7, help="share that answer what awaits an answer (default 0.7)")
    p.add_argument(
        "--response-timeout",
        type=float,
        default=3.0,
        help="the server's response_timeout_s: an unanswered request fails after it (default 3; the server's is 300)",
    )
    p.add_argument("--per-proc", type=int, default=100, help="vehicles per fleet process (default 100, max ~300)")
    p.add_argument(
        "--processes",
        type=int,
        help="server processes (default: the server's own default, one per CPU; 0 = the same)",
    )
    p.add_argument("--drain-timeout", type=float, default=60.0, help="seconds after the last batch (default 60)")
    p.add_argument(
        "--progress-interval",
        type=float,
        default=0.5,
        help="the server's progress_interval_s: seconds between progress messages (default 0.5; the server's is 5)",
    )
    p.add_argument(
        "--no-campaigns",
        dest="campaigns",
        action="store_false",
        help="skip the campaign-control act (paced, aborted, windowed, recall) after the main scenario",
    )
    p.add_argument("--log-dir", help="server, broker and fleet logs (default: var/demo in the checkout)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (LMDB data) for `sdv-fanout stats`")
    p.add_argument(
        "--broker",
        choices=("auto", "emqx", "sim"),
        default="auto",
        help="auto (default): the real EMQX when a release is found, else the simulator",
    )
    p.add_argument("--emqx-version", help="EMQX release to run (default 5.8.9 when present, else the newest)")
    args = p.parse_args(argv)
    if not 1 <= args.vehicles <= 10_000 or args.batches < 1 or args.interval < 0 or not 1 <= args.per_proc <= 300:
        p.error("need 1 <= --vehicles <= 10000, --batches >= 1, --interval >= 0, 1 <= --per-proc <= 300")
    if args.progress_interval <= 0:
        p.error("--progress-interval must be > 0")
    if args.processes is not None and args.processes < 0:
        p.error("--processes must be >= 0")
    if args.late + args.reconnect + args.resume > 1:
        p.error("--late + --reconnect + --resume must not exceed 1")
    if not 0 <= args.answer <= 1 or args.response_timeout <= 0:
        p.error("need 0 <= --answer <= 1 and --response-timeout > 0")
    if args.log_dir is None:
        args.log_dir = str(ROOT / "var" / "demo")

    received: list[int] = []

    def on_term(signum: int, frame: Any) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    # testkit/emqx_real.py reports through structlog: keep its info lines out of the demo's output.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    demo = Demo(args)
    code = 1
    try:
        code = demo.run()
    except KeyboardInterrupt:
        demo.status.done()
        print("\ninterrupted: stopping everything", flush=True)
        code = 128 + (received[0] if received else signal.SIGINT)
    except EmqxError as exc:  # says what is missing or what the node logged: no traceback needed
        demo.status.done()
        print(f"\ndemo failed: {exc}", file=sys.stderr, flush=True)
        code = 1
    except Exception as exc:
        demo.status.done()
        traceback.print_exc()
        print(f"\ndemo failed: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip the clean-up
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            demo.stop()
            if not demo.shutdown_clean() and code == 0:
                code = 1
        finally:
            broker_logs = "emqx-*/log/" if demo.broker is not None and demo.broker.kind == "emqx" else "mosquitto-*.log"
            print(f"logs: {demo.log_dir} (server.log, {broker_logs}, fleet-*.log)")
            if args.keep:
                print(f"kept: {demo.tmp}  (try: .venv/bin/sdv-fanout stats --data-dir {demo.tmp / 'lmdb'})")
            else:
                shutil.rmtree(demo.tmp, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
