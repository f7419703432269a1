"""`sdv-fanout serve` on PostgreSQL against raw asyncpg and LMDB, side by side in one run.

    .venv/bin/python -m bench.pg_serve [--rounds 3 --only ingest,instances,heartbeat,e2e --json F]

How it measures and what each flag does: bench/README.md (`bench/pg_serve.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import shlex
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import grpc

from exhook_server._proto import exhook_v3_pb2 as pb
from storage.lmdb.store import Store
from storage.postgres import migrate
from testkit.batchload import Batch, _batch, _drive, _vin, make_workload
from testkit.emqx_sim import Mosquitto
from testkit.harness import ExHookClient, SubprocessServer
from testkit.hookload import _open as open_loop
from testkit.pgload import (
    HEARTBEAT,
    METHODS,
    PURPOSES,
    SUBSCRIBE,
    Db,
    Meter,
    Mix,
    Pinned,
    batch_wire,
    cpu_by_pid,
    drain,
    drive_mix,
    drive_rate,
    heartbeat_wire,
    pg_count,
    pinned_cpus,
    scrape,
    send_all,
    start_server,
    subscribe_wire,
    trips,
)
from testkit.plumbing import (
    descendants,
    machine_meta,
    make_vins,
    pct,
    quiesce,
    say,
    stop_server,
)
from testkit.reports.pg_serve import (
    BATCH_VINS,
    E2E_SIDES,
    INGEST_SIDES,
    OPEN_TABLES,
    WARM_BATCHES_PER_CLIENT,
    markdown,
    summarise,
)
from testkit.rig import MAX_PER_PROC, Rig, run_ours

#: No vehicle of these rigs PUBACKs a delivery the server sends (nobody subscribes on the broker):
#: an hour of in-flight timeout keeps re-sends out of the measurements.
QUIET_INFLIGHT_S = "3600"
RAW_BLOB = (
    "INSERT INTO blobs (sha1, data, created_ms, touched_ms) VALUES ($1, $2, $3, $3) ON CONFLICT (sha1) DO NOTHING"
)
RAW_ROWS = """
INSERT INTO rows (vin, request_id, ts_ms, sha1, size)
SELECT v, $2::text, $3::int8, $4::bytea, $5::int4 FROM unnest($1::text[]) AS v
ON CONFLICT (vin, request_id) DO UPDATE SET ts_ms = EXCLUDED.ts_ms, sha1 = EXCLUDED.sha1, size = EXCLUDED.size
"""


def rotated(sides: Sequence[Any], r: int) -> list[Any]:
    """Round r's order: the sides rotated by r, reversed every other round."""
    k = r % len(sides)
    order = list(sides[k:]) + list(sides[:k])
    return order[::-1] if r % 2 else order


# -- 1. ingest ----------------------------------------------------------------------------------

#: The server sides on PostgreSQL, each with the settings it adds to the server's environment:
#: "pg" as deployed (the default backlog bound, max_pending_per_vehicle 1000), "pg_unbounded"
#: without the bound (0 = none), to show the backlog counts' price beside the raw loop.
PG_SIDES: dict[str, dict[str, str]] = {"pg": {}, "pg_unbounded": {"SDV_FANOUT_MAX_PENDING_PER_VEHICLE": "0"}}


def ingest_sides(args: argparse.Namespace) -> list[str]:
    """The ingest sides this run measures: all, or all but "pg_unbounded" with --no-unbounded."""
    return [s for s in INGEST_SIDES if not (s == "pg_unbounded" and args.no_unbounded)]


def ingest_server(
    db: Db, side: str, batches: list[Batch], args: argparse.Namespace, tmp: Path, pin: Pinned | None = None
) -> dict[str, Any]:
    """The batches through `serve` on PostgreSQL (a fresh database; PG_SIDES' settings) or LMDB (a
    fresh data dir); with `pin`, in the pinned layout (the server starts inside it, on the client
    side's CPU)."""
    env = {"SDV_FANOUT_PROCESSES": str(args.server_processes)} if args.server_processes else {}
    dsn = ""
    if side in PG_SIDES:
        dsn = db.database(tmp.name)
        env["SDV_FANOUT_STORE_URL"] = dsn
        env.update(PG_SIDES[side])
    server = start_server(tmp, args, env)
    try:
        pids = descendants(server.proc.pid)
        if pin:
            pin.server(pids)
        warm = warm_up(server.port, args)
        db.checkpoint()
        meter = Meter(pids, db)
        seconds, latencies, answers = asyncio.run(_drive(server.port, batches, args.clients))
        meter.loaded()
        drain(pids, db)  # a batch's dispatch check runs behind its answer
        cpu = meter.read()
        if pin:
            cpu["masks"] = pin.check()
    finally:
        stop_server(server)
    refused = [a for a in answers if pb.ValuedResponse.FromString(a).type != pb.ValuedResponse.STOP_AND_RETURN]
    if refused:
        raise SystemExit(f"ingest {side}: {len(refused)} batches not stored:\n{server.log()[-2000:]}")
    stored = asyncio.run(count_rows(dsn)) if dsn else lmdb_rows(tmp / "lmdb")
    return ingest_result(batches, seconds, latencies, cpu, stored - warm, len(pids))


