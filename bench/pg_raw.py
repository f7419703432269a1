"""Raw PostgreSQL limits for the PostgreSQL store's first design: ingest, claim and heartbeat filter, asyncpg alone.

    .venv/bin/python -m bench.pg_raw [--rounds 3 --conns 1,4,8 --batches 100 --claims 2000

How it measures and what each flag does: bench/README.md (`bench/pg_raw.py`).
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
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import asyncpg

from testkit.pg_cluster import SUPERUSER, PgCluster
from testkit.plumbing import descendants, make_vins, pct
from testkit.reports.pg_raw import BATCH_VINS, report

SCHEMA = """
CREATE TABLE rows (
    vin text NOT NULL, request_id text NOT NULL, ts bigint NOT NULL, sha1 bytea NOT NULL, size int NOT NULL,
    PRIMARY KEY (vin, request_id)
);
CREATE INDEX rows_queue ON rows (vin, ts, request_id);
CREATE TABLE vin_state (
    vin text PRIMARY KEY, inflight_request_id text, inflight_sha1 bytea, inflight_session text,
    inflight_at timestamptz
);
"""
UPSERT_TAIL = (
    " ON CONFLICT (vin, request_id) DO UPDATE SET ts = EXCLUDED.ts, sha1 = EXCLUDED.sha1, size = EXCLUDED.size"
)
EXECUTEMANY = "INSERT INTO rows (vin, request_id, ts, sha1, size) VALUES ($1, $2, $3, $4, $5)" + UPSERT_TAIL
UNNEST = (
    "INSERT INTO rows (vin, request_id, ts, sha1, size) "
    "SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::bytea[], $5::int4[])" + UPSERT_TAIL
)
STAGE = "CREATE TEMP TABLE stage (LIKE rows) ON COMMIT DELETE ROWS"
MERGE = "INSERT INTO rows SELECT * FROM stage" + UPSERT_TAIL
CLAIM = """
UPDATE vin_state s SET inflight_request_id = r.request_id, inflight_sha1 = r.sha1,
       inflight_session = $2, inflight_at = now()
FROM (SELECT request_id, sha1 FROM rows WHERE vin = $1 ORDER BY ts, request_id LIMIT 1) r
WHERE s.vin = $1 AND s.inflight_request_id IS NULL
RETURNING r.request_id, r.sha1
"""
FILTER = """
SELECT s.vin FROM vin_state s
WHERE s.vin = ANY($1::text[]) AND s.inflight_request_id IS NULL
  AND EXISTS (SELECT 1 FROM rows r WHERE r.vin = s.vin)
