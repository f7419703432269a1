"""Issue 13 lifecycle costs, paired: the expiry index on ingest, and response mode end to end.

Loopback only, fixed seeds; each round runs both sides of a part once on the same work, the
order alternating round by round (machines are noisy: each ratio is one round's pair, and the
report gives medians and min-max of those ratios).

1. Ingest (the batches and gRPC driver of bench/ingest.py): per side and round a fresh
   `sdv-fanout serve` (its delivery client connected to the run's mosquitto, no vehicle online:
   nothing is delivered) fed the same seed batches of 200 VINs from 8 channels, closed loop, each
   counted once answered (fsynced).
   * without: the batches as today;
   * with: the same batches carrying `"expires_at"`, an integer epoch-ms an hour ahead, the same
     instant for every batch (a campaign's deadline), so every row also gets an entry in the
     expiry (deadline) index and the expiry sweep has a table to look at;
   * per_batch: the same, each batch's `expires_at` 1 ms after the one before (a platform
     stamping now + 1 h at each send), so the index is written in a different key order.
   The order of the three sides rotates round by round (six rounds run every order).
   VIN-rows/s, server CPU per row and, from LMDB's own page counts after the run, which tables
   grew with `expires_at` and by how many bytes per row.
2. End to end (the rig of bench/e2e.py: mosquitto, a server with delivery, `--vehicles` sim
   vehicles whose driver calls our hooks as EMQX would), one rig for the whole run; per
   measurement `--requests` M batches each naming every vehicle:
   * puback: the batches as today; a vehicle's PUBACK (its `message.acked` hook) completes the
     request and frees its slot;
   * response: the batches with `"await_response": true`; every vehicle publishes its answer
     (QoS 1, `--response-bytes`) on `agent/<VIN>/proxy/response/<request_id>` right after its
     PUBACK, through `message.publish` as EMQX would call it, and that answer completes the request.
   Completed requests/s = N x M over first publish -> the store holding 0 rows; CPU per completed
   request of each process from /proc.
   A platform subscriber (a helper process running this script, QoS 1 on `$SDV-FANOUT/status/#`)
   counts the status events and sums the counts of every `completed` generation, so the report
   shows that puback requests ended `delivered` and response requests `responded`.

Markdown to stdout, progress to stderr, --json for the numbers.

    .venv/bin/python -m bench.lifecycle [--rounds 6] [--ingest-batches 1200] [--vehicles 500] [--requests 8] [--json F]
    .venv/bin/python -m bench.lifecycle --rounds 2 --ingest-batches 150 --vehicles 100 --requests 3   # smoke, ~1 min
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
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lmdb
from paho.mqtt.enums import MQTTErrorCode

from bench import e2e, ingest
from bench.status_cost import order
from exhook_server._proto import exhook_v3_pb2 as pb
from storage.lmdb.store import now_ms
from testkit.emqx_sim import LOOPBACK, Mosquitto
from testkit.plumbing import (
    Child,
    CpuMeter,
    cycle_stats,
    dec,
    machine_meta,
    make_vins,
    min_med_max,
    num,
    quiesce,
    serve_status_counts,
    share,
)

ROOT = Path(__file__).resolve().parent.parent
STATUS_PREFIX = "$SDV-FANOUT/status"  # status_topic_prefix's default
RESPONSE_PREFIX = "agent/{VIN}/proxy/response"  # response_topic_prefix's default
MODES = ("puback", "response")
EXPIRES_AHEAD_MS = 3_600_000  # an hour: nothing expires during the run


def alternate(sides: Sequence[str], r: int) -> list[str]:
    return list(sides) if r % 2 == 0 else list(sides)[::-1]


def mmm(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


# -- 1. ingest ------------------------------------------------------------------------------------

#: The ingest sides: the batches as today, and with `expires_at` an hour ahead, once the same
#: instant for every batch (a campaign's deadline) and once each batch its own, later than the one
#: before (as a platform stamping now + 1 h at each send would).
INGEST_SIDES = ("without", "with", "per_batch")
EXPIRING = ("with", "per_batch")
INGEST_LABEL = {
    "without": "without `expires_at`",
    "with": "with `expires_at`, one epoch-ms an hour ahead for every batch",
    "per_batch": "with `expires_at`, an hour ahead, each batch 1 ms later than the one before",
}


def ingest_workloads(args: argparse.Namespace) -> dict[str, list[ingest.Batch]]:
    """bench/ingest.py's seed batches (VINs, request ids, blobs), serialised once per side, all
    here the same way, so the sides differ only in `expires_at`."""
    base = ingest.make_workload(args.seed, args.ingest_batches, args.vins, args.fleet, args.blob_bytes, 4)
    expires_at = now_ms() + EXPIRES_AHEAD_MS
    out: dict[str, list[ingest.Batch]] = {}
    for side in INGEST_SIDES:
        rng = random.Random(args.seed + 1)  # the same message ids on every side
        batches = []
        for k, b in enumerate(base):
            doc: dict[str, Any] = {
                "ids": b.vins,
                "request_id": b.request_id,
                "data": base64.b64encode(b.blob).decode(),
                "data_encoding": "base64",
            }
            if side == "with":
                doc["expires_at"] = expires_at
            elif side == "per_batch":
                doc["expires_at"] = expires_at + k
            wire = ingest._publish_request(rng, json.dumps(doc).encode())
            batches.append(ingest.Batch(b.vins, b.request_id, b.blob, wire))
        out[side] = batches
    return out


def table_stats(data_dir: Path) -> dict[str, Any]:
    """Every named LMDB table's entries and pages (branch + leaf + overflow), read-only after the run."""
    env = lmdb.open(str(data_dir), readonly=True, lock=True, max_dbs=64, map_size=0)
    try:
        psize = int(env.stat()["psize"])
        used = (int(env.info()["last_pgno"]) + 1) * psize
        tables: dict[str, dict[str, int]] = {}
        with env.begin(buffers=True) as txn:
            names = sorted(bytes(k).decode() for k in txn.cursor().iternext(values=False))
            for name in names:
                try:
                    db = env.open_db(name.encode(), txn=txn, create=False)
                except lmdb.Error:
                    continue  # a plain key of the main table, not a named database
                st = txn.stat(db)
                pages = int(st["branch_pages"]) + int(st["leaf_pages"]) + int(st["overflow_pages"])
                tables[name] = {"entries": int(st["entries"]), "pages": pages}
    finally:
        env.close()
    return {"page_bytes": psize, "file_used_bytes": used, "tables": tables}


