"""What the status topic costs (issue 12): ingest and end to end with status on vs off, paired, and disk per outcome.

Loopback only, fixed seeds; within a round every side runs once on the same work, and the order
of the sides changes round by round (six rounds run every order of three sides), so each ratio
is one round's pair.

1. Ingest (the batches and gRPC driver of bench/ingest.py): per side and round a fresh
   `sdv-fanout serve` whose delivery client is connected to one mosquitto, fed the same
   seed-000 batches from 8 channels, closed loop; a batch counts once answered (fsynced).
   * on: the defaults: an `accepted` receipt per batch on `$SDV-FANOUT/status/<R>` and
     `progress` every 5 s (each side runs over 5 s, so a progress look with the run's new
     generations falls inside it);
   * off: `status_topic_prefix = ""`: no receipts, no progress;
   * before (`--before REV`): the server of an older commit, unpacked from git into tmp and
     run through PYTHONPATH. The outcome records and per-generation counts cannot be switched
     off by a setting; with REV the last commit without them, off/before is their cost
     (plus whatever else changed in the ingest path since REV).
2. End to end (the rig of bench/e2e.py): one mosquitto + server + sim fleet per setting, all
   up for the whole run, same VINs and payloads: off, on (receipts + progress every 5 s) and
   per_vehicle (on + one `vehicle` event per delivery). Delivered+acked msgs/s, first publish
   to 0 rows, and CPU per message of each process.
3. Disk per outcome, in this process on a fresh store: N rows stored (200-VIN batches, a
   request id each: a generation per 200 outcomes, the most generations per outcome an
   ingest makes), then every one delivered through `batches.delete_row_if` (100 per commit, VINs
   shuffled per request round, as an online fleet acks them). LMDB pages of `outcomes` and
   `outcome_expiry` after vs before the deliveries, plus the whole `gens` table, over N.

A platform subscriber (paho, in this process, QoS 1) on each broker counts the status messages
by event, so a receipt counts as published only once the platform has it. Markdown to stdout,
progress to stderr, --json for the numbers.

    .venv/bin/python -m bench.status_cost [--before 7fd2d64] [--rounds 6] [--json F]
    .venv/bin/python -m bench.status_cost --ingest-batches 100 --vehicles 100 --batches 3 --rounds 2 --disk-n 2000
"""

from __future__ import annotations

import argparse
import copy
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

from bench import e2e, ingest
from storage.lmdb import batches
from storage.lmdb.store import Store, now_ms
from testkit.emqx_sim import Mosquitto
from testkit.plumbing import (
    Child,
    dec,
    machine_meta,
    make_vins,
    min_med_max,
    num,
    quiesce,
    serve_status_counts,
    share,
    unpack_tree,
)

ROOT = Path(__file__).resolve().parent.parent
#: status_topic_prefix's default: what "on" publishes to.
STATUS_PREFIX = "$SDV-FANOUT/status"
OFF = {"SDV_FANOUT_STATUS_TOPIC_PREFIX": ""}
#: The server settings of each end-to-end side (on top of bench/e2e.py's).
E2E_SIDES: dict[str, dict[str, str]] = {"off": OFF, "on": {}, "per_vehicle": {"SDV_FANOUT_STATUS_PER_VEHICLE": "true"}}
#: The issue's target: status costs at most 10 % of ingest and of end-to-end throughput.
TARGET = 0.9