"""

Batch = list[tuple[str, str, int, bytes, int]]


# -- measuring a cell ---------------------------------------------------------------------------


class Cell:
    """Measures one cell: operations run on several connections at once; wall time, per-operation
    latency, CPU of the server's processes and of this process, WAL fsyncs and bytes."""

    def __init__(self, cluster: PgCluster, admin: asyncpg.Connection) -> None:
        self.cluster, self.admin = cluster, admin

    async def _wal(self) -> tuple[int, int]:
        await self.admin.execute("SELECT pg_stat_clear_snapshot()")
        row = await self.admin.fetchrow("SELECT wal_sync, wal_bytes::bigint FROM pg_stat_wal")
        assert row is not None
        return int(row[0]), int(row[1])

    @staticmethod
    async def _flush_stats(conns: Sequence[asyncpg.Connection]) -> None:
        """Each backend publishes its pending WAL counters as it goes idle after this statement."""
        for c in conns:
            await c.execute("SELECT pg_stat_force_next_flush()")

    def _server_cpu(self) -> dict[int, float]:
        """CPU seconds of each server process, from schedstat (ns; /proc/PID/stat counts 10 ms ticks)."""
        out = {}
        for pid in descendants(self.cluster.pid):
            with contextlib.suppress(OSError):
                out[pid] = int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9
        return out

    async def run(
        self,
        conns: Sequence[asyncpg.Connection],
        work: Sequence[Sequence[Callable[[], Awaitable[int]]]],
        units: int,
        *,
        commits: bool = True,
    ) -> dict[str, float]:
        """Run work[i] (a list of operations, each returning the rows it touched) on conns[i], all at
        once; `units` = what the rates count (rows, claims, statements) in all; `commits`: each
        operation is a write transaction (else commits per WAL fsync is not a number)."""
        await self._flush_stats(conns)
        wal0, cpu0, self0 = await self._wal(), self._server_cpu(), time.process_time()
        lat: list[float] = []
        touched = 0

        async def loop(ops: Sequence[Callable[[], Awaitable[int]]]) -> None:
            nonlocal touched
            for op in ops:
                t = time.perf_counter()
                rows = await op()  # not `touched += await op()`: that reads touched before the await
                lat.append(time.perf_counter() - t)
                touched += rows

        t0 = time.perf_counter()
        await asyncio.gather(*(loop(w) for w in work))
        wall = time.perf_counter() - t0
        cpu1, own_cpu = self._server_cpu(), time.process_time() - self0
        server_cpu = sum(c - cpu0.get(pid, 0.0) for pid, c in cpu1.items())  # a process that ended: lost
        await self._flush_stats(conns)
        wal1 = await self._wal()
        syncs = wal1[0] - wal0[0]
        return {
            "per_s": units / wall,
            "ops_per_s": len(lat) / wall,
            "p50_ms": pct(lat, 0.5) * 1000,
            "p99_ms": pct(lat, 0.99) * 1000,
            "touched": touched,
            "wal_syncs": syncs,
            "commits_per_wal_sync": len(lat) / syncs if commits and syncs else float("nan"),
            "wal_bytes_per_unit": (wal1[1] - wal0[1]) / units,
            "server_cpu_us": server_cpu / units * 1e6,
            "client_cpu_us": own_cpu / units * 1e6,
            "client_cpu_share": own_cpu / wall,
        }


async def open_part(cluster: PgCluster, name: str, conns: int) -> tuple[asyncpg.Connection, list[asyncpg.Connection]]:
    """A fresh database with the schema: an admin connection and `conns` workers, all as the
    superuser (CHECKPOINT, VACUUM, WAL statistics)."""
    cluster.new_database(name)
    dsn = cluster.dsn_for(name, SUPERUSER)
    admin = await asyncpg.connect(dsn)
    await admin.execute(SCHEMA)
    return admin, [await asyncpg.connect(dsn) for _ in range(conns)]


async def close_all(admin: asyncpg.Connection, pool: Sequence[asyncpg.Connection]) -> None:
    for c in [*pool, admin]:
        await c.close()


def spread(ops: Sequence[Any], n: int) -> list[list[Any]]:
    """Deal ops round-robin onto n connections."""
    return [list(ops[i::n]) for i in range(n)]


# -- (a) ingest ---------------------------------------------------------------------------------


def make_batches(seed: int, fleet: Sequence[str], count: int, tag: str) -> list[Batch]:
    """Batches of 200 distinct VINs (sorted: one lock order), a new request id each, 4 shared blobs."""
    rng = random.Random(seed)
    shas = [hashlib.sha1(f"blob-{i}".encode()).digest() for i in range(4)]
    out = []
    for i in range(count):
        rid, ts, sha = f"task_ota_{tag}_{i}", 1_700_000_000_000 + i, shas[i % 4]
        out.append([(v, rid, ts, sha, 1024) for v in sorted(rng.sample(fleet, BATCH_VINS))])
    return out


def ingest_op(method: str, conn: asyncpg.Connection, batch: Batch) -> Callable[[], Awaitable[int]]:
    async def executemany() -> int:
        await conn.executemany(EXECUTEMANY, batch)  # atomic since asyncpg 0.22: one implicit transaction
        return len(batch)

    async def unnest() -> int:
        cols = list(zip(*batch, strict=True))
        await conn.execute(UNNEST, *cols)
        return len(batch)

    async def copy() -> int:
        async with conn.transaction():
            await conn.copy_records_to_table("stage", records=batch)
            await conn.execute(MERGE)
        return len(batch)

    return {"executemany": executemany, "unnest": unnest, "copy": copy}[method]