def measure_ingest(
    batches: list[ingest.Batch], tmp: Path, args: argparse.Namespace, env: dict[str, str]
) -> dict[str, Any]:
    """One fresh server on `batches` (bench/ingest.py's run_ours), checked, with the store's tables."""
    tmp.mkdir()
    try:
        res = ingest.run_ours(batches, args.clients, tmp, args.log_level, args.server_processes, env)
        res["lmdb"] = table_stats(tmp / "lmdb")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    expected = len(batches) * args.vins
    if res["rows"] != expected:
        raise SystemExit(f"ingest: {res['rows']} rows stored, expected {expected} (batches rejected?)")
    res["rows_per_s"] = expected / res["seconds"]
    res.pop("disk", None)  # bench/ingest.py's view of the older tables; `lmdb` has them all
    return res


def table_growth(rounds: list[dict[str, Any]], side: str, rows: int) -> dict[str, dict[str, float]]:
    """Per table, entries and bytes (pages) per row of `side` over the paired `without` run
    (medians over rounds); tables that moved by under 1 B per row are left out, except the index."""
    out: dict[str, dict[str, float]] = {}
    names = {n for r in rounds for s in (side, "without") for n in r[s]["lmdb"]["tables"]}
    empty = {"entries": 0, "pages": 0}
    for name in sorted(names):
        extra, per_row = [], []
        for r in rounds:
            t, wo = r[side]["lmdb"]["tables"].get(name, empty), r["without"]["lmdb"]["tables"].get(name, empty)
            extra.append(t["entries"] - wo["entries"])
            per_row.append((t["pages"] - wo["pages"]) * r[side]["lmdb"]["page_bytes"] / rows)
        growth = {"extra_entries": statistics.median(extra), "bytes_per_row": statistics.median(per_row)}
        if growth["extra_entries"] >= 0.99 * rows or abs(growth["bytes_per_row"]) >= 1:
            out[name] = growth
    return out