def warm_up(port: int, args: argparse.Namespace) -> int:
    """A long-running server's state before the measurement, as the raw loop has its connections
    open and statements prepared: `--clients` channels send a few 200-VIN batches of their own
    request ids and VINs at once, so the server's database pool has grown to what the load needs
    (each new PostgreSQL backend costs a fork, catalog reads and plan caching, PostgreSQL CPU that
    the raw loop pays outside its measurement) and every statement is prepared. The rows it
    stored (not counted in the results)."""
    rng = random.Random(args.seed + 7)
    warm = [
        _batch(rng, [_vin(rng) for _ in range(BATCH_VINS)], f"task_warmup_{n}", rng.randbytes(1024))
        for n in range(WARM_BATCHES_PER_CLIENT * args.clients)
    ]
    _, _, answers = asyncio.run(_drive(port, warm, args.clients))
    if any(pb.ValuedResponse.FromString(a).type != pb.ValuedResponse.STOP_AND_RETURN for a in answers):
        raise SystemExit("ingest warm-up: a batch was not stored")
    return len(warm) * BATCH_VINS


def lmdb_rows(data_dir: Path) -> int:
    store = Store(data_dir, readonly=True)
    try:
        with store.read() as txn:
            return int(txn.stat(store.tables.ids)["entries"])
    finally:
        store.close()