async def part_ingest(
    cluster: PgCluster, args: argparse.Namespace, conns_levels: list[int], fleet: list[str]
) -> list[dict[str, Any]]:
    admin, pool = await open_part(cluster, "ingest", max(conns_levels))
    for c in pool:
        await c.execute(STAGE)
    cell = Cell(cluster, admin)
    methods = ["executemany", "unnest", "copy"]
    warm = make_batches(7, fleet, 2 * len(pool), "warm")
    for m in methods:  # prepares every statement on every connection, outside the measurement
        await asyncio.gather(*(ingest_op(m, c, b)() for c, b in zip(pool, warm, strict=False)))
    cells = [(m, n) for n in conns_levels for m in methods]
    results: dict[tuple[str, int], list[dict[str, float]]] = {c: [] for c in cells}
    for r in range(args.rounds):
        for k in range(len(cells)):
            m, n = cells[(k + r) % len(cells)]
            await admin.execute("TRUNCATE rows")
            await admin.execute("CHECKPOINT")  # no checkpoint's writes inside a measurement
            batches = make_batches(1000 * r + k, fleet, args.batches, f"{r}_{k}")
            work = [[ingest_op(m, c, b) for b in share] for c, share in zip(pool, spread(batches, n), strict=False)]
            res = await cell.run(pool[:n], work, units=args.batches * BATCH_VINS)
            if res["touched"] != args.batches * BATCH_VINS:
                raise SystemExit(f"ingest {m}: wrote {res['touched']} rows of {args.batches * BATCH_VINS}")
            stored = await admin.fetchval("SELECT count(*) FROM rows")
            if stored != args.batches * BATCH_VINS:
                raise SystemExit(f"ingest {m}: {stored} rows stored of {args.batches * BATCH_VINS}")
            results[(m, n)].append(res)
            print(f"ingest round {r + 1} {m} x{n}: {res['per_s']:,.0f} rows/s", file=sys.stderr)
    await close_all(admin, pool)
    return [{"method": m, "conns": n, "runs": results[(m, n)]} for m, n in cells]


# -- (b) claim ----------------------------------------------------------------------------------


async def add_rows(admin: asyncpg.Connection, vins: Sequence[str], per_vin: int) -> None:
    """`per_vin` pending rows for each of `vins`, oldest first in request id order."""
    sha = hashlib.sha1(b"queued").digest()
    for k in range(per_vin):
        await admin.execute(
            "INSERT INTO rows SELECT v, $2, $3, $4, 1024 FROM unnest($1::text[]) v",
            list(vins), f"task_ota_q{k}", 1_700_000_000_000 + k, sha,
        )  # fmt: skip


def claim_op(conn: asyncpg.Connection, vin: str, session: str) -> Callable[[], Awaitable[int]]:
    async def claim() -> int:
        return len(await conn.fetch(CLAIM, vin, session))

    return claim