def run_ingest(args: argparse.Namespace, tmp: Path, say: Callable[[str], None]) -> dict[str, Any]:
    work = ingest_workloads(args)
    rows = args.ingest_batches * args.vins
    broker = Mosquitto(tmp, verbose=False).start()
    env = {"SDV_FANOUT_MQTT_URL": broker.url}
    rounds: list[dict[str, Any]] = []
    try:
        for r in range(args.rounds):
            sides = order(INGEST_SIDES, r)
            result: dict[str, Any] = {"order": "->".join(sides)}
            for side in sides:
                result[side] = measure_ingest(work[side], tmp / f"r{r}-{side}", args, env)
            without = result["without"]
            for side in EXPIRING:
                result[f"{side}_over_without"] = result[side]["rows_per_s"] / without["rows_per_s"]
                result[f"cpu_{side}_over_without"] = (
                    result[side]["server_cpu_us_per_row"] / without["server_cpu_us_per_row"]
                )
                result[f"{side}_file_extra_bytes_per_row"] = (
                    result[side]["lmdb"]["file_used_bytes"] - without["lmdb"]["file_used_bytes"]
                ) / rows
            rounds.append(result)
            say(
                f"ingest round {r + 1}/{args.rounds} ({result['order']}): "
                + ", ".join(f"{s} {result[s]['rows_per_s']:,.0f} rows/s" for s in INGEST_SIDES)
                + f", with/without {result['with_over_without']:.3f}, "
                f"per_batch/without {result['per_batch_over_without']:.3f}"
            )
    finally:
        broker.stop()
    growth = {side: table_growth(rounds, side, rows) for side in EXPIRING}
    index = {side: [n for n, g in growth[side].items() if g["extra_entries"] >= 0.99 * rows] for side in EXPIRING}
    if not all(index.values()):
        sizes = {s: rounds[0][s]["lmdb"]["tables"] for s in INGEST_SIDES}
        raise SystemExit(f"ingest: no table holds a row's entry more with expires_at than without: {sizes}")
    keys = [f"{p}{side}{q}" for side in EXPIRING for p, q in (("", "_over_without"), ("cpu_", "_over_without"),
                                                               ("", "_file_extra_bytes_per_row"))]  # fmt: skip
    summary = {k: mmm([r[k] for r in rounds]) for k in keys}
    for side in INGEST_SIDES:
        for key in ("rows_per_s", "server_cpu_us_per_row", "p50_ms", "p99_ms", "batches_per_commit", "other_cpu"):
            summary[f"{side}_{key}"] = mmm([r[side][key] for r in rounds])
    return {
        "batches": args.ingest_batches,
        "rows": rows,
        "rounds": rounds,
        "index": {n: growth["with"][n] for n in index["with"]},
        "growth": growth,
        "summary": summary,
    }


# -- 2. end to end: the vehicles that answer ------------------------------------------------------


def fleet_main(argv: list[str]) -> int:
    """Helper process: bench/e2e_fleet.py's sim fleet whose vehicles, in a phase with
    `"respond": true`, publish an answer after each PUBACK (same JSON-lines protocol)."""
    from bench import e2e_fleet

    p = argparse.ArgumentParser()
    p.add_argument("--mqtt-port", type=int, required=True)
    p.add_argument("--exhook-port", type=int, required=True)
    p.add_argument("--delivery-clientid", required=True)
    p.add_argument("--vins", required=True)
    p.add_argument("--response-bytes", type=int, default=64)
    a = p.parse_args(argv)

    class Answering(e2e_fleet._Stamped):
        """A vehicle's received log whose append (in the clientid's hook lane, after the PUBACK
        and its message.acked call) first publishes the vehicle's answer when the phase asks."""

        def __init__(self, fleet: RespondingFleet, vehicle: Any) -> None:
            super().__init__()
            self.fleet = fleet
            self.vehicle = vehicle

        def append(self, item: Any) -> None:
            if self.fleet.respond:
                self.fleet.answer(self.vehicle, item.topic)
            super().append(item)

    class RespondingFleet(e2e_fleet.SimFleet):
        def __init__(self) -> None:
            super().__init__(a.vins.split(","), a.exhook_port, a.mqtt_port, a.delivery_clientid)
            self.respond = False
            self.answers: Counter[str] = Counter()  # how message.publish answered the responses
            for v in self.vehicles.values():  # nothing is pending yet: no message can be in between
                v.received = Answering(self, v)

        def answer(self, v: Any, request_topic: str) -> None:
            conn = v._conn
            if conn is None or conn.state != "open":
                self.answers["vehicle_offline"] += 1
                return
            rid = request_topic.rsplit("/", 1)[1]
            topic = f"{RESPONSE_PREFIX.replace('{VIN}', v.vin)}/{rid}"
            body = json.dumps({"request_id": rid, "result": "ok"})
            payload = (body + " " * max(0, a.response_bytes - len(body))).encode()
            emqx = self.emqx
            headers = {"username": v.username, "protocol": "mqtt", "peerhost": LOOPBACK}
            msg = emqx.new_message(topic, payload, 1, v.clientid, headers)
            resp, routed, allowed = emqx._run_publish(msg)  # message.publish, as for a heartbeat
            if resp is None:
                self.answers["not_registered_or_failed"] += 1
            else:
                self.answers[pb.ValuedResponse.ResponsedType.Name(resp.type)] += 1
            if allowed:
                self.answers["routed"] += 1
                info = conn.client.publish(routed.topic, routed.payload, qos=routed.qos)
                if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                    self.answers["publish_failed"] += 1
                emqx._dropped_if_unrouted(routed)

        def phase(self, cmd: dict[str, Any]) -> dict[str, Any]:
            self.respond = bool(cmd.get("respond"))
            before = Counter(self.answers)
            out = super().phase(cmd)
            out["answers"] = dict(self.answers - before)
            return out

    fleet = RespondingFleet()
    try:
        e2e_fleet.emit({"ready": len(fleet.vins)})
        for cmd in e2e_fleet.commands():
            if cmd["cmd"] != "phase":
                raise SystemExit(f"unknown command {cmd}")
            e2e_fleet.emit({"done": fleet.phase(cmd)})
    finally:
        fleet.close()
    return 0