async def count_rows(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM rows"))
    finally:
        await conn.close()


def ingest_raw(
    db: Db, batches: list[Batch], args: argparse.Namespace, tmp: Path, pin: Pinned | None = None
) -> dict[str, Any]:
    """The same rows by bare asyncpg into the product's schema: per batch one transaction with the
    blob (if absent) and one unnest upsert of its rows, `--clients` connections at once; with `pin`,
    in the pinned layout (the loop alone on the client side's CPU)."""
    dsn = db.database(tmp.name)
    work = [(sorted(b.vins), b.request_id, hashlib.sha1(b.blob).digest(), b.blob) for b in batches]

    async def run() -> tuple[float, list[float], dict[str, Any]]:
        settings = {"synchronous_commit": "on", "application_name": "pg_serve-raw"}
        conns = [await asyncpg.connect(dsn, server_settings=settings) for _ in range(args.clients)]
        try:
            await migrate.migrate(conns[0])
            for c in conns:  # prepared outside the measurement, as the server's pool has them
                await c.prepare(RAW_BLOB)
                await c.prepare(RAW_ROWS)
            db.checkpoint()
            meter = Meter([], db)
            latencies: list[float] = []
            todo = iter(work)

            async def loop(conn: asyncpg.Connection) -> None:
                for vins, rid, sha1, blob in todo:
                    t = time.perf_counter()
                    now_ms = int(time.time() * 1000)
                    async with conn.transaction():
                        await conn.execute(RAW_BLOB, sha1, blob, now_ms)
                        await conn.execute(RAW_ROWS, vins, rid, now_ms, sha1, len(blob))
                    latencies.append(time.perf_counter() - t)

            t0 = time.perf_counter()
            await asyncio.gather(*(loop(c) for c in conns))
            seconds = time.perf_counter() - t0
            meter.loaded()
            drain([], db)
            cpu = meter.read()
            if pin:
                cpu["masks"] = pin.check()
            return seconds, latencies, cpu
        finally:
            for c in conns:
                await c.close()

    seconds, latencies, cpu = asyncio.run(run())
    return ingest_result(batches, seconds, latencies, cpu, asyncio.run(count_rows(dsn)), 0)


def ingest_result(
    batches: list[Batch], seconds: float, latencies: list[float], cpu: dict[str, Any], stored: int, procs: int
) -> dict[str, Any]:
    rows = sum(len(b.vins) for b in batches)
    if stored != rows:
        raise SystemExit(f"ingest: {stored} rows stored of {rows}")
    return {
        "seconds": seconds,
        "rows": rows,
        "rows_per_s": rows / seconds,
        "batches_per_s": len(batches) / seconds,
        "p50_ms": pct(latencies, 0.5) * 1000,
        "p99_ms": pct(latencies, 0.99) * 1000,
        "server_us_per_row": cpu["server_s"] / rows * 1e6,
        "pg_us_per_row": cpu["pg_s"] / rows * 1e6,
        "client_us_per_row": cpu["client_s"] / rows * 1e6,
        "other_share": cpu["other_share"],
        "cpu_busy": cpu["cpu_busy"],  # share of each CPU (by number) while the batches went in
        **({"masks": cpu["masks"]} if "masks" in cpu else {}),
        "server_processes": max(1, procs - 1) if procs else 0,  # a group's parent only supervises
    }


LAYOUTS = ("shared", "pinned")


def ingest_cell(
    db: Db, layout: str, side: str, batches: list[Batch], args: argparse.Namespace, tmp: Path, cpus: tuple[int, int]
) -> dict[str, Any]:
    """One side in one layout; the pinned layout's masks are set back to all CPUs however it ends."""
    with Pinned(db, *cpus) if layout == "pinned" else contextlib.nullcontext() as pin:
        if side == "raw":
            return ingest_raw(db, batches, args, tmp, pin)
        return ingest_server(db, side, batches, args, tmp, pin)


def ratios(res: dict[str, Any]) -> dict[str, float]:
    out = {
        "pg_over_raw": res["pg"]["rows_per_s"] / res["raw"]["rows_per_s"],
        "pg_over_lmdb": res["pg"]["rows_per_s"] / res["lmdb"]["rows_per_s"],
    }
    if "pg_unbounded" in res:
        out["pg_unbounded_over_raw"] = res["pg_unbounded"]["rows_per_s"] / res["raw"]["rows_per_s"]
    return out


def part_ingest(db: Db, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Per round every side in every layout, the cells' order rotating. A round's shared-layout
    results keep their old keys (pg, raw, lmdb, pg_over_raw, pg_over_lmdb) plus pg_unbounded and
    pg_unbounded_over_raw unless --no-unbounded; the pinned layout's are the same keys under
    "pinned"."""
    batches = make_workload(args.seed, args.batches, BATCH_VINS, args.fleet, 1024, 4)
    # Every side's concurrency, and more rounds than the other parts: a cell is about a second,
    # so a moment of another program's load moves one round's ratio by 0.1.
    args = argparse.Namespace(**{**vars(args), "clients": args.ingest_clients, "rounds": args.ingest_rounds})
    layouts = list(args.layouts)
    db_cpu, client_cpu, note = pinned_cpus()
    if "pinned" in layouts and note:
        layouts.remove("pinned")
        say(f"ingest: pinned layout {note}")
    sides = ingest_sides(args)
    cells = [(layout, side) for layout in layouts for side in sides]
    rounds = []
    for r in range(args.rounds):
        res: dict[str, Any] = {}
        order = rotated(cells, r)
        for layout, side in order:
            where = tmp / f"ingest_{r}_{layout}_{side}"
            got = ingest_cell(db, layout, side, batches, args, where, (db_cpu, client_cpu))
            (res.setdefault("pinned", {}) if layout == "pinned" else res)[side] = got
        res["order"] = "->".join(side if layout == "shared" else f"{side}@pinned" for layout, side in order)
        if "shared" in layouts:
            res.update(ratios(res))
        if "pinned" in layouts:
            res["pinned"].update(ratios(res["pinned"]))
        rounds.append(res)
        say(
            f"ingest round {r + 1}/{args.rounds}: "
            + "; ".join(
                f"{layout}: "
                + ", ".join(f"{s} {at[s]['rows_per_s']:,.0f}" for s in sides)
                + f" rows/s, pg/raw {at['pg_over_raw']:.2f}"
                + (f", pg_unbounded/raw {at['pg_unbounded_over_raw']:.2f}" if "pg_unbounded" in at else "")
                + f", pg/lmdb {at['pg_over_lmdb']:.2f}"
                for layout in layouts
                for at in [res if layout == "shared" else res["pinned"]]
            )
        )
    return {
        "rounds": rounds,
        "batches": len(batches),
        "clients": args.clients,
        "layouts": layouts,
        "pinned_cpus": {"postgresql": db_cpu, "client": client_cpu} if "pinned" in layouts else {},
        "pinned_note": note if "pinned" in args.layouts else "",
    }


# -- workload of the hook parts -------------------------------------------------------------------


def instance_env(dsn: str, broker: Mosquitto, extra: dict[str, str] | None = None) -> dict[str, str]:
    """One `serve` instance: one process on the shared database, delivering to the run's broker."""
    return {
        "SDV_FANOUT_STORE_URL": dsn,
        "SDV_FANOUT_MQTT_URL": broker.url,
        "SDV_FANOUT_PROCESSES": "1",
        "SDV_FANOUT_INFLIGHT_TIMEOUT_S": QUIET_INFLIGHT_S,
        **(extra or {}),
    }


def prefill(
    servers: list[SubprocessServer],
    db: Db,
    dsn: str,
    vins: list[str],
    pending: list[str],
    request_ids: list[str],
    payload: bytes,
    clients: int,
) -> None:
    """Every vehicle connects (a subscribe each, spread over the instances: its presence is
    recorded), then the batches store one row per request id for each of `pending`; whatever the
    instances send in return goes out to the broker and stays in flight."""
    ports = [s.port for s in servers]
    pids = [p for s in servers for p in descendants(s.proc.pid)]
    asyncio.run(send_all(ports, METHODS[SUBSCRIBE], [subscribe_wire(v, i) for i, v in enumerate(vins)], clients))
    drain(pids, db)
    batches = [
        batch_wire(pending[k : k + 2000], rid, payload) for rid in request_ids for k in range(0, len(pending), 2000)
    ]
    asyncio.run(send_all(ports[:1], METHODS[HEARTBEAT], batches, 1))
    drain(pids, db)
    online = asyncio.run(pg_count(dsn, "SELECT count(*) FROM presence"))
    rows = asyncio.run(pg_count(dsn, "SELECT count(*) FROM rows"))
    if online < len(vins) or rows < len(pending) * len(request_ids):
        raise SystemExit(f"prefill: {online} of {len(vins)} vehicles online, {rows} rows stored")


# -- 2. instances -------------------------------------------------------------------------------


def part_instances(db: Db, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    levels = [int(x) for x in args.instances.split(",")]
    dsn = db.database("instances")
    broker = Mosquitto(tmp, verbose=False).start()
    servers: list[SubprocessServer] = []
    try:
        for i in range(max(levels)):
            servers.append(start_server(tmp / f"instance{i}", args, instance_env(dsn, broker)))
        vins = make_vins(args.seed + 2, args.inst_vins)
        payload = random.Random(args.seed).randbytes(512).hex().encode()
        request_id = "task_ota_000001"
        t0 = time.monotonic()
        prefill(servers, db, dsn, vins, vins, [request_id], payload, args.clients)
        say(f"instances: {len(vins):,} vehicles online with a delivery out each, in {time.monotonic() - t0:.1f} s")
        mix = Mix(vins, request_id, payload, (args.subscribe_share, args.ack_share), args.seed)
        warm = instances_cell(servers, [], db, mix, args)  # every instance's pool and prepared statements
        say(f"instances: warm-up over all {len(servers)}: {warm['calls_per_s']:,.0f} calls/s")
        # Closed-loop cells, then the open-loop tables' cells (each n at its table's total rate; a cell
        # two tables share, such as 1 instance at 400 calls/s in both, is measured once and shown in
        # both), one order rotating over them all.
        tables = open_tables(args)
        cells = [(n, 0.0) for n in levels]
        cells += list(dict.fromkeys((n, rate_of(n)) for rate_of in tables.values() for n in levels))
        rounds = []
        for r in range(args.rounds):
            order = rotated(cells, r)
            res: dict[str, Any] = {"order": "->".join(f"{n}@{rate:g}/s" if rate else str(n) for n, rate in order)}
            got = {
                (n, rate): instances_cell(servers[:n], servers[n:], db, mix, args, rate, seed=args.seed + 100 * r + k)
                for k, (n, rate) in enumerate(order)
            }
            res.update({str(n): got[n, 0.0] for n in levels})
            for t, offered in tables.items():
                res[t] = {str(n): dict(got[n, offered(n)]) for n in levels}  # copies: the ratios are the table's
            for at in (res, *(res[t] for t in tables)):
                base = at[str(levels[0])]
                for n in levels:
                    at[str(n)]["cost_vs_first"] = at[str(n)]["us_per_call"] / base["us_per_call"]
                    at[str(n)]["rate_vs_first"] = at[str(n)]["calls_per_s"] / base["calls_per_s"]
            rounds.append(res)
            say(
                f"instances round {r + 1}/{args.rounds}: closed loop "
                + ", ".join(
                    f"{n}: {res[str(n)]['calls_per_s']:,.0f} calls/s {res[str(n)]['us_per_call']:,.0f} µs/call "
                    f"{res[str(n)]['trips_per_call']:.2f} trips/call"
                    for n in levels
                )
                + "".join(
                    f"; {OPEN_TABLES[t]} "
                    + ", ".join(
                        f"{n}: {res[t][str(n)]['calls_per_s']:,.0f} of {offered(n):,.0f} calls/s "
                        f"{res[t][str(n)]['us_per_call']:,.0f} µs/call {res[t][str(n)]['trips_per_call']:.2f} "
                        f"trips/call, {res[t][str(n)]['late']} late"
                        for n in levels
                    )
                    for t, offered in tables.items()
                )
            )
        left = asyncio.run(pg_count(dsn, "SELECT count(*) FROM rows"))
    finally:
        for s in servers:
            stop_server(s)
        broker.stop()
    return {
        "levels": levels,
        "vins": len(vins),
        "rounds": rounds,
        "fixed_rate": args.inst_rate if args.inst_rate > 0 else 0.0,
        "per_instance_rate": args.inst_rate_per_instance if args.inst_rate_per_instance > 0 else 0.0,
        "max_in_flight": args.clients * 4,
        "acks_issued": mix.acks_issued,
        "rows_stored": len(vins),
        "rows_left": left,
    }


def open_tables(args: argparse.Namespace) -> dict[str, Callable[[int], float]]:
    """The open-loop tables this run measures, each as its total offered calls/s for n instances:
    `--inst-rate` whatever n (the instances share a fixed load), or n x `--inst-rate-per-instance`
    (each instance added brings its own)."""
    rates: dict[str, Callable[[int], float]] = {
        "fixed_rate": lambda n: args.inst_rate,
        "per_instance_rate": lambda n: n * args.inst_rate_per_instance,
    }
    on = {"fixed_rate": args.inst_rate > 0, "per_instance_rate": args.inst_rate_per_instance > 0}
    return {t: rates[t] for t in OPEN_TABLES if on[t]}


def instances_cell(
    driven: list[SubprocessServer],
    idle: list[SubprocessServer],
    db: Db,
    mix: Mix,
    args: argparse.Namespace,
    rate: float = 0.0,
    seed: int = 0,
) -> dict[str, Any]:
    """The mix over `driven` instances, closed loop or (`rate` > 0) open loop at `rate` calls/s;
    CPU and round trips counted until the work the calls left behind is done. The `idle` instances
    keep running (their CPU is reported apart). Closed loop: counted from before the channels
    open (as it always was: their set-up is small next to thousands of calls); fixed rate: from
    once they are open and warm, since `clients` x n connections' set-up would weigh on a few
    hundred calls per cell, and more the more instances."""
    pids = [p for s in driven for p in descendants(s.proc.pid)]
    idle_pids = [p for s in idle for p in descendants(s.proc.pid)]
    at: dict[str, Any] = {}

    def start() -> None:
        at.update(before=[scrape(s) for s in driven], idle0=sum(cpu_by_pid(idle_pids).values()))
        at["meter"] = Meter(pids, db)

    ports = [s.port for s in driven]
    if rate > 0:
        out = asyncio.run(drive_rate(ports, mix, args.clients, rate, args.warmup, args.duration, seed, start))
    else:
        start()
        out = asyncio.run(drive_mix(ports, mix, args.clients, args.warmup, args.duration))
    drain(pids, db)
    cpu = at["meter"].read()
    idle0 = at["idle0"]
    t: Counter[str] = Counter()
    for b, s in zip(at["before"], driven, strict=True):
        t.update(trips(b, scrape(s)))
    calls = out["issued"]
    return {
        **out,
        "server_us_per_call": cpu["server_s"] / calls * 1e6,
        "pg_us_per_call": cpu["pg_s"] / calls * 1e6,
        "us_per_call": (cpu["server_s"] + cpu["pg_s"]) / calls * 1e6,
        "client_us_per_call": cpu["client_s"] / calls * 1e6,
        "server_share": cpu["server_s"] / cpu["wall_s"],
        "pg_share": cpu["pg_s"] / cpu["wall_s"],
        "idle_instances_share": (sum(cpu_by_pid(idle_pids).values()) - idle0) / cpu["wall_s"],
        "other_share": max(0.0, cpu["other_share"] - (sum(cpu_by_pid(idle_pids).values()) - idle0) / cpu["wall_s"]),
        "trips_per_call": t["trips"] / calls,
        **{f"{p}_per_call": t[p] / calls for p in PURPOSES},
        "wall_s": cpu["wall_s"],
    }


# -- 3. heartbeat round trips -------------------------------------------------------------------

HB_PHASES = ("idle", "work")


def part_heartbeat(db: Db, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    windows = [float(x) for x in args.hb_windows.split(",")]
    rates = [float(x) for x in args.hb_rates.split(",")]
    dsn = db.database("heartbeat")
    broker = Mosquitto(tmp, verbose=False).start()
    servers: dict[float, SubprocessServer] = {}
    try:
        for w in windows:
            env = instance_env(dsn, broker, {"SDV_FANOUT_HEARTBEAT_WINDOW_MS": f"{w:g}"})
            servers[w] = start_server(tmp / f"window{w:g}", args, env)
        both = make_vins(args.seed + 3, 2 * args.hb_vins)
        fleets = {"idle": both[: args.hb_vins], "work": both[args.hb_vins :]}
        busy = fleets["work"][: round(args.work_share * args.hb_vins)]
        payload = b"work for the vehicle"
        t0 = time.monotonic()
        prefill(list(servers.values()), db, dsn, both, busy, ["task_hb_1", "task_hb_2"], payload, args.clients)
        out_now = asyncio.run(pg_count(dsn, "SELECT count(*) FROM vin_state WHERE request_id IS NOT NULL"))
        say(
            f"heartbeat: {len(both):,} vehicles online, {len(busy):,} with 2 rows and {out_now:,} deliveries out, "
            f"in {time.monotonic() - t0:.1f} s"
        )
        offset = len(fleets["idle"])
        wires = {
            "idle": [heartbeat_wire(v, i) for i, v in enumerate(fleets["idle"])],
            "work": [heartbeat_wire(v, offset + i) for i, v in enumerate(fleets["work"])],
        }
        cells = [(w, phase, rate) for w in windows for phase in HB_PHASES for rate in rates]
        rounds = []
        for r in range(args.rounds):
            res: dict[str, Any] = {}
            for k, (w, phase, rate) in enumerate(rotated(cells, r)):
                calls = [(0, wire) for wire in random.Random(r * 100 + k).sample(wires[phase], len(wires[phase]))]
                res[f"{w:g}/{phase}/{rate:g}"] = heartbeat_cell(servers[w], db, calls, rate, args, seed=r * 100 + k)
            rounds.append(res)
            say(
                f"heartbeat round {r + 1}/{args.rounds}: "
                + ", ".join(f"{key} {v['trips_per_heartbeat']:.3f}" for key, v in res.items())
                + " round trips per heartbeat"
            )
        still_out = asyncio.run(pg_count(dsn, "SELECT count(*) FROM vin_state WHERE request_id IS NOT NULL"))
    finally:
        for s in servers.values():
            stop_server(s)
        broker.stop()
    return {
        "windows": windows,
        "rates": rates,
        "vins_per_fleet": args.hb_vins,
        "busy": len(busy),
        "out_before": out_now,
        "out_after": still_out,
        "rounds": rounds,
    }


def heartbeat_cell(
    server: SubprocessServer, db: Db, calls: list[tuple[int, bytes]], rate: float, args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    """Heartbeats at `rate`/s (Poisson arrivals, open loop, bench/hooks.py's sender) for
    `--hb-duration` s; the server's counters before and after the work behind them is done."""
    pids = descendants(server.proc.pid)
    before = scrape(server)
    meter = Meter(pids, db)
    sent = asyncio.run(open_loop(server.port, calls, args.clients, rate, args.warmup, args.hb_duration, seed, pids))
    drain(pids, db)
    cpu = meter.read()
    t = trips(before, scrape(server))
    hb = t["heartbeats"]
    return {
        "offered_per_s": rate,
        "achieved_per_s": sent["achieved_rpc_per_s"],
        "errors": sum(sent["errors"].values()) + sent["skipped"],
        "p50_ms": sent["p50_ms"],
        "p99_ms": sent["p99_ms"],
        **t,
        "filter_per_heartbeat": t["heartbeat_filter"] / hb,
        "trips_per_heartbeat": t["trips"] / hb,
        "events_per_heartbeat": t["heartbeat_events"] / hb,
        "heartbeats_per_statement": hb / max(1.0, t["heartbeat_filter"]),
        "server_us_per_heartbeat": cpu["server_s"] / hb * 1e6,
        "pg_us_per_heartbeat": cpu["pg_s"] / hb * 1e6,
        "other_share": cpu["other_share"],
    }


# -- 4. end to end ------------------------------------------------------------------------------


#: Vehicles holding rows with nothing out for them: after a stall, a wake-up was lost (PostgreSQL).
IDLE_WITH_WORK = """
SELECT count(DISTINCT r.vin) FROM rows r LEFT JOIN vin_state s ON s.vin = r.vin WHERE s.request_id IS NULL
"""


class Nudge:
    """A rig's rescue when its deliveries stall (rows left, none ended for `--stall-s`): a heartbeat
    from each vehicle still holding rows, as its next periodic one would come (EMQX-shaped, from the
    vehicle's clientid and address). Counts those vehicles and, on PostgreSQL, those of them with no
    delivery out at all (a lost wake-up, not a slow one)."""

    def __init__(self, rig: Rig) -> None:
        assert rig.server is not None
        self.rig = rig
        self.client = ExHookClient(rig.server.port)
        self.vins = 0
        self.idle = 0

    def __call__(self) -> None:
        idle = int(self.rig.pg.fetchval(IDLE_WITH_WORK)) if self.rig.pg is not None else 0
        stuck = [v for v in self.rig.vins if self.rig.pending(v)]
        for vin in stuck:
            self.client.publish(f"ecp/{vin}/online", b"{}", sender=vin, username=vin)
        self.vins += len(stuck)
        self.idle += idle
        say(f"stall: {len(stuck)} vehicles still hold rows ({idle} with nothing out); one heartbeat each")


def part_e2e(db: Db, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    vins = make_vins(args.seed + 4, args.vehicles)
    procs = max(args.procs, -(-args.vehicles // MAX_PER_PROC))
    rigs: dict[str, Rig] = {}
    nudges: dict[str, Nudge] = {}
    try:
        for side in E2E_SIDES:
            ns = argparse.Namespace(
                procs=procs,
                deadline_s=180.0,
                log_level=args.log_level,
                server_processes=args.server_processes,
                batches=args.e2e_batches,
                max_inflight=50,
                store_url=db.database("e2e") if side == "pg" else "",
            )
            (tmp / side).mkdir(parents=True)
            rig = rigs[side] = Rig(ns, tmp / side, vins)
            if side == "pg":
                rig.db_pids = db.pids
            rig.start_server()
            rig.start_sims()
            rig.stall_s, rig.on_stall = args.stall_s, nudges.setdefault(side, Nudge(rig))
            rig.args = argparse.Namespace(**{**vars(ns), "batches": 2})  # run_ours reads the count here
            run_ours(rig, "warm", args.payload_bytes, args.seed)  # pools, channels, first allocations
            rig.args = ns
            quiesce(rig.server_pids)
            say(f"e2e {side}: {args.vehicles} vehicles connected, warm-up done")
        rounds = []
        for r in range(args.rounds):
            res: dict[str, Any] = {"order": "->".join(rotated(E2E_SIDES, r))}
            for side in rotated(E2E_SIDES, r):
                rig, nudge = rigs[side], nudges[side]
                stalls, nudged, idle = rig.stalls, nudge.vins, nudge.idle
                assert rig.server is not None
                before = scrape(rig.server)
                res[side] = run_ours(rig, f"r{r}", args.payload_bytes, args.seed + 10 * r)
                spent = trips(before, scrape(rig.server))
                res[side]["trips_per_delivery"] = spent["trips"] / (args.vehicles * args.e2e_batches)
                res[side].update(
                    stalls=rig.stalls - stalls, nudged_vins=nudge.vins - nudged, idle_vins=nudge.idle - idle
                )
                quiesce(rig.server_pids, timeout_s=10)
            res["pg_over_lmdb"] = res["pg"]["msgs_per_s"] / res["lmdb"]["msgs_per_s"]
            rounds.append(res)
            say(
                f"e2e round {r + 1}/{args.rounds}: pg {res['pg']['msgs_per_s']:,.0f}, lmdb "
                f"{res['lmdb']['msgs_per_s']:,.0f} deliveries/s ({res['pg_over_lmdb']:.2f}x), "
                f"pg db round trips per delivery {res['pg']['trips_per_delivery']:.3f}"
            )
    finally:
        for nudge in nudges.values():
            nudge.client.close()
        for rig in rigs.values():
            rig.close()
    return {
        "vehicles": args.vehicles,
        "batches": args.e2e_batches,
        "procs": procs,
        "rounds": rounds,
        "stall_s": args.stall_s,
        "stalls_total": {side: rig.stalls for side, rig in rigs.items()},
        "idle_total": {side: nudge.idle for side, nudge in nudges.items()},
    }


# -- main -------------------------------------------------------------------------------------

PARTS: dict[str, Callable[[Db, argparse.Namespace, Path], dict[str, Any]]] = {
    "ingest": part_ingest,
    "instances": part_instances,
    "heartbeat": part_heartbeat,
    "e2e": part_e2e,
}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="paired rounds of every part (default 3)")
    p.add_argument("--only", default=",".join(PARTS), help=f"parts to run (default {','.join(PARTS)})")
    p.add_argument("--quick", action="store_true", help="small cells, 2 rounds (about a minute)")
    p.add_argument("--clients", type=int, default=8, help="gRPC channels / connections, EMQX's pool_size (default 8)")
    p.add_argument("--ingest-rounds", type=int, default=5, help="ingest: paired rounds (default 5)")
    p.add_argument(
        "--ingest-clients",
        type=int,
        default=32,
        help="ingest: channels / connections of every side (default 32, the PostgreSQL mode's pool_size)",
    )
    p.add_argument("--batches", type=int, default=600, help="ingest: 200-VIN batches per run (default 600)")
    p.add_argument("--fleet", type=int, default=20_000, help="ingest: VINs the batches draw from (default 20000)")
    p.add_argument(
        "--server-processes",
        type=int,
        default=0,
        help="ingest and e2e: SDV_FANOUT_PROCESSES of the servers (default: theirs, one per CPU)",
    )
    p.add_argument(
        "--layouts",
        default=",".join(LAYOUTS),
        help="ingest: shared (every process on every CPU) and/or pinned (PostgreSQL on a CPU of its own, the "
        "server and load generator or the raw loop on another) (default shared,pinned)",
    )
    p.add_argument(
        "--no-unbounded",
        action="store_true",
        help="ingest: skip the side 'serve on PostgreSQL, no backlog bound' (max_pending_per_vehicle = 0), "
        "which shows the bound's price beside the raw loop (default: measured)",
    )
    p.add_argument("--instances", default="1,2,3", help="instances: counts compared (default 1,2,3)")
    p.add_argument(
        "--inst-rate",
        type=float,
        default=400.0,
        help="instances: calls/s offered in all by the fixed-rate cells, under saturation (default 400; 0 = none)",
    )
    p.add_argument(
        "--inst-rate-per-instance",
        type=float,
        default=400.0,
        help="instances: calls/s offered to each instance by the equal-load cells, n times that in all "
        "(default 400; 0 = none)",
    )
    p.add_argument("--inst-vins", type=int, default=5_000, help="instances: vehicles (default 5000)")
    p.add_argument("--subscribe-share", type=float, default=0.05, help="instances: share of subscribes (0.05)")
    p.add_argument("--ack-share", type=float, default=0.05, help="instances: share of acks (0.05)")
    p.add_argument("--duration", type=float, default=3.0, help="instances: seconds measured per cell (default 3)")
    p.add_argument("--warmup", type=float, default=0.5, help="unrecorded load before each hook cell (default 0.5)")
    p.add_argument("--hb-windows", default="5,20", help="heartbeat: heartbeat_window_ms values (default 5,20)")
    p.add_argument("--hb-rates", default="500,2000", help="heartbeat: heartbeats/s offered (default 500,2000)")
    p.add_argument("--hb-vins", type=int, default=3_000, help="heartbeat: vehicles per fleet (default 3000)")
    p.add_argument("--work-share", type=float, default=0.1, help="heartbeat: vehicles with work in fleet 'work'")
    p.add_argument("--hb-duration", type=float, default=2.0, help="heartbeat: seconds per cell (default 2)")
    p.add_argument("--vehicles", type=int, default=500, help="e2e: online sim vehicles (default 500)")
    p.add_argument("--e2e-batches", type=int, default=6, help="e2e: batches per measurement (default 6)")
    p.add_argument("--procs", type=int, default=2, help="e2e: sim fleet processes (default 2)")
    p.add_argument("--payload-bytes", type=int, default=256, help="e2e: delivered payload (default 256)")
    p.add_argument(
        "--stall-s",
        type=float,
        default=0.5,
        help="e2e: no delivery ended this long with rows left = a stall: each vehicle holding rows "
        "heartbeats once (default 0.5; 0 = wait, up to 180 s)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="servers' log level (default info, as in production)",
    )
    p.add_argument(
        "--statements", action="store_true", help="load pg_stat_statements; print each part's top statements"
    )
    p.add_argument("--seed", type=int, default=20261122)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = min(args.rounds, 2)
        args.ingest_rounds = min(args.ingest_rounds, 2)
        args.batches, args.inst_vins, args.duration, args.warmup = 60, 1000, 1.0, 0.2
        args.hb_vins, args.hb_duration, args.hb_rates, args.hb_windows = 1000, 1.0, "1000", "5"
        args.vehicles, args.e2e_batches = 100, 3
    only = [x for x in args.only.split(",") if x]
    if set(only) - set(PARTS) or args.rounds < 1 or args.ingest_rounds < 1:
        p.error(f"--only takes {','.join(PARTS)}; --rounds and --ingest-rounds must be positive")
    given = [x for x in args.layouts.split(",") if x]
    if not given or set(given) - set(LAYOUTS):
        p.error(f"--layouts takes one or both of {','.join(LAYOUTS)}")
    args.layouts = [x for x in LAYOUTS if x in given]
    if args.inst_rate < 0 or args.inst_rate_per_instance < 0:
        p.error("--inst-rate and --inst-rate-per-instance must be 0 (none) or positive")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the finally blocks
    wall0, load_before = time.monotonic(), os.getloadavg()[0]
    out: dict[str, Any] = {}
    statements: dict[str, Any] = {}
    db = Db(args.statements)
    try:
        with tempfile.TemporaryDirectory(prefix="sdv-bench-pgserve-") as tmp:
            for name in only:
                say(f"== {name}")
                db.reset_statements()
                out[name] = PARTS[name](db, args, Path(tmp) / name)
                if args.statements:
                    statements[name] = db.top_statements()
        version = db.version
    finally:
        db.stop()
    out["meta"] = {
        "command": shlex.join(
            [".venv/bin/python", "-m", "bench.pg_serve", *(argv if argv is not None else sys.argv[1:])]
        ),
        "pg_version": version,
        "asyncpg": asyncpg.__version__,
        "grpc": grpc.__version__,
        **{
            k: getattr(args, k)
            for k in (
                "rounds",
                "clients",
                "ingest_clients",
                "ingest_rounds",
                "duration",
                "layouts",
                "inst_rate",
                "inst_rate_per_instance",
                "hb_duration",
                "subscribe_share",
                "ack_share",
                "work_share",
                "log_level",
                "seed",
            )
        },
        **machine_meta(load_before, wall0),
    }
    if statements:
        out["statements"] = statements
    print(markdown(out))
    out["summary"] = summarise(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