async def part_claim(
    cluster: PgCluster, args: argparse.Namespace, conns_levels: list[int], fleet: list[str]
) -> list[dict[str, Any]]:
    admin, pool = await open_part(cluster, "claim", max(conns_levels))
    vins = fleet[: args.claims]
    await admin.execute("INSERT INTO vin_state (vin) SELECT * FROM unnest($1::text[])", vins)
    await add_rows(admin, vins, per_vin=3)
    await admin.execute("VACUUM ANALYZE")
    cell = Cell(cluster, admin)
    cells = [(kind, n) for n in conns_levels for kind in ("claim", "miss")]
    results: dict[tuple[str, int], list[dict[str, float]]] = {c: [] for c in cells}
    for r in range(args.rounds):
        levels = conns_levels[r % len(conns_levels) :] + conns_levels[: r % len(conns_levels)]
        # A miss needs every VIN in flight: at each level the claims run first, then the misses.
        for kind, n in [(kind, n) for n in levels for kind in ("claim", "miss")]:
            if kind == "claim":
                await admin.execute("UPDATE vin_state SET inflight_request_id = NULL, inflight_sha1 = NULL")
                await admin.execute("VACUUM vin_state")
                await admin.execute("CHECKPOINT")
            shuffled = random.Random(r * 31 + n).sample(vins, len(vins))
            work = [
                [claim_op(c, v, f"session-{i}") for i, v in enumerate(share)]
                for c, share in zip(pool, spread(shuffled, n), strict=False)
            ]
            res = await cell.run(pool[:n], work, units=len(vins), commits=kind == "claim")
            expected = len(vins) if kind == "claim" else 0
            if res["touched"] != expected:
                raise SystemExit(f"{kind} x{n}: {res['touched']} claims returned a row, expected {expected}")
            results[(kind, n)].append(res)
            print(f"claim round {r + 1} {kind} x{n}: {res['per_s']:,.0f}/s", file=sys.stderr)
    await close_all(admin, pool)
    return [{"kind": k, "conns": n, "runs": results[(k, n)]} for k, n in cells]


# -- (c) heartbeat filter -----------------------------------------------------------------------


def filter_op(conn: asyncpg.Connection, vins: list[str]) -> Callable[[], Awaitable[int]]:
    async def heartbeat_filter() -> int:
        return len(await conn.fetch(FILTER, vins))

    return heartbeat_filter