class Rig(e2e.Rig):
    """bench/e2e.py's rig whose sim fleets are this script's answering fleets."""

    def start_sims(self) -> None:
        assert self.server is not None
        for k, vins in enumerate(self.slices()):
            argv = [sys.executable, "-m", "bench.lifecycle", "--sim-fleet", "--mqtt-port", str(self.broker.port),
                    "--exhook-port", str(self.server.port), "--delivery-clientid", self.delivery_clientid,
                    "--vins", ",".join(vins), "--response-bytes", str(self.args.response_bytes)]  # fmt: skip
            child = Child(f"sim{k}", argv, self.tmp / f"sim{k}.log")
            self.children.append(child)
            self.sims.append(child)
        for c in self.sims:
            c.recv(self.args.deadline_s)  # {"ready": n}


# -- the platform: status events by mode --------------------------------------------------------


def mode_of(request_id: str) -> str:
    """Request ids of this bench are `task_<mode>_<tag>_<k>`."""
    parts = request_id.split("_")
    return parts[1] if len(parts) > 2 and parts[0] == "task" else "?"


def platform_main(port: int) -> int:
    """Helper process: subscribed QoS 1 to the status topic; answers {"cmd": "counts"} with the
    events per mode and the summed counts of the `completed` generations per mode."""
    events: dict[str, Counter[str]] = {}
    completed: dict[tuple[str, str], dict[str, int]] = {}  # (request_id, sha1) -> counts

    def record(doc: dict[str, Any]) -> None:
        rid = str(doc.get("request_id", ""))
        events.setdefault(mode_of(rid), Counter())[doc.get("event", "?")] += 1
        if doc.get("event") == "completed":
            completed[rid, str(doc.get("sha1"))] = dict(doc.get("counts") or {})

    def answer() -> dict[str, Any]:
        sums: dict[str, Counter[str]] = {}
        gens: Counter[str] = Counter()
        for (rid, _), counts in completed.items():
            sums.setdefault(mode_of(rid), Counter()).update(counts)
            gens[mode_of(rid)] += 1
        return {
            "events": {m: dict(c) for m, c in events.items()},
            "completed": {m: dict(c) for m, c in sums.items()},
            "completed_gens": dict(gens),
        }

    clientid = f"bench-lifecycle-platform-{os.getpid()}"
    return serve_status_counts(port, f"{STATUS_PREFIX}/#", clientid, record, answer)