def order(sides: Sequence[str], r: int) -> list[str]:
    """Round r's order: rotated every other round and reversed every other, so six rounds run
    all orders of three sides (two sides simply alternate in pairs)."""
    k = (r // 2) % len(sides)
    rotated = [*sides[k:], *sides[:k]]
    return rotated if r % 2 == 0 else rotated[::-1]


def ratios(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


# -- the platform: a subscriber on the status topic -----------------------------------------------


class StatusListener:
    """The platform: a helper process (this script with --platform-port) whose paho client is
    subscribed QoS 1 to `<prefix>/#` and counts messages by their `event`. Its own process, so
    its work never holds this process's GIL (the ingest driver's, FakeEmqx's)."""

    def __init__(self, port: int, name: str, log_dir: Path, timeout_s: float = 15.0) -> None:
        argv = [sys.executable, "-m", "bench.status_cost", "--platform-port", str(port), "--platform-name", name]
        self.child = Child(f"platform-{name}", argv, log_dir / f"platform-{name}.log")
        try:
            self.child.recv(timeout_s)  # {"ready": true}: subscribed
        except BaseException:
            self.child.stop()
            raise

    def _ask(self) -> dict[str, Any]:
        self.child.send({"cmd": "counts"})
        return self.child.recv(10)

    def snapshot(self) -> Counter[str]:
        return Counter(self._ask()["counts"])

    def settle(self, quiet_s: float = 0.5, timeout_s: float = 10.0) -> Counter[str]:
        """The counts once nothing arrived for `quiet_s` (at most `timeout_s` of waiting)."""
        deadline = time.monotonic() + timeout_s
        answer = self._ask()
        while answer["idle_s"] < quiet_s and time.monotonic() < deadline:
            time.sleep(0.1)
            answer = self._ask()
        return Counter(answer["counts"])

    def wait_for(self, event: str, n: int, timeout_s: float) -> int:
        """Wait (bounded) until `n` messages of `event` arrived; how many did."""
        deadline = time.monotonic() + timeout_s
        while (got := self.snapshot()[event]) < n and time.monotonic() < deadline:
            time.sleep(0.2)
        return got

    def stop(self) -> None:
        self.child.stop()


def platform_main(port: int, name: str, prefix: str = STATUS_PREFIX) -> int:
    """The helper of StatusListener: subscribe, then answer {"cmd": "counts"} lines until quit."""
    counts: Counter[str] = Counter()

    def count(doc: dict[str, Any]) -> None:
        counts[doc.get("event", "?")] += 1

    clientid = f"bench-platform-{name}-{os.getpid()}"
    return serve_status_counts(port, f"{prefix}/#", clientid, count, lambda: {"counts": dict(counts)})


def diff(after: Counter[str], before: Counter[str]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in sorted(after) if after[k] - before[k]}


# -- 1. ingest ------------------------------------------------------------------------------------


def run_ingest(args: argparse.Namespace, tmp: Path, say: Callable[[str], None]) -> dict[str, Any]:
    batches = ingest.make_workload(
        args.seed, args.ingest_batches, args.vins, args.fleet, args.blob_bytes, 4, campaigns=args.campaigns
    )
    broker = Mosquitto(tmp, verbose=False).start()
    envs: dict[str, dict[str, str]] = {"off": OFF, "on": {}}
    if args.before:
        tree = unpack_tree(args.before, tmp / "before-tree")
        path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
        envs = {"before": {"PYTHONPATH": path}, **envs}
    envs = {side: {"SDV_FANOUT_MQTT_URL": broker.url, **env} for side, env in envs.items()}
    rounds: list[dict[str, Any]] = []
    listener = None
    try:
        listener = StatusListener(broker.port, "ingest", tmp)
        for r in range(args.rounds):
            sides = order(list(envs), r)
            result: dict[str, Any] = {"order": "->".join(sides)}
            for side in sides:
                before = listener.settle()
                res = ingest.measure("ours", batches, tmp / f"r{r}-{side}", args, envs[side])
                res["status"] = diff(listener.settle(), before)
                # Which code ran: an older tree's store lacks the newest schema's tables.
                if ("by_request" in res["disk"]["tables"]) == (side == "before"):
                    raise SystemExit(f"ingest {side}: unexpected tables {res['disk']['tables']}")
                result[side] = res
            result["on_over_off"] = result["on"]["rows_per_s"] / result["off"]["rows_per_s"]
            result["cpu_on_over_off"] = result["on"]["server_cpu_us_per_row"] / result["off"]["server_cpu_us_per_row"]
            if "before" in result:
                result["off_over_before"] = result["off"]["rows_per_s"] / result["before"]["rows_per_s"]
                result["on_over_before"] = result["on"]["rows_per_s"] / result["before"]["rows_per_s"]
                result["cpu_off_over_before"] = (
                    result["off"]["server_cpu_us_per_row"] / result["before"]["server_cpu_us_per_row"]
                )
            rounds.append(result)
            say(
                f"ingest round {r + 1}/{args.rounds} ({result['order']}): "
                + ", ".join(f"{s} {result[s]['rows_per_s']:,.0f} rows/s" for s in envs)
                + f", on/off {result['on_over_off']:.3f}"
            )
    finally:
        if listener is not None:
            listener.stop()
        broker.stop()
    keys = ["on_over_off", "cpu_on_over_off", "off_over_before", "on_over_before", "cpu_off_over_before"]
    summary = {k: ratios([r[k] for r in rounds]) for k in keys if k in rounds[0]}
    for side in envs:
        for key in ("rows_per_s", "server_cpu_us_per_row", "p50_ms", "p99_ms", "batches_per_commit", "other_cpu"):
            summary[f"{side}_{key}"] = ratios([r[side][key] for r in rounds])
    return {"sides": list(envs), "batches": len(batches), "rounds": rounds, "summary": summary}


# -- 2. end to end --------------------------------------------------------------------------------


def run_end_to_end(args: argparse.Namespace, tmp: Path, say: Callable[[str], None]) -> dict[str, Any]:
    vins = make_vins(args.seed, args.vehicles)
    rigs: dict[str, e2e.Rig] = {}
    listeners: dict[str, StatusListener] = {}
    rounds: list[dict[str, Any]] = []
    warm_args = copy.copy(args)
    warm_args.batches = 2
    try:
        for side, env in E2E_SIDES.items():
            (tmp / side).mkdir()
            rig = rigs[side] = e2e.Rig(args, tmp / side, vins, env)
            rig.start_server()
            rig.start_sims()
            listeners[side] = StatusListener(rig.broker.port, side, tmp)
            rig.args = warm_args  # e2e.run_ours reads the batch count from the rig's args
            e2e.run_ours(rig, "warm", args.payload_bytes, args.seed)
            rig.args = args
            say(f"e2e {side}: server, {args.vehicles} vehicles and the platform's subscriber up; warmed up")
        for rig in rigs.values():
            quiesce(rig.server_pids)
        for r in range(args.rounds):
            sides = order(list(E2E_SIDES), r)
            result: dict[str, Any] = {"order": "->".join(sides)}
            seed = args.seed + 1000 * (r + 1)  # the same payloads for every side of the round
            for side in sides:
                quiesce(rigs[side].server_pids, timeout_s=10)
                before = listeners[side].snapshot()
                res = e2e.run_ours(rigs[side], f"r{r}", args.payload_bytes, seed)
                res["status"] = diff(listeners[side].settle(quiet_s=0.3, timeout_s=5), before)
                result[side] = res
            for side in ("on", "per_vehicle"):
                result[f"{side}_over_off"] = result[side]["msgs_per_s"] / result["off"]["msgs_per_s"]
                result[f"cpu_{side}_over_off"] = (
                    result[side]["cpu_us_per_msg"]["server"] / result["off"]["cpu_us_per_msg"]["server"]
                )
            rounds.append(result)
            say(
                f"e2e round {r + 1}/{args.rounds} ({result['order']}): "
                + ", ".join(f"{s} {result[s]['msgs_per_s']:,.0f} msgs/s" for s in E2E_SIDES)
                + f", on/off {result['on_over_off']:.3f}, per_vehicle/off {result['per_vehicle_over_off']:.3f}"
            )
        # Every generation (one per batch) ends in `completed` within a progress interval or so.
        gens = (warm_args.batches + args.rounds * args.batches) if args.rounds else warm_args.batches
        totals = {}
        for side, listener in listeners.items():
            if side != "off":
                listener.wait_for("completed", gens, timeout_s=15)
            totals[side] = dict(listener.settle(quiet_s=0.5, timeout_s=5))
    finally:
        for listener in listeners.values():
            listener.stop()
        for rig in rigs.values():
            rig.close()
    summary = {
        k: ratios([r[k] for r in rounds])
        for k in ("on_over_off", "per_vehicle_over_off", "cpu_on_over_off", "cpu_per_vehicle_over_off")
    }
    for side in E2E_SIDES:
        summary[f"{side}_msgs_per_s"] = ratios([r[side]["msgs_per_s"] for r in rounds])
        for group in ("server", "mosquitto", "sim fleet", "bench", "total", "other processes"):
            summary[f"{side}_{group}_us_per_msg"] = ratios([r[side]["cpu_us_per_msg"][group] for r in rounds])
    expected = {"batches": gens, "deliveries": gens * args.vehicles}
    return {"rounds": rounds, "summary": summary, "status_totals": totals, "expected": expected}


# -- 3. disk per outcome --------------------------------------------------------------------------

#: The tables an outcome writes: its record, its time index entry, its generation's counts.
OUTCOME_TABLES = ("outcomes", "outcome_expiry", "gens")
REQUESTS_PER_VIN = 10
BATCH_VINS = 200
ACKS_PER_COMMIT = 100


def table_pages(store: Store) -> tuple[dict[str, dict[str, int]], int]:
    """Pages and entries of the outcome tables (branch + leaf + overflow), and the page size."""
    out = {}
    with store.read() as txn:
        for name in OUTCOME_TABLES:
            st = txn.stat(getattr(store.tables, name))
            out[name] = {
                "pages": int(st["branch_pages"]) + int(st["leaf_pages"]) + int(st["overflow_pages"]),
                "entries": int(st["entries"]),
            }
    return out, int(store.env.stat()["psize"])


def outcome_disk(n: int, tmp: Path, seed: int) -> dict[str, Any]:
    """N rows stored, then each delivered; bytes of the outcome tables per outcome."""
    rng = random.Random(seed)
    fleet = make_vins(seed, max(BATCH_VINS, n // REQUESTS_PER_VIN))
    n = len(fleet) * REQUESTS_PER_VIN
    store = Store(tmp)
    try:
        t = store.tables
        # (request k, VIN) -> its request id and payload sha1: a batch of 200 VINs per request id.
        rows: list[dict[str, tuple[str, bytes]]] = []
        for k in range(REQUESTS_PER_VIN):
            mine: dict[str, tuple[str, bytes]] = {}
            for j in range(0, len(fleet), BATCH_VINS):
                vins, rid, blob = fleet[j : j + BATCH_VINS], f"task_ota_{k}_{j // BATCH_VINS}", rng.randbytes(256)
                with store.write() as txn:
                    batches.store_batch(txn, t, vins, rid, blob, now_ms())
                mine.update((v, (rid, batches.sha1_of(blob))) for v in vins)
            rows.append(mine)
        before, psize = table_pages(store)
        for k in range(REQUESTS_PER_VIN):
            acked = fleet[:]
            rng.shuffle(acked)
            for j in range(0, len(acked), ACKS_PER_COMMIT):
                with store.write() as txn:
                    for vin in acked[j : j + ACKS_PER_COMMIT]:
                        rid, sha1 = rows[k][vin]
                        if not batches.delete_row_if(txn, t, vin, rid, sha1, now_ms(), attempts=1):
                            raise RuntimeError(f"row {vin}/{rid} not delivered")
        after, _ = table_pages(store)
        with store.read() as txn:
            record_bytes = sum(len(k) + len(v) for k, v in txn.cursor(t.outcomes))
            index_bytes = sum(len(k) + len(v) for k, v in txn.cursor(t.outcome_expiry))
            left = int(txn.stat(t.ids)["entries"])
    finally:
        store.close()
    if after["outcomes"]["entries"] != n or left:
        raise RuntimeError(f"{after['outcomes']['entries']} outcomes of {n}, {left} rows left")
    grown = {name: (after[name]["pages"] - before[name]["pages"]) * psize / n for name in OUTCOME_TABLES[:2]}
    gens_bytes = after["gens"]["pages"] * psize / n  # the whole table: every count is there for outcomes
    return {
        "outcomes": n,
        "generations": after["gens"]["entries"],
        "page_bytes": psize,
        "bytes_per_outcome": grown["outcomes"] + grown["outcome_expiry"] + gens_bytes,
        "record_bytes": grown["outcomes"],
        "index_bytes": grown["outcome_expiry"],
        "gens_bytes": gens_bytes,
        "record_key_value_bytes": record_bytes / n,
        "index_key_value_bytes": index_bytes / n,
        "pages_before": before,
        "pages_after": after,
    }


# -- report ---------------------------------------------------------------------------------------


def _mmm(values: list[float], fmt: Callable[[float], str]) -> str:
    return min_med_max(values, fmt)


def ingest_markdown(ing: dict[str, Any], meta: dict[str, Any]) -> str:
    rounds, sides = ing["rounds"], ing["sides"]

    def col(side: str, key: str) -> list[float]:
        return [r[side][key] for r in rounds]

    label = {
        "before": f"before ({meta['before']}: no outcome records or generation counts, no status)",
        "off": 'off (status_topic_prefix = "": outcomes and counts kept, nothing published)',
        "on": "on (defaults: receipts + progress every 5 s)",
    }
    lines = [
        f"### Ingest: status on vs off, {ing['batches']:,} batches x {meta['vins']} VINs per side, "
        f"{len(rounds)} rounds, 8 channels, 1 KiB blobs"
        + (
            f", {meta['campaigns']} campaigns taking turns (a request id and payload each)" if meta["campaigns"] else ""
        ),
        "",
        "| metric | min | median | max |",
        "|---|---:|---:|---:|",
    ]
    for side in sides:
        lines.append(f"| {label[side]} VIN-rows/s | {_mmm(col(side, 'rows_per_s'), num)} |")
    lines.append(
        f"| **ratio on/off VIN-rows/s** (paired; target ≥ {TARGET}) | {_mmm(_r(rounds, 'on_over_off'), dec3)} |"
    )
    if "before" in sides:
        lines += [
            f"| **ratio off/before** VIN-rows/s (outcome bookkeeping + all else since {meta['before']}) | "
            f"{_mmm(_r(rounds, 'off_over_before'), dec3)} |",
            f"| ratio on/before VIN-rows/s (all of issue 12 in the ingest path) | "
            f"{_mmm(_r(rounds, 'on_over_before'), dec3)} |",
        ]
    for side in sides:
        lines.append(f"| {side}: server CPU µs per VIN-row | {_mmm(col(side, 'server_cpu_us_per_row'), dec)} |")
    lines.append(f"| server CPU per row, on/off (paired) | {_mmm(_r(rounds, 'cpu_on_over_off'), dec3)} |")
    if "before" in sides:
        lines.append(f"| server CPU per row, off/before (paired) | {_mmm(_r(rounds, 'cpu_off_over_before'), dec3)} |")
    for side in sides:
        lines += [
            f"| {side}: batch latency p50 / p99 ms (medians) | {statistics.median(col(side, 'p50_ms')):.1f} / "
            f"{statistics.median(col(side, 'p99_ms')):.1f} | | |",
            f"| {side}: batches per commit | {_mmm(col(side, 'batches_per_commit'), dec)} |",
        ]
    other = [r[s]["other_cpu"] for r in rounds for s in sides]
    lines.append(f"| **other processes' CPU** (of one core; mosquitto included) | {_mmm(other, share)} |")
    lines += [
        "",
        "| round | order | "
        + " | ".join(f"{s} rows/s" for s in sides)
        + " | on/off | "
        + ("off/before | " if "before" in sides else "")
        + "status messages the platform got (on) |",
        "|---:|---|" + "---:|" * (len(sides) + 1 + ("before" in sides)) + "---|",
    ]
    for i, r in enumerate(rounds, 1):
        cells = [f"{r[s]['rows_per_s']:,.0f}" for s in sides] + [f"{r['on_over_off']:.3f}"]
        if "before" in sides:
            cells.append(f"{r['off_over_before']:.3f}")
        got = ", ".join(f"{k} {v:,}" for k, v in r["on"]["status"].items()) or "none"
        silent = all(not r[s]["status"] for s in sides if s != "on")
        lines.append(f"| {i} | {r['order']} | {' | '.join(cells)} | {got}{'' if silent else ' (!)'} |")
    lines += [
        "",
        f"Each side: a fresh server ({rounds[0]['on']['server_processes']} process(es)) and data dir, its delivery "
        "client connected to the run's mosquitto (no vehicle online: no deliveries), the same batches ("
        + (
            "a few campaigns: most batches extend a counted generation"
            if meta["campaigns"]
            else "a request id each, so a generation each"
        )
        + f"); {ing['batches']:,} accepted receipts per round are expected on, none off "
        "and before ((!) marks a side that published). Off still writes every outcome record and generation count "
        "(storage keeps them whatever the settings); only before, an older tree, does not.",
    ]
    return "\n".join(lines)


def _r(rounds: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in rounds]


def dec3(v: float) -> str:
    return f"{v:.3f}"


def e2e_markdown(e: dict[str, Any], meta: dict[str, Any]) -> str:
    rounds = e["rounds"]
    n, b = meta["vehicles"], meta["batches"]

    def col(side: str, key: str) -> list[float]:
        return [r[side][key] for r in rounds]

    def cpu(side: str, group: str) -> list[float]:
        return [r[side]["cpu_us_per_msg"][group] for r in rounds]

    lines = [
        f"### End to end: status off / on / per-vehicle, {n:,} vehicles x {b} batches = {n * b:,} deliveries "
        f"per measurement, {len(rounds)} rounds",
        "",
        "| metric | min | median | max |",
        "|---|---:|---:|---:|",
        f'| off (status_topic_prefix = "") delivered+acked msgs/s | {_mmm(col("off", "msgs_per_s"), num)} |',
        f"| on (receipts + progress every 5 s) msgs/s | {_mmm(col('on', 'msgs_per_s'), num)} |",
        f"| per_vehicle (on + a `vehicle` event per delivery) msgs/s | {_mmm(col('per_vehicle', 'msgs_per_s'), num)} |",
        f"| **ratio on/off msgs/s** (paired; target ≥ {TARGET}) | {_mmm(_r(rounds, 'on_over_off'), dec3)} |",
        f"| **ratio per_vehicle/off msgs/s** (paired) | {_mmm(_r(rounds, 'per_vehicle_over_off'), dec3)} |",
        f"| server CPU per message, on/off (paired) | {_mmm(_r(rounds, 'cpu_on_over_off'), dec3)} |",
        f"| server CPU per message, per_vehicle/off (paired) | {_mmm(_r(rounds, 'cpu_per_vehicle_over_off'), dec3)} |",
    ]
    for group, label in (
        ("server", "server"),
        ("mosquitto", "mosquitto"),
        ("sim fleet", "sim fleet (vehicles + EMQX hook driver)"),
        ("bench", "this bench (FakeEmqx batches + the platform's subscriber)"),
        ("other processes", "other processes (the idle rigs included)"),
    ):
        cells = " / ".join(f"{statistics.median(cpu(s, group)):,.0f}" for s in E2E_SIDES)
        lines.append(f"| {label} CPU µs per message, off / on / per_vehicle (medians) | {cells} | | |")
    lines += [
        "",
        "| round | order | off msgs/s | on msgs/s | per_vehicle msgs/s | on/off | per_vehicle/off | "
        "server µs/msg off / on / per_vehicle |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for i, r in enumerate(rounds, 1):
        us = " / ".join(f"{r[s]['cpu_us_per_msg']['server']:,.0f}" for s in E2E_SIDES)
        lines.append(
            f"| {i} | {r['order']} | {r['off']['msgs_per_s']:,.0f} | {r['on']['msgs_per_s']:,.0f} | "
            f"{r['per_vehicle']['msgs_per_s']:,.0f} | {r['on_over_off']:.3f} | {r['per_vehicle_over_off']:.3f} | {us} |"
        )
    exp = e["expected"]
    got = "; ".join(
        f"{side}: " + (", ".join(f"{k} {v:,}" for k, v in sorted(c.items())) or "none")
        for side, c in e["status_totals"].items()
    )
    lines += [
        "",
        f"Status messages the platform's subscriber got over the run (warm-up included): {got}; expected on both "
        f"status sides {exp['batches']:,} accepted and {exp['batches']:,} completed (a generation per batch), and "
        f"{exp['deliveries']:,} vehicle events with per_vehicle. Three rigs (mosquitto, server with "
        f"{meta['server_processes_label']}, {meta['procs']} sim fleet processes each) are up for the whole run; "
        "the two idle ones count as other processes.",
    ]
    return "\n".join(lines)


def disk_markdown(disk: list[dict[str, Any]]) -> str:
    lines = [
        "### Disk per outcome record (LMDB pages before vs after every row was delivered)",
        "",
        "| outcomes | generations | **bytes per outcome** | record (`outcomes`) | time index (`outcome_expiry`) | "
        "`gens` (whole table, amortized) | record key + value | index key + value |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d in disk:
        lines.append(
            f"| {d['outcomes']:,} | {d['generations']:,} | **{d['bytes_per_outcome']:.0f}** | "
            f"{d['record_bytes']:.0f} | {d['index_bytes']:.0f} | {d['gens_bytes']:.1f} | "
            f"{d['record_key_value_bytes']:.0f} | {d['index_key_value_bytes']:.0f} |"
        )
    lines += [
        "",
        f"Fresh store per N; {REQUESTS_PER_VIN} requests per VIN in {BATCH_VINS}-VIN batches (a request id each), "
        f"delivered {ACKS_PER_COMMIT} per commit, VINs shuffled per request. Pages (branch + leaf + overflow) x "
        f"{disk[0]['page_bytes']} B; key + value is what LMDB stores before its 8 B node header and page slack.",
    ]
    return "\n".join(lines)


# -- main -----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6, help="paired rounds of ingest and of e2e (default 6: every order)")
    p.add_argument("--before", metavar="REV", help="also ingest with the server of this git revision (e.g. 7fd2d64)")
    p.add_argument("--ingest-batches", type=int, default=2400,
                   help="batches per ingest side, enough to span a 5 s progress look (default 2400)")  # fmt: skip
    p.add_argument("--vins", type=int, default=200, help="VINs per ingest batch (default 200)")
    p.add_argument("--fleet", type=int, default=20_000, help="distinct VINs the ingest batches draw from")
    p.add_argument("--campaigns", type=int, default=0,
                   help="ingest K campaigns taking turns (a request id and payload each, new VINs) instead of "
                   "a request id per batch: batches extend generations already counted (default 0)")  # fmt: skip
    p.add_argument("--blob-bytes", type=int, default=1024, help="ingest payload size (default 1024)")
    p.add_argument("--clients", type=int, default=8, help="ingest gRPC channels (default 8)")
    p.add_argument("--vehicles", type=int, default=500, help="e2e vehicles per rig (default 500)")
    p.add_argument("--batches", type=int, default=20,
                   help="e2e batches per measurement, each naming every vehicle (default 20: ~10 s)")  # fmt: skip
    p.add_argument("--procs", type=int, default=2, help="e2e sim fleet processes per rig (default 2)")
    p.add_argument("--payload-bytes", type=int, default=256, help="e2e payload size (default 256)")
    p.add_argument("--disk-n", default="10000,100000", help="outcomes per disk measurement (default 10000,100000)")
    p.add_argument("--only", default="ingest,e2e,disk", help="parts to run (default ingest,e2e,disk)")
    p.add_argument("--server-processes", type=int, default=0,
                   help="SDV_FANOUT_PROCESSES for every server (default 0: theirs, one per CPU)")  # fmt: skip
    p.add_argument("--deadline-s", type=float, default=180, help="give up on an e2e phase after this (default 180)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--seed", type=int, default=20261123)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    p.add_argument("--platform-port", type=int, help=argparse.SUPPRESS)  # the StatusListener helper
    p.add_argument("--platform-name", default="platform", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.platform_port:
        return platform_main(args.platform_port, args.platform_name)
    parts = {x.strip() for x in args.only.split(",") if x.strip()}
    if parts - {"ingest", "e2e", "disk"} or min(args.rounds, args.ingest_batches, args.vehicles, args.batches) < 1:
        p.error("--only takes ingest, e2e, disk; --rounds, --ingest-batches, --vehicles, --batches must be positive")
    args.procs = max(args.procs, -(-args.vehicles // e2e.MAX_PER_PROC))
    args.max_inflight = 50  # bench/e2e.py's Rig reads it (raw publisher, not started here)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the finally blocks
    wall0 = time.monotonic()
    load_before = os.getloadavg()[0]
    tmp_root = Path(tempfile.mkdtemp(prefix="sdv-bench-status-"))

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - wall0:6.1f} s] {msg}", file=sys.stderr, flush=True)

    out: dict[str, Any] = {}
    completed = False
    try:
        if "ingest" in parts:
            (tmp_root / "ingest").mkdir()
            out["ingest"] = run_ingest(args, tmp_root / "ingest", say)
        if "e2e" in parts:
            (tmp_root / "e2e").mkdir()
            out["e2e"] = run_end_to_end(args, tmp_root / "e2e", say)
        if "disk" in parts:
            out["disk"] = []
            for n in (int(x) for x in args.disk_n.split(",") if x.strip()):
                out["disk"].append(outcome_disk(n, tmp_root / f"disk-{n}", args.seed + n))
                say(f"disk: {out['disk'][-1]['bytes_per_outcome']:.0f} B per outcome at {n:,}")
        completed = True
    finally:
        if completed:
            shutil.rmtree(tmp_root, ignore_errors=True)
        else:
            print(f"kept {tmp_root} (server, broker and fleet logs, LMDB)", file=sys.stderr)

    meta = {
        "rounds": args.rounds,
        "before": args.before,
        "campaigns": args.campaigns,
        "vins": args.vins,
        "vehicles": args.vehicles,
        "batches": args.batches,
        "procs": args.procs,
        "seed": args.seed,
        "server_processes_label": f"{args.server_processes} process(es)" if args.server_processes else
        "its default process count",
        "commit": subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                                 text=True, check=False).stdout.strip(),
        **machine_meta(load_before, wall0),
    }  # fmt: skip
    parts_md = []
    if "ingest" in out:
        parts_md.append(ingest_markdown(out["ingest"], meta))
    if "e2e" in out:
        parts_md.append(e2e_markdown(out["e2e"], meta))
    if out.get("disk"):
        parts_md.append(disk_markdown(out["disk"]))
    parts_md.append(
        f"Code under test: {meta['commit']} (the checkout, as every bench here). {meta['cpus']} CPUs shared by "
        f"everything; 1-min load average {meta['loadavg_1m_before']:.2f} before, {meta['loadavg_1m_after']:.2f} "
        f"after; {meta['wall_s']:.0f} s wall. Seed {meta['seed']}."
    )
    print("\n\n".join(parts_md))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, **out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