async def part_filter(
    cluster: PgCluster, args: argparse.Namespace, conns_levels: list[int], fleet: list[str]
) -> list[dict[str, Any]]:
    admin, pool = await open_part(cluster, "filter", max(conns_levels))
    await admin.execute("INSERT INTO vin_state (vin) SELECT * FROM unnest($1::text[])", fleet)
    rng = random.Random(5)
    pending = rng.sample(fleet, int(len(fleet) * args.pending_share))
    await add_rows(admin, pending, per_vin=3)
    in_flight = pending[: len(pending) // 2]  # half of them already have a delivery out
    await admin.execute(
        "UPDATE vin_state SET inflight_request_id = 'task_ota_q0', inflight_at = now() WHERE vin = ANY($1::text[])",
        in_flight,
    )
    await admin.execute("VACUUM ANALYZE")
    sizes = [int(x) for x in args.filter_sizes.split(",")]
    for c in pool:  # prepare, outside the measurement
        await filter_op(c, fleet[:10])()
    plans = {size: await vin_state_access(admin, random.Random(size).sample(fleet, size)) for size in sizes}
    cell = Cell(cluster, admin)
    cells = [(size, n) for size in sizes for n in conns_levels]
    results: dict[tuple[int, int], list[dict[str, float]]] = {c: [] for c in cells}
    for r in range(args.rounds):
        for k in range(len(cells)):
            size, n = cells[(k + r) % len(cells)]
            pick = random.Random(r * 97 + k)
            lists = [pick.sample(fleet, size) for _ in range(args.filters)]
            work = [[filter_op(c, vs) for vs in share] for c, share in zip(pool, spread(lists, n), strict=False)]
            res = await cell.run(pool[:n], work, units=args.filters, commits=False)
            res["vins_per_s"] = res["per_s"] * size
            res["matched_per_statement"] = res["touched"] / args.filters
            results[(size, n)].append(res)
            print(f"filter round {r + 1} N={size} x{n}: {res['per_s']:,.0f} statements/s", file=sys.stderr)
    await close_all(admin, pool)
    return [{"vins": s, "conns": n, "plan": plans[s], "runs": results[(s, n)]} for s, n in cells]


async def vin_state_access(admin: asyncpg.Connection, vins: list[str]) -> str:
    """How the filter reads vin_state (a seq scan's cost grows with the fleet), as a prepared statement
    runs it after its first five executions: the plan cache may then switch to a generic plan."""
    name = f"filter_{len(vins)}"
    assert all(v.isalnum() for v in vins)  # so they may stand in an array literal: EXECUTE takes no $1
    literal = "'{" + ",".join(vins) + "}'"
    await admin.execute(f"PREPARE {name}(text[]) AS {FILTER}")
    for _ in range(6):
        await admin.fetch(f"EXECUTE {name}({literal})")
    plan = [r[0] for r in await admin.fetch(f"EXPLAIN EXECUTE {name}({literal})")]
    await admin.execute(f"DEALLOCATE {name}")
    node = next((line for line in plan if " on vin_state" in line), "?")
    return node.split("->")[-1].split(" on vin_state")[0].strip()


# -- report -------------------------------------------------------------------------------------


def fdatasync_ms(directory: Path, n: int = 200) -> float:
    """Median time of an 8 KiB write + fdatasync in `directory` (the cluster's filesystem)."""
    fd, path = tempfile.mkstemp(dir=directory)
    try:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            os.pwrite(fd, b"\0" * 8192, 0)
            os.fdatasync(fd)
            times.append(time.perf_counter() - t)
    finally:
        os.close(fd)
        os.unlink(path)
    return statistics.median(times) * 1000


async def run(args: argparse.Namespace) -> dict[str, Any]:
    conns_levels = [int(x) for x in args.conns.split(",")]
    only = set(args.only.split(","))
    load_before = os.getloadavg()[0]
    cluster = PgCluster.create(name="bench")
    try:
        fleet = make_vins(3, args.fleet)
        admin = await asyncpg.connect(cluster.admin_dsn)
        settings = dict(await admin.fetch(
            "SELECT name, setting FROM pg_settings WHERE name = ANY($1)",
            ["fsync", "synchronous_commit", "wal_sync_method", "server_version"],
        ))  # fmt: skip
        await admin.close()
        if settings["fsync"] != "on" or settings["synchronous_commit"] != "on":
            raise SystemExit(f"the cluster must be durable: {settings}")
        sync_ms = fdatasync_ms(cluster.dir)
        ingest = await part_ingest(cluster, args, conns_levels, fleet) if "ingest" in only else []
        claim = await part_claim(cluster, args, conns_levels, fleet) if "claim" in only else []
        filt = await part_filter(cluster, args, conns_levels, fleet) if "filter" in only else []
        meta = {
            "command": shlex.join([".venv/bin/python", "-m", "bench.pg_raw", *sys.argv[1:]]),
            **settings,
            "asyncpg": asyncpg.__version__,
            "cpus": os.cpu_count(),
            "fdatasync_ms": sync_ms,
            "load_before": load_before,
            "load_after": os.getloadavg()[0],
            **{k: getattr(args, k) for k in ("rounds", "batches", "claims", "filters", "fleet", "pending_share")},
        }
    finally:
        cluster.stop()
    return {"meta": meta, "ingest": ingest, "claim": claim, "filter": filt}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Raw PostgreSQL limits: ingest, claim, heartbeat filter (asyncpg).")
    p.add_argument("--rounds", type=int, default=3, help="rounds; medians over them (default 3)")
    p.add_argument("--conns", default="1,4,8", help="concurrent connections per cell (default 1,4,8)")
    p.add_argument("--batches", type=int, default=100, help="(a) 200-row batches per cell (default 100)")
    p.add_argument("--claims", type=int, default=2000, help="(b) VINs claimed per cell (default 2000)")
    p.add_argument("--filter-sizes", default="100,1000", help="(c) VINs per statement (default 100,1000)")
    p.add_argument("--filters", type=int, default=300, help="(c) statements per cell (default 300)")
    p.add_argument("--fleet", type=int, default=100_000, help="VINs the batches and heartbeats draw from")
    p.add_argument("--pending-share", type=float, default=0.2, help="(c) share of the fleet with pending rows")
    p.add_argument("--only", default="ingest,claim,filter", help="parts to run (default all three)")
    p.add_argument("--smoke", action="store_true", help="1 round, small cells (~20 s)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.batches, args.claims, args.filters, args.fleet = 1, 20, 300, 50, 10_000
    out = asyncio.run(run(args))
    report(out["meta"], out["ingest"], out["claim"], out["filter"])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