class Platform:
    def __init__(self, port: int, log_dir: Path) -> None:
        argv = [sys.executable, "-m", "bench.lifecycle", "--platform-port", str(port)]
        self.child = Child("platform", argv, log_dir / "platform.log")
        try:
            self.child.recv(15)
        except BaseException:
            self.child.stop()
            raise

    def counts(self) -> dict[str, Any]:
        self.child.send({"cmd": "counts"})
        return self.child.recv(10)

    def settle(self, quiet_s: float = 0.5, timeout_s: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        answer = self.counts()
        while answer["idle_s"] < quiet_s and time.monotonic() < deadline:
            time.sleep(0.1)
            answer = self.counts()
        return answer

    def wait_completed(self, gens: dict[str, int], timeout_s: float) -> dict[str, Any]:
        """Wait (bounded) until every mode has `gens[mode]` completed generations."""
        deadline = time.monotonic() + timeout_s
        answer = self.counts()
        while time.monotonic() < deadline and any(answer["completed_gens"].get(m, 0) < n for m, n in gens.items()):
            time.sleep(0.2)
            answer = self.counts()
        return answer

    def stop(self) -> None:
        self.child.stop()


def event_diff(after: dict[str, Any], before: dict[str, Any], mode: str) -> dict[str, int]:
    a, b = Counter(after["events"].get(mode, {})), Counter(before["events"].get(mode, {}))
    return {k: a[k] - b[k] for k in sorted(a) if a[k] - b[k]}


# -- 2. end to end: measurement -----------------------------------------------------------------


def run_mode(rig: Rig, platform: Platform, mode: str, tag: str, requests: int, seed: int) -> dict[str, Any]:
    """M batches naming every vehicle, in `mode`; first publish -> 0 rows pending."""
    assert rig.emqx is not None and rig.server is not None and rig.broker.proc is not None
    n = len(rig.vins)
    rng = random.Random(seed)
    rids = [f"task_{mode}_{tag}_{k}" for k in range(requests)]
    payloads = [rng.randbytes(rig.args.payload_bytes) for _ in rids]
    extra: dict[str, Any] = {"await_response": True} if mode == "response" else {}
    rig.arm(rig.sims, requests, respond=mode == "response")
    before = platform.counts()
    meter = CpuMeter(
        {
            "server": rig.server_pids,
            "mosquitto": [rig.broker.proc.pid],
            "sim fleet": [c.proc.pid for c in rig.sims],
            "platform": [platform.child.proc.pid],
        }
    )
    t0 = time.time()
    for rid, payload in zip(rids, payloads, strict=True):
        resp = rig.emqx.publish_batch(rig.vins, rid, payload, **extra)
        if resp is None or resp.type != pb.ValuedResponse.STOP_AND_RETURN:
            raise RuntimeError(f"batch {rid} not stored: {resp or e2e.rpc_error(rig)}")
    published = time.time()
    try:
        end = rig.wait_rows_zero()
    except RuntimeError as exc:
        topics = (rig.emqx.hooks or {}).get("message.publish")
        raise RuntimeError(f"{mode}: {exc}; the server's message.publish topics: {topics}") from None
    cpu = meter.shares()
    done = rig.collect(rig.sims, n * requests)
    seconds = end - t0
    answers: Counter[str] = Counter()
    for d in done:
        answers.update(d.get("answers", {}))
    return {
        "seconds": seconds,
        "per_s": n * requests / seconds,
        "publish_s": published - t0,
        **cycle_stats(done),
        "duplicates": sum(d["count"] - d["distinct"] for d in done),
        "answers": dict(answers),
        "status": event_diff(platform.settle(quiet_s=0.3, timeout_s=5), before, mode),
        "cpu": cpu,
        "cpu_us_per_request": {g: v * seconds / (n * requests) * 1e6 for g, v in cpu.items()},
    }


def run_end_to_end(args: argparse.Namespace, tmp: Path, say: Callable[[str], None]) -> dict[str, Any]:
    vins = make_vins(args.seed, args.vehicles)
    rig = Rig(args, tmp, vins)
    platform: Platform | None = None
    rounds: list[dict[str, Any]] = []
    try:
        rig.start_server()
        rig.start_sims()
        platform = Platform(rig.broker.port, tmp)
        for mode in MODES:  # unrecorded warm-up of both paths (and an early failure if one is broken)
            warm = run_mode(rig, platform, mode, "warm", 2, args.seed)
            if mode == "response" and warm["answers"].get("not_registered_or_failed"):
                topics = (rig.emqx.hooks or {}).get("message.publish") if rig.emqx else None
                raise RuntimeError(
                    f"the vehicles' answers were not taken: {warm['answers']} (message.publish answers; "
                    f"the server's message.publish topics: {topics})"
                )
        say(f"e2e: server, {args.vehicles} vehicles and the platform's subscriber up; both modes warmed up")
        quiesce(rig.server_pids)
        for r in range(args.rounds):
            modes = alternate(MODES, r)
            result: dict[str, Any] = {"order": "->".join(modes)}
            seed = args.seed + 1000 * (r + 1)  # the same request payloads in both modes of a round
            for mode in modes:
                quiesce(rig.server_pids, timeout_s=10)
                result[mode] = run_mode(rig, platform, mode, f"r{r}", args.requests, seed)
            result["response_over_puback"] = result["response"]["per_s"] / result["puback"]["per_s"]
            result["cpu_response_over_puback"] = (
                result["response"]["cpu_us_per_request"]["server"] / result["puback"]["cpu_us_per_request"]["server"]
            )
            rounds.append(result)
            say(
                f"e2e round {r + 1}/{args.rounds} ({result['order']}): puback {result['puback']['per_s']:,.0f}/s, "
                f"response {result['response']['per_s']:,.0f}/s, response/puback "
                f"{result['response_over_puback']:.3f}"
            )
        gens = {m: 2 + args.rounds * args.requests for m in MODES}  # a generation per batch, warm-up included
        totals = platform.wait_completed(gens, timeout_s=20)
    finally:
        if platform is not None:
            platform.stop()
        rig.close()
    summary = {k: mmm([r[k] for r in rounds]) for k in ("response_over_puback", "cpu_response_over_puback")}
    for mode in MODES:
        summary[f"{mode}_per_s"] = mmm([r[mode]["per_s"] for r in rounds])
        for group in ("server", "mosquitto", "sim fleet", "platform", "bench", "total", "other processes"):
            summary[f"{mode}_{group.replace(' ', '_')}_us_per_request"] = mmm(
                [r[mode]["cpu_us_per_request"][group] for r in rounds]
            )
    requests = {m: gens[m] * args.vehicles for m in MODES}
    return {"rounds": rounds, "summary": summary, "status_totals": totals, "expected_gens": gens,
            "expected_requests": requests, "problems": e2e_problems(totals, gens, requests)}  # fmt: skip


def e2e_problems(totals: dict[str, Any], gens: dict[str, int], requests: dict[str, int]) -> list[str]:
    """What the platform heard that does not fit the spec: every puback request `delivered`,
    every response request `responded` with one `response` event each."""
    problems = []
    outcome = {"puback": "delivered", "response": "responded"}
    for mode in MODES:
        got = totals["completed_gens"].get(mode, 0)
        if got != gens[mode]:
            problems.append(f"{mode}: {got} of {gens[mode]} generations reported completed")
        counts = totals["completed"].get(mode, {})
        if counts.get(outcome[mode], 0) != requests[mode]:
            problems.append(f"{mode}: completed counts {counts}, expected {outcome[mode]} {requests[mode]}")
    events = totals["events"].get("response", {}).get("response", 0)
    if events != requests["response"]:
        problems.append(f"response: {events} `response` status events, expected {requests['response']}")
    return problems


# -- report ---------------------------------------------------------------------------------------


def dec3(v: float) -> str:
    return f"{v:.3f}"


def ingest_markdown(ing: dict[str, Any], meta: dict[str, Any]) -> str:
    rounds = ing["rounds"]

    def col(side: str, key: str) -> list[float]:
        return [r[side][key] for r in rounds]

    def ratio(key: str) -> str:
        return min_med_max([r[key] for r in rounds], dec3)

    lines = [
        f"### Ingest: the expiry index, {ing['batches']:,} batches x {meta['vins']} VINs per side, "
        f"{len(rounds)} rounds, {meta['clients']} channels, 1 KiB blobs",
        "",
        "| metric | min | median | max |",
        "|---|---:|---:|---:|",
    ]
    for side in INGEST_SIDES:
        lines.append(f"| {INGEST_LABEL[side]}: VIN-rows/s | {min_med_max(col(side, 'rows_per_s'), num)} |")
    lines += [
        f"| **ratio with/without VIN-rows/s** (paired; one deadline for every batch) | {ratio('with_over_without')} |",
        f"| ratio per_batch/without VIN-rows/s (paired; a deadline per batch) | {ratio('per_batch_over_without')} |",
    ]
    for side in INGEST_SIDES:
        lines.append(f"| {side}: server CPU µs per VIN-row | {min_med_max(col(side, 'server_cpu_us_per_row'), dec)} |")
    lines += [
        f"| server CPU per row, with/without (paired) | {ratio('cpu_with_over_without')} |",
        f"| server CPU per row, per_batch/without (paired) | {ratio('cpu_per_batch_over_without')} |",
    ]
    for side in INGEST_SIDES:
        lines += [
            f"| {side}: batch latency p50 / p99 ms (medians) | {statistics.median(col(side, 'p50_ms')):.1f} / "
            f"{statistics.median(col(side, 'p99_ms')):.1f} | | |",
            f"| {side}: batches per commit | {min_med_max(col(side, 'batches_per_commit'), dec)} |",
        ]
    for side in EXPIRING:
        lines.append(
            f"| LMDB file bytes used per row, {side} - without (free pages included) | "
            f"{min_med_max([r[f'{side}_file_extra_bytes_per_row'] for r in rounds], num)} |"
        )
    other = [r[s]["other_cpu"] for r in rounds for s in INGEST_SIDES]
    lines.append(f"| **other processes' CPU** (of one core; mosquitto included) | {min_med_max(other, share)} |")
    lines += [
        "",
        "| round | order | without rows/s | with rows/s | per_batch rows/s | with/without | per_batch/without | "
        "server µs/row without / with / per_batch |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for i, r in enumerate(rounds, 1):
        us = " / ".join(f"{r[s]['server_cpu_us_per_row']:.2f}" for s in INGEST_SIDES)
        lines.append(
            f"| {i} | {r['order']} | "
            + " | ".join(f"{r[s]['rows_per_s']:,.0f}" for s in INGEST_SIDES)
            + f" | {r['with_over_without']:.3f} | {r['per_batch_over_without']:.3f} | {us} |"
        )

    def growth(side: str) -> str:
        return ", ".join(
            f"`{name}` {g['bytes_per_row']:+.1f} B"
            + (f" (+{g['extra_entries']:,.0f} entries)" if g["extra_entries"] else "")
            for name, g in ing["growth"][side].items()
        )

    lines += [
        "",
        f"Each side: a fresh server ({rounds[0]['with']['server_processes']} process(es)) and data dir, its delivery "
        "client connected to the run's mosquitto (no vehicle online: nothing delivered), the same batches (a request "
        "id each) differing only in `expires_at`; the order of the three sides rotates round by round. LMDB pages "
        f"per row over the paired run without `expires_at` (medians): with: {growth('with')}; per_batch: "
        f"{growth('per_batch')}.",
    ]
    return "\n".join(lines)


def e2e_markdown(e: dict[str, Any], meta: dict[str, Any]) -> str:
    rounds = e["rounds"]
    n, m = meta["vehicles"], meta["requests"]

    def col(mode: str, key: str) -> list[float]:
        return [r[mode][key] for r in rounds]

    def cpu(mode: str, group: str) -> list[float]:
        return [r[mode]["cpu_us_per_request"][group] for r in rounds]

    lines = [
        f"### End to end: response mode next to PUBACK mode, {n:,} vehicles x {m} requests = {n * m:,} requests "
        f"per measurement, {len(rounds)} rounds",
        "",
        "| metric | min | median | max |",
        "|---|---:|---:|---:|",
        f"| puback (PUBACK completes the request) completed requests/s | {min_med_max(col('puback', 'per_s'), num)} |",
        f'| response (`"await_response": true`, answer after the PUBACK) completed requests/s | '
        f"{min_med_max(col('response', 'per_s'), num)} |",
        f"| **ratio response/puback requests/s** (paired) | "
        f"{min_med_max([r['response_over_puback'] for r in rounds], dec3)} |",
        f"| puback: server CPU µs per completed request | {min_med_max(cpu('puback', 'server'), num)} |",
        f"| response: server CPU µs per completed request | {min_med_max(cpu('response', 'server'), num)} |",
        f"| server CPU per request, response/puback (paired) | "
        f"{min_med_max([r['cpu_response_over_puback'] for r in rounds], dec3)} |",
        f"| per-vehicle cycle p50 ms (receive -> next receive), puback / response (medians) | "
        f"{statistics.median(col('puback', 'cycle_p50_ms')):.1f} / "
        f"{statistics.median(col('response', 'cycle_p50_ms')):.1f} | | |",
    ]
    for group, label in (
        ("mosquitto", "mosquitto"),
        ("sim fleet", "sim fleet (vehicles + EMQX hook driver)"),
        ("platform", "the platform's status subscriber"),
        ("bench", "this bench (FakeEmqx batches)"),
        ("total", "all of the above + server"),
        ("other processes", "other processes"),
    ):
        cells = " / ".join(f"{statistics.median(cpu(mode, group)):,.0f}" for mode in MODES)
        lines.append(f"| {label} CPU µs per request, puback / response (medians) | {cells} | | |")
    lines += [
        "",
        "| round | order | puback req/s | response req/s | response/puback | server µs/req puback / response | "
        "status events (response mode) |",
        "|---:|---|---:|---:|---:|---|---|",
    ]
    for i, r in enumerate(rounds, 1):
        got = ", ".join(f"{k} {v:,}" for k, v in r["response"]["status"].items()) or "none"
        lines.append(
            f"| {i} | {r['order']} | {r['puback']['per_s']:,.0f} | {r['response']['per_s']:,.0f} | "
            f"{r['response_over_puback']:.3f} | {r['puback']['cpu_us_per_request']['server']:,.0f} / "
            f"{r['response']['cpu_us_per_request']['server']:,.0f} | {got} |"
        )
    totals = e["status_totals"]
    checks = []
    for mode in MODES:
        counts = totals["completed"].get(mode, {})
        shown = ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items()) if v) or "none"
        checks.append(
            f"{mode}: {totals['completed_gens'].get(mode, 0):,} of {e['expected_gens'][mode]:,} generations "
            f"completed ({shown}; {e['expected_requests'][mode]:,} requests sent)"
        )
    answers: Counter[str] = Counter()
    for r in rounds:
        answers.update(r["response"]["answers"])
    dups = sum(r[mode]["duplicates"] for r in rounds for mode in MODES)
    lines += [
        "",
        "Outcomes the platform's subscriber summed from the `completed` events (warm-up included): "
        + "; ".join(checks)
        + ". The vehicles' answers, as `message.publish` answered them: "
        + (", ".join(f"{k} {v:,}" for k, v in sorted(answers.items())) or "none")
        + f". Duplicate deliveries over all rounds: {dups}. One rig for the whole run (mosquitto, server with "
        f"{meta['server_processes_label']}, {meta['procs']} sim fleet processes), request payload "
        f"{meta['payload_bytes']} B, answer {meta['response_bytes']} B, status topic on (defaults).",
    ]
    for problem in e["problems"]:
        lines += ["", f"**(!) Not as specified:** {problem}."]
    return "\n".join(lines)


# -- main -----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--sim-fleet"]:
        return fleet_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6, help="paired rounds of ingest and of e2e (default 6)")
    p.add_argument("--ingest-batches", type=int, default=1200, help="batches per ingest side (default 1200)")
    p.add_argument("--vins", type=int, default=200, help="VINs per ingest batch (default 200)")
    p.add_argument("--fleet", type=int, default=20_000, help="distinct VINs the ingest batches draw from")
    p.add_argument("--blob-bytes", type=int, default=1024, help="ingest payload size (default 1024)")
    p.add_argument("--clients", type=int, default=8, help="ingest gRPC channels (default 8)")
    p.add_argument("--vehicles", type=int, default=500, help="e2e vehicles N (default 500)")
    p.add_argument("--requests", type=int, default=8,
                   help="e2e requests M per vehicle and measurement: M batches naming all (default 8)")  # fmt: skip
    p.add_argument("--procs", type=int, default=2, help="e2e sim fleet processes (default 2)")
    p.add_argument("--payload-bytes", type=int, default=256, help="e2e request payload size (default 256)")
    p.add_argument("--response-bytes", type=int, default=64, help="each vehicle's answer size (default 64)")
    p.add_argument("--only", default="ingest,e2e", help="parts to run (default ingest,e2e)")
    p.add_argument("--server-processes", type=int, default=0,
                   help="SDV_FANOUT_PROCESSES for every server (default 0: theirs, one per CPU)")  # fmt: skip
    p.add_argument("--deadline-s", type=float, default=120, help="give up on an e2e phase after this (default 120)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--seed", type=int, default=20261124)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    p.add_argument("--keep-tmp", action="store_true", help="keep the tmp dir (logs, LMDB) even after a success")
    p.add_argument("--platform-port", type=int, help=argparse.SUPPRESS)  # the Platform helper
    args = p.parse_args(argv)
    if args.platform_port:
        return platform_main(args.platform_port)
    parts = {x.strip() for x in args.only.split(",") if x.strip()}
    if (
        parts - {"ingest", "e2e"}
        or not parts
        or min(args.rounds, args.ingest_batches, args.vehicles, args.requests) < 1
    ):
        p.error("--only takes ingest, e2e; --rounds, --ingest-batches, --vehicles, --requests must be positive")
    args.procs = max(args.procs, -(-args.vehicles // e2e.MAX_PER_PROC))
    args.max_inflight = 50  # bench/e2e.py's Rig reads it (raw publisher, not started here)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the finally blocks
    wall0 = time.monotonic()
    load_before = os.getloadavg()[0]
    tmp_root = Path(tempfile.mkdtemp(prefix="sdv-bench-lifecycle-"))

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - wall0:6.1f} s] {msg}", file=sys.stderr, flush=True)

    say(f"1-min load average before: {load_before:.2f}")
    out: dict[str, Any] = {}
    completed = False
    try:
        if "ingest" in parts:
            (tmp_root / "ingest").mkdir()
            out["ingest"] = run_ingest(args, tmp_root / "ingest", say)
        if "e2e" in parts:
            (tmp_root / "e2e").mkdir()
            out["e2e"] = run_end_to_end(args, tmp_root / "e2e", say)
        completed = True
    finally:
        if completed and not args.keep_tmp:
            shutil.rmtree(tmp_root, ignore_errors=True)
        else:
            print(f"kept {tmp_root} (server, broker and fleet logs, LMDB)", file=sys.stderr)

    meta = {
        "rounds": args.rounds,
        "vins": args.vins,
        "clients": args.clients,
        "vehicles": args.vehicles,
        "requests": args.requests,
        "procs": args.procs,
        "payload_bytes": args.payload_bytes,
        "response_bytes": args.response_bytes,
        "seed": args.seed,
        "server_processes_label": f"{args.server_processes} process(es)" if args.server_processes else
        "its default process count",
        "commit": subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                                 text=True, check=False).stdout.strip(),
        **machine_meta(load_before, wall0),
    }  # fmt: skip
    say(f"1-min load average after: {meta['loadavg_1m_after']:.2f}")
    parts_md = []
    if "ingest" in out:
        parts_md.append(ingest_markdown(out["ingest"], meta))
    if "e2e" in out:
        parts_md.append(e2e_markdown(out["e2e"], meta))
    parts_md.append(
        f"Code under test: {meta['commit']} (the checkout, as every bench here). {meta['cpus']} CPUs shared by "
        f"everything; 1-min load average {meta['loadavg_1m_before']:.2f} before, {meta['loadavg_1m_after']:.2f} "
        f"after; {meta['wall_s']:.0f} s wall. Seed {meta['seed']}."
    )
    print("\n\n".join(parts_md))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, **out}, indent=2))
    problems = out.get("e2e", {}).get("problems", [])
    for problem in problems:
        print(f"not as specified: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
