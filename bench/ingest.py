"""Durable ingest throughput: sdv-fanout over gRPC against a raw py-lmdb loop, same run.

Scenario: R rounds of B seed-000 batches ({"ids": [V VINs], "request_id":
"task_<type>_<n>", "data": base64 of a 1 KiB blob}), half of them reusing a
blob from a small shared set so dedup kicks in. Each round runs, in
alternating order, two (three) measurements on the same pre-generated batches:

* ours: a real `sdv-fanout serve` (its default process count, or
  --server-processes) on 127.0.0.1 with a fresh data dir, fed
  OnMessagePublish (emqx.exhook.v3) from C concurrent client channels
  (grpc.aio, pre-serialised requests, closed loop), like EMQX's pool of C.
  A batch counts once its answer is back, i.e. once it is fsynced.
* raw: one thread, fresh LMDB env with the server's options (sync, metasync),
  writing the same entries with the same key layout (blob put if absent, its
  `touched` stamp, one `ids` row and one `expiry` row per VIN) in one write
  transaction per batch: commit = fsync per batch. No gRPC, no JSON, no
  validation, no logging, no check for a row to replace.
* raw-tuned (with --tuned): the same loop written with the LMDB calls the
  server's writer uses (keys sorted, one cursor per table, putmulti, expiry
  appended when it sorts last): how much of ours/raw is only the choice of
  py-lmdb calls.

After each ours run the LMDB file is measured: bytes per pending row (pages of
`ids` + `expiry`, over rows), blob overhead (pages of `data` + `touched`, less
the payload bytes, over blobs) and the whole file.

--levels 1,10,100 adds a scale run: --level-batches x level batches per run
(fresh server and env each), ours and raw paired, to show whether the cost per
row stays flat as the work (and the store) grows 10x and 100x.

Prints a markdown table (min / median / max over rounds) and optionally JSON.

    .venv/bin/python -m bench.ingest [--rounds 5] [--batches 300] [--clients 8] [--vins 200] [--scale 1] [--json F]
    .venv/bin/python -m bench.ingest --levels 1,10,100 [--level-batches 30]    # + the scale run (~1 min)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import math
import os
import platform
import random
import resource
import shutil
import signal
import statistics
import string
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import lmdb

from exhook_server._proto import exhook_v3_pb2 as pb
from storage.lmdb import keys
from testkit.harness import SubprocessServer
from testkit.plumbing import dec, descendants, machine_busy_s, num, share

METHOD = "/emqx.exhook.v3.HookProvider/OnMessagePublish"
BATCH_TOPIC = "$SDV-FANOUT"
TASK_TYPES = ("ota", "config", "diag", "remote", "campaign")
VIN_CHARS = "ABCDEFGHJKLMNPRSTUVWXYZ" + string.digits  # no I, O, Q, as in real VINs
#: Same LMDB options as storage/lmdb/store.py, so the reference pays the same fsyncs.
LMDB_OPTS: dict[str, Any] = {
    "map_size": 1 << 30,
    "max_dbs": 7,
    "sync": True,
    "metasync": True,
    "readahead": False,
    "max_readers": 1024,
}
#: Every named database of storage/lmdb/store.py, for the disk measurement.
DB_NAMES = ("data", "touched", "ids", "expiry", "aliases", "early", "meta")


# -- workload -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Batch:
    vins: list[str]
    request_id: str
    blob: bytes
    wire: bytes  # the serialised MessagePublishRequest


def _vin(rng: random.Random) -> str:
    return "LSV" + "".join(rng.choices(VIN_CHARS, k=14))


def _publish_request(rng: random.Random, payload: bytes, topic: str = BATCH_TOPIC) -> bytes:
    """OnMessagePublish as EMQX sends it (as testkit/harness.py ExHookClient.publish builds it)."""
    msg = pb.Message(
        node="emqx@127.0.0.1",
        id=rng.randbytes(16).hex().upper(),
        qos=1,
        topic=topic,
        payload=payload,
        timestamp=1_700_000_000_000,
        headers={"username": "platform", "protocol": "mqtt", "peerhost": "127.0.0.1"},
    )
    setattr(msg, "from", "sdv-platform")
    req = pb.MessagePublishRequest(
        message=msg, meta=pb.RequestMeta(node="emqx@127.0.0.1", version="5.8.9", cluster_name="emqxcl")
    )
    return bytes(req.SerializeToString())


def make_workload(
    seed: int, batches: int, vins_per_batch: int, fleet: int, blob_bytes: int, shared_blobs: int, campaigns: int = 0
) -> list[Batch]:
    """`campaigns` K > 0: instead, K campaigns take turns, each one request id and one payload sent
    in batches of VINs it has not named yet (a large campaign in 200-VIN batches), so every batch
    after a campaign's first extends a generation the store already counts; `fleet` is then
    ignored (each campaign names its own share of batches x VINs)."""
    rng = random.Random(seed)
    if campaigns:
        return _campaign_workload(rng, batches, vins_per_batch, blob_bytes, campaigns)
    fleet_vins = list(dict.fromkeys(_vin(rng) for _ in range(fleet)))
    if len(fleet_vins) < vins_per_batch:
        raise SystemExit(f"--fleet must be at least --vins ({vins_per_batch})")
    shared = [rng.randbytes(blob_bytes) for _ in range(shared_blobs)]
    out = []
    for n in range(batches):
        vins = rng.sample(fleet_vins, vins_per_batch)
        request_id = f"task_{TASK_TYPES[n % len(TASK_TYPES)]}_{n}"
        # Half of the batches resend one of a few popular payloads: dedup by sha1 kicks in.
        blob = rng.choice(shared) if n % 2 else rng.randbytes(blob_bytes)
        out.append(_batch(rng, vins, request_id, blob))
    return out


def _campaign_workload(
    rng: random.Random, batches: int, vins_per_batch: int, blob_bytes: int, campaigns: int
) -> list[Batch]:
    need = -(-batches // campaigns) * vins_per_batch  # the VINs of the largest campaign
    fleet: dict[str, None] = {}
    while len(fleet) < need:
        fleet[_vin(rng)] = None
    orders = [rng.sample(list(fleet), need) for _ in range(campaigns)]
    blobs = [rng.randbytes(blob_bytes) for _ in range(campaigns)]
    out = []
    for n in range(batches):
        c, i = n % campaigns, n // campaigns
        vins = orders[c][i * vins_per_batch : (i + 1) * vins_per_batch]
        out.append(_batch(rng, vins, f"task_campaign_{c}", blobs[c]))
    return out


def _batch(rng: random.Random, vins: list[str], request_id: str, blob: bytes) -> Batch:
    doc = {
        "ids": vins,
        "request_id": request_id,
        "data": base64.b64encode(blob).decode(),
        "data_encoding": "base64",
    }
    return Batch(vins, request_id, blob, _publish_request(rng, json.dumps(doc).encode()))


# -- measurement helpers --------------------------------------------------------


def own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def group_cpu_s(pids: Sequence[int]) -> float:
    """CPU time of some processes (every thread), in ns resolution from schedstat: the server
    and its children. /proc/<pid>/stat counts 10 ms ticks, too coarse for the short scale levels."""
    total_ns = 0
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except FileNotFoundError:
            continue
        for task in tasks:
            try:
                total_ns += int((task / "schedstat").read_text().split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue
    return total_ns / 1e9


def pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def last_txnid(data_dir: Path) -> int:
    """LMDB's last committed write-transaction id: one per commit, i.e. one per fsync group."""
    env = lmdb.open(str(data_dir), readonly=True, lock=True, max_dbs=len(DB_NAMES), map_size=0)
    try:
        return int(env.info()["last_txnid"])
    finally:
        env.close()


def disk_usage(data_dir: Path) -> dict[str, Any]:
    """What the rows and blobs cost on disk, from LMDB's own page counts (read-only, after the run).

    bytes_per_row: pages of `ids` + `expiry` over rows (branch, leaf, overflow);
    blob_overhead_bytes: pages of `data` + `touched` less the payload bytes, over blobs;
    file_used_bytes: (last_pgno + 1) x page size, i.e. with free pages, meta pages and every table.
    """
    env = lmdb.open(str(data_dir), readonly=True, lock=True, max_dbs=len(DB_NAMES), map_size=0)
    try:
        psize = int(env.stat()["psize"])
        used = (int(env.info()["last_pgno"]) + 1) * psize
        pages: dict[str, int] = {}
        entries: dict[str, int] = {}
        payload = 0
        with env.begin(buffers=True) as txn:
            # Every named database, ours or not: which schema wrote the store (an older tree's has fewer).
            tables = sorted(bytes(k).decode() for k in txn.cursor().iternext(values=False))
            for name in DB_NAMES:
                try:
                    db = env.open_db(name.encode(), txn=txn, create=False)
                except lmdb.NotFoundError:
                    continue
                st = txn.stat(db)
                pages[name] = int(st["branch_pages"]) + int(st["leaf_pages"]) + int(st["overflow_pages"])
                entries[name] = int(st["entries"])
                if name == "data":
                    payload = sum(len(v) - keys.BLOB_HEAD_SIZE for v in txn.cursor(db).iternext(keys=False))
    finally:
        env.close()
    rows, blobs = entries.get("ids", 0), entries.get("data", 0)
    row_bytes = (pages.get("ids", 0) + pages.get("expiry", 0)) * psize
    blob_bytes = (pages.get("data", 0) + pages.get("touched", 0)) * psize
    return {
        "rows": rows,
        "blobs": blobs,
        "payload_bytes": payload,
        "bytes_per_row": row_bytes / rows if rows else None,
        "ids_bytes_per_row": pages.get("ids", 0) * psize / rows if rows else None,
        "expiry_bytes_per_row": pages.get("expiry", 0) * psize / rows if rows else None,
        "blob_overhead_bytes": (blob_bytes - payload) / blobs if blobs else None,
        "file_used_bytes": used,
        "file_bytes_per_row": used / rows if rows else None,
        "pages": pages,
        "page_bytes": psize,
        "tables": tables,
    }


def fsync_probe(directory: Path, n: int = 50) -> float:
    """Median ms of a 4 KiB pwrite + fdatasync on the bench's tmp filesystem."""
    path = directory / "fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    times = []
    try:
        for i in range(n):
            t = time.perf_counter()
            os.pwrite(fd, b"x" * 4096, (i % 16) * 4096)
            os.fdatasync(fd)
            times.append(time.perf_counter() - t)
    finally:
        os.close(fd)
        path.unlink()
    return statistics.median(times) * 1000


# -- ours: the real server over gRPC --------------------------------------------


async def _drive(port: int, batches: list[Batch], clients: int) -> tuple[float, list[float], list[bytes]]:
    """Send every batch from `clients` channels, closed loop; returns (seconds, latencies, answers)."""
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    # One channel per client, each its own connection (EMQX's pool opens pool_size connections).
    channels = [
        grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[*options, ("grpc.use_local_subchannel_pool", 1)])
        for _ in range(clients)
    ]
    try:
        stubs = [ch.unary_unary(METHOD) for ch in channels]  # bytes in, bytes out: no client-side protobuf
        warm = _publish_request(random.Random(0), b"{}", topic="bench/warmup")  # not a batch topic: IGNORE
        for stub in stubs:
            await stub(warm, timeout=10)
        answers: list[bytes] = [b""] * len(batches)
        latencies: list[float] = [0.0] * len(batches)
        next_index = iter(range(len(batches)))

        async def client(stub: Any) -> None:
            for i in next_index:
                t = time.perf_counter()
                answers[i] = await stub(batches[i].wire, timeout=30)
                latencies[i] = time.perf_counter() - t

        t0 = time.perf_counter()
        await asyncio.gather(*(client(s) for s in stubs))
        return time.perf_counter() - t0, latencies, answers
    finally:
        for ch in channels:
            await ch.close()


def run_ours(
    batches: list[Batch], clients: int, tmp: Path, log_level: str, processes: int, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """`env`: more settings for the server (bench/status_cost.py: a broker, the status topic, or
    PYTHONPATH to an older tree: rows and blobs are therefore counted from LMDB itself, any schema)."""
    data_dir = tmp / "lmdb"
    env = {**({"SDV_FANOUT_PROCESSES": str(processes)} if processes else {}), **(env or {})}
    server = SubprocessServer(data_dir, "--log-level", log_level, env=env)
    try:
        pids = descendants(server.proc.pid)  # the parent and, when it runs several, its children
        txn_before = last_txnid(data_dir)
        busy0, cpu_c0, cpu_s0 = machine_busy_s(), own_cpu_s(), group_cpu_s(pids)
        seconds, latencies, answers = asyncio.run(_drive(server.port, batches, clients))
        cpu_c, cpu_s = own_cpu_s() - cpu_c0, group_cpu_s(pids) - cpu_s0
        busy = machine_busy_s() - busy0
        txn_after = last_txnid(data_dir)
    finally:
        if server.proc.poll() is None:
            try:
                server.terminate(20)
            except Exception:
                server.kill()
    bad = [
        i for i, a in enumerate(answers) if pb.ValuedResponse.FromString(a).type != pb.ValuedResponse.STOP_AND_RETURN
    ]
    if bad:
        raise SystemExit(f"server did not store {len(bad)} batches, e.g. #{bad[0]}:\n{server.log()[-2000:]}")
    disk = disk_usage(data_dir)
    commits = txn_after - txn_before
    rows = disk["rows"]
    return {
        "seconds": seconds,
        "batches": len(batches),
        "rows": rows,
        "blobs": disk["blobs"],
        # Bytes the rows would take without dedup, per payload byte stored (Store.stats' ratio).
        "dedup_ratio": sum(len(b.blob) * len(b.vins) for b in batches) / disk["payload_bytes"],
        "commits": commits,
        "batches_per_commit": len(batches) / commits if commits else None,
        "p50_ms": pct(latencies, 0.50) * 1000,
        "p99_ms": pct(latencies, 0.99) * 1000,
        "client_cpu": cpu_c / seconds,
        "server_cpu": cpu_s / seconds,
        "server_processes": max(1, len(pids) - 1),  # a group: the parent only supervises
        "server_cpu_us_per_row": cpu_s / rows * 1e6 if rows else None,
        # Anything else on the machine in the same window (should be ~0): a busy neighbour
        # explains a bad round better than the code does.
        "other_cpu": max(0.0, busy - cpu_c - cpu_s) / seconds,
        "disk": disk,
    }


# -- raw: py-lmdb, one synced transaction per batch -----------------------------


def _raw_plain(txn: lmdb.Transaction, dbs: dict[str, Any], b: Batch, sha1: bytes, now: int) -> None:
    """The obvious loop: one put per entry, blob only if absent."""
    txn.put(sha1, keys.encode_u64(now), db=dbs["touched"])
    if txn.get(sha1, db=dbs["data"]) is None:
        txn.put(sha1, keys.blob_value(now, b.blob), db=dbs["data"])
    value = keys.row_value(now, sha1, len(b.blob))
    for vin in b.vins:
        rkey = keys.row_key(vin, b.request_id)
        txn.put(rkey, value, db=dbs["ids"])
        txn.put(keys.expiry_key(now, rkey), b"", db=dbs["expiry"])


def _raw_tuned(txn: lmdb.Transaction, dbs: dict[str, Any], b: Batch, sha1: bytes, now: int) -> None:
    """The same entries through the calls storage/lmdb/batches.py uses (no check for a row to replace)."""
    txn.put(sha1, keys.encode_u64(now), db=dbs["touched"])
    txn.put(sha1, keys.blob_value(now, b.blob), overwrite=False, db=dbs["data"])
    rkeys = sorted(keys.row_keys(b.vins, b.request_id))
    value = keys.row_value(now, sha1, len(b.blob))
    txn.cursor(dbs["ids"]).putmulti([(k, value) for k in rkeys])
    cur = txn.cursor(dbs["expiry"])
    entries = keys.expiry_entries(now, rkeys)
    cur.putmulti(entries, append=not cur.last() or bytes(cur.key()) < entries[0][0])


RAW_LOOPS = {"raw": _raw_plain, "raw_tuned": _raw_tuned}


def run_raw(batches: list[Batch], tmp: Path, variant: str = "raw") -> dict[str, Any]:
    write = RAW_LOOPS[variant]
    env = lmdb.open(str(tmp / "raw"), **LMDB_OPTS)
    try:
        dbs = {name: env.open_db(name.encode()) for name in ("data", "touched", "ids", "expiry")}
        latencies = []
        busy0, cpu0 = machine_busy_s(), own_cpu_s()
        t0 = time.perf_counter()
        for b in batches:
            t = time.perf_counter()
            now = time.time_ns() // 1_000_000
            sha1 = hashlib.sha1(b.blob, usedforsecurity=False).digest()
            with env.begin(write=True) as txn:  # commits (and fsyncs) at the end of the block
                write(txn, dbs, b, sha1, now)
            latencies.append(time.perf_counter() - t)
        seconds = time.perf_counter() - t0
        cpu = own_cpu_s() - cpu0
        busy = machine_busy_s() - busy0
        with env.begin() as txn:
            rows = int(txn.stat(dbs["ids"])["entries"])
            blobs = int(txn.stat(dbs["data"])["entries"])
        commits = len(batches)
    finally:
        env.close()
    return {
        "seconds": seconds,
        "batches": len(batches),
        "rows": rows,
        "blobs": blobs,
        "commits": commits,
        "batches_per_commit": 1.0,
        "p50_ms": pct(latencies, 0.50) * 1000,
        "p99_ms": pct(latencies, 0.99) * 1000,
        "client_cpu": cpu / seconds,
        "other_cpu": max(0.0, busy - cpu) / seconds,
        "disk": disk_usage(tmp / "raw"),
    }


def measure(
    side: str, batches: list[Batch], tmp: Path, args: argparse.Namespace, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """One measurement of `side` on `batches` in its own fresh tmp dir, checked and with rates
    (`env`: more server settings, for ours)."""
    tmp.mkdir()
    try:
        if side == "ours":
            res = run_ours(batches, args.clients, tmp, args.log_level, args.server_processes, env)
        else:
            res = run_raw(batches, tmp, side)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    expected = len(batches) * args.vins
    if res["rows"] != expected:
        raise SystemExit(f"{side}: {res['rows']} rows stored, expected {expected}")
    res["rows_per_s"] = expected / res["seconds"]
    res["batches_per_s"] = len(batches) / res["seconds"]
    return res


# -- report ---------------------------------------------------------------------


def _mmm(values: Sequence[float], fmt: Callable[[float], str]) -> tuple[str, str, str]:
    return fmt(min(values)), fmt(statistics.median(values)), fmt(max(values))


SIDES = ("ours", "raw", "raw_tuned")


def _col(rounds: list[dict[str, Any]], side: str, key: str) -> list[float]:
    return [r[side][key] for r in rounds if side in r and r[side].get(key) is not None]


def _disk_col(rounds: list[dict[str, Any]], side: str, key: str) -> list[float]:
    return [r[side]["disk"][key] for r in rounds if side in r and r[side]["disk"].get(key) is not None]


def summarise(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    series = {
        "ours_rows_per_s": _col(rounds, "ours", "rows_per_s"),
        "ours_batches_per_s": _col(rounds, "ours", "batches_per_s"),
        "raw_rows_per_s": _col(rounds, "raw", "rows_per_s"),
        "raw_batches_per_s": _col(rounds, "raw", "batches_per_s"),
        "raw_tuned_rows_per_s": _col(rounds, "raw_tuned", "rows_per_s"),
        "ratio_ours_over_raw": [r["ratio"] for r in rounds],
        "ratio_ours_over_raw_tuned": [r["ratio_tuned"] for r in rounds if "ratio_tuned" in r],
        "ours_batches_per_commit": _col(rounds, "ours", "batches_per_commit"),
        "ours_p50_ms": _col(rounds, "ours", "p50_ms"),
        "ours_p99_ms": _col(rounds, "ours", "p99_ms"),
        "raw_p50_ms": _col(rounds, "raw", "p50_ms"),
        "raw_p99_ms": _col(rounds, "raw", "p99_ms"),
        "ours_server_cpu": _col(rounds, "ours", "server_cpu"),
        "ours_server_cpu_us_per_row": _col(rounds, "ours", "server_cpu_us_per_row"),
        "ours_client_cpu": _col(rounds, "ours", "client_cpu"),
        "raw_cpu": _col(rounds, "raw", "client_cpu"),
        "other_cpu": [r[side]["other_cpu"] for r in rounds for side in SIDES if side in r],
        "ours_bytes_per_row": _disk_col(rounds, "ours", "bytes_per_row"),
        "ours_blob_overhead_bytes": _disk_col(rounds, "ours", "blob_overhead_bytes"),
        "raw_bytes_per_row": _disk_col(rounds, "raw", "bytes_per_row"),
    }
    for name, values in series.items():
        if values:
            out[name] = {"min": min(values), "median": statistics.median(values), "max": max(values)}
    return out


def disk_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds of the disk figures of ours (and raw's bytes per row, same layout)."""
    keys_ = ("bytes_per_row", "ids_bytes_per_row", "expiry_bytes_per_row", "blob_overhead_bytes", "file_bytes_per_row")
    out: dict[str, Any] = {}
    for key in keys_:
        values = _disk_col(rounds, "ours", key)
        out[key] = statistics.median(values) if values else None
    raw = _disk_col(rounds, "raw", "bytes_per_row")
    out["raw_bytes_per_row"] = statistics.median(raw) if raw else None
    if rounds:
        out["page_bytes"] = rounds[0]["ours"]["disk"]["page_bytes"]
        out["pages"] = rounds[0]["ours"]["disk"]["pages"]
    return out


def markdown(rounds: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"### Durable ingest: {meta['batches']} batches x {meta['vins']} VINs per round, "
        f"{meta['rounds']} rounds, {meta['clients']} client channels",
        "",
        "| metric | min | median | max |",
        "|---|---:|---:|---:|",
    ]
    table = [
        ("ours (gRPC -> sdv-fanout serve) VIN-rows/s", _col(rounds, "ours", "rows_per_s"), num),
        ("ours batches/s", _col(rounds, "ours", "batches_per_s"), num),
        ("raw (py-lmdb, 1 fsync'd txn per batch) VIN-rows/s", _col(rounds, "raw", "rows_per_s"), num),
        ("raw batches/s", _col(rounds, "raw", "batches_per_s"), num),
        ("**ratio ours/raw** (paired per round)", [r["ratio"] for r in rounds], dec),
        (
            "raw-tuned (same entries, the writer's py-lmdb calls) VIN-rows/s",
            _col(rounds, "raw_tuned", "rows_per_s"),
            num,
        ),
        ("ratio ours/raw-tuned (paired per round)", [r["ratio_tuned"] for r in rounds if "ratio_tuned" in r], dec),
        ("ours batches per commit (LMDB txn ids)", _col(rounds, "ours", "batches_per_commit"), dec),
        ("ours batch latency p50 ms", _col(rounds, "ours", "p50_ms"), dec),
        ("ours batch latency p99 ms", _col(rounds, "ours", "p99_ms"), dec),
        ("raw batch latency p50 ms", _col(rounds, "raw", "p50_ms"), dec),
        ("raw batch latency p99 ms", _col(rounds, "raw", "p99_ms"), dec),
        ("ours server CPU (of one core, all its processes)", _col(rounds, "ours", "server_cpu"), share),
        ("ours server CPU µs per VIN-row", _col(rounds, "ours", "server_cpu_us_per_row"), dec),
        ("ours client CPU (of one core)", _col(rounds, "ours", "client_cpu"), share),
        ("raw loop CPU (of one core)", _col(rounds, "raw", "client_cpu"), share),
        (
            "**other processes' CPU** (of one core; should be ~0)",
            [r[side]["other_cpu"] for r in rounds for side in SIDES if side in r],
            share,
        ),
        ("ours disk bytes per pending row (ids + expiry pages)", _disk_col(rounds, "ours", "bytes_per_row"), num),
        (
            "ours blob overhead bytes (data + touched pages - payload, per blob)",
            _disk_col(rounds, "ours", "blob_overhead_bytes"),
            num,
        ),
        (
            "ours LMDB file bytes used per row (everything, free pages included)",
            _disk_col(rounds, "ours", "file_bytes_per_row"),
            num,
        ),
        ("raw disk bytes per row (ids + expiry pages)", _disk_col(rounds, "raw", "bytes_per_row"), num),
    ]
    for label, values, fmt in table:
        if values:
            lines.append(f"| {label} | {' | '.join(_mmm(values, fmt))} |")
    r0 = rounds[0]
    d0 = r0["ours"]["disk"]
    lines += [
        "",
        f"Per round: the server ({r0['ours']['server_processes']} process(es)) stored {r0['ours']['rows']:,} rows "
        f"and {r0['ours']['blobs']} blobs for {meta['batches']} batches "
        f"({meta['batches'] - r0['ours']['blobs']} dedup hits), the raw loop {r0['raw']['rows']:,} rows and "
        f"{r0['raw']['blobs']} blobs. LMDB pages of round 1 ({d0['page_bytes']} B each): "
        + ", ".join(f"{k} {v}" for k, v in d0["pages"].items())
        + f". fdatasync on the tmp filesystem: {meta['fsync_ms']:.3f} ms median. "
        f"{meta['cpus']} CPUs shared by client, server and raw loop; 1-min load average "
        f"{meta['loadavg_1m_before']:.2f} before, {meta['loadavg_1m_after']:.2f} after. Seed {meta['seed']}.",
        "",
        "| round | order | ours rows/s | raw rows/s | ratio | raw-tuned rows/s | ours batches/commit "
        "| ours s | raw s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(rounds, 1):
        bpc = r["ours"]["batches_per_commit"]
        tuned = f"{r['raw_tuned']['rows_per_s']:,.0f}" if "raw_tuned" in r else "-"
        lines.append(
            f"| {i} | {r['order']} | {r['ours']['rows_per_s']:,.0f} | {r['raw']['rows_per_s']:,.0f} | "
            f"{r['ratio']:.2f} | {tuned} | {'-' if bpc is None else f'{bpc:.2f}'} | {r['ours']['seconds']:.2f} | "
            f"{r['raw']['seconds']:.2f} |"
        )
    return "\n".join(lines)


def markdown_levels(scale: dict[str, Any], meta: dict[str, Any]) -> str:
    base = scale["results"][0]
    names = ", ".join(f"{r['level']}x" for r in scale["results"])
    lines = [
        f"### Ingest at {names} the work "
        f"({scale['level_batches']} batches x {meta['vins']} VINs = 1x; fresh server and env per run)",
        "",
        "| level | batches | VIN-rows | runs | ours rows/s | raw rows/s | ours/raw | ours rows/s vs "
        f"{base['level']}x | raw rows/s vs {base['level']}x | ours server CPU µs/row | CPU/row vs {base['level']}x | "
        "bytes/row | blob overhead B | batches/commit | other CPU |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in scale["results"]:
        lines.append(
            f"| {r['level']}x | {r['batches']:,} | {r['rows']:,} | {r['runs']} | {r['ours_rows_per_s']:,.0f} | "
            f"{r['raw_rows_per_s']:,.0f} | {r['ratio']:.2f} | {r['ours_rows_per_s_vs_base']:.2f} | "
            f"{r['raw_rows_per_s_vs_base']:.2f} | {r['server_cpu_us_per_row']:.2f} | {r['cpu_per_row_vs_base']:.2f} | "
            f"{r['bytes_per_row']:,.0f} | {r['blob_overhead_bytes']:,.0f} | {r['batches_per_commit']:.2f} | "
            f"{r['other_cpu'] * 100:.0f} % |"
        )
    lines += [
        "",
        "Medians over the runs of a level (small levels run more often: they are short). "
        "Linear or better: CPU/row vs 1x stays at or below ~1 and rows/s vs 1x at or above ~1.",
    ]
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------


def run_round(r: int, batches: list[Batch], tmp_root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One paired round: ours and the raw loop(s) on the same batches, order alternating."""
    sides = SIDES if args.tuned else SIDES[:2]
    order = sides if r % 2 == 0 else sides[::-1]
    result: dict[str, Any] = {"order": "->".join(order)}
    for side in order:
        result[side] = measure(side, batches, tmp_root / f"r{r}-{side}", args)
    result["ratio"] = result["ours"]["rows_per_s"] / result["raw"]["rows_per_s"]
    if "raw_tuned" in result:
        result["ratio_tuned"] = result["ours"]["rows_per_s"] / result["raw_tuned"]["rows_per_s"]
    return result


def run_levels(args: argparse.Namespace, levels: list[int], tmp_root: Path) -> dict[str, Any]:
    """Ours and raw at each multiple of --level-batches; medians per level and ratios to the first."""
    results = []
    for level in levels:
        n = args.level_batches * level
        batches = make_workload(args.seed + level, n, args.vins, args.fleet, args.blob_bytes, args.shared_blobs)
        runs = []
        for k in range(max(1, math.ceil(args.level_repeats / level))):
            order = ("ours", "raw") if k % 2 == 0 else ("raw", "ours")
            run = {side: measure(side, batches, tmp_root / f"L{level}-{k}-{side}", args) for side in order}
            runs.append(run)
        med = statistics.median
        ours = [x["ours"] for x in runs]
        res = {
            "level": level,
            "batches": n,
            "rows": n * args.vins,
            "runs": len(runs),
            "ours_rows_per_s": med(o["rows_per_s"] for o in ours),
            "raw_rows_per_s": med(x["raw"]["rows_per_s"] for x in runs),
            "ratio": med(x["ours"]["rows_per_s"] / x["raw"]["rows_per_s"] for x in runs),
            "server_cpu_us_per_row": med(o["server_cpu_us_per_row"] for o in ours),
            "batches_per_commit": med(o["batches_per_commit"] for o in ours),
            "bytes_per_row": med(o["disk"]["bytes_per_row"] for o in ours),
            "blob_overhead_bytes": med(o["disk"]["blob_overhead_bytes"] for o in ours),
            "file_bytes_per_row": med(o["disk"]["file_bytes_per_row"] for o in ours),
            "other_cpu": med(x[side]["other_cpu"] for x in runs for side in ("ours", "raw")),
            "p50_ms": med(o["p50_ms"] for o in ours),
            "runs_detail": runs,
        }
        results.append(res)
        print(
            f"level {level}x: {n} batches, ours {res['ours_rows_per_s']:,.0f} rows/s, "
            f"raw {res['raw_rows_per_s']:,.0f} rows/s, {res['server_cpu_us_per_row']:.2f} µs CPU/row",
            file=sys.stderr,
            flush=True,
        )
    base = results[0]
    for res in results:
        res["ours_rows_per_s_vs_base"] = res["ours_rows_per_s"] / base["ours_rows_per_s"]
        res["raw_rows_per_s_vs_base"] = res["raw_rows_per_s"] / base["raw_rows_per_s"]
        res["cpu_per_row_vs_base"] = res["server_cpu_us_per_row"] / base["server_cpu_us_per_row"]
        res["bytes_per_row_vs_base"] = res["bytes_per_row"] / base["bytes_per_row"]
    return {"levels": levels, "level_batches": args.level_batches, "results": results}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="sdv-fanout durable ingest vs a raw py-lmdb loop (same run).")
    p.add_argument(
        "--rounds", type=int, default=5, help="measurement pairs; 0 with --levels: scale run only (default 5)"
    )
    p.add_argument("--batches", type=int, default=300, help="batches per round before --scale (default 300)")
    p.add_argument("--clients", type=int, default=8, help="concurrent gRPC channels, like EMQX pool_size (default 8)")
    p.add_argument("--vins", type=int, default=200, help="VINs per batch (default 200)")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies --batches; 0.1 for a smoke run (default 1)")
    p.add_argument("--fleet", type=int, default=20_000, help="distinct VINs batches draw from (default 20000)")
    p.add_argument("--blob-bytes", type=int, default=1024, help="payload size (default 1024)")
    p.add_argument("--shared-blobs", type=int, default=4, help="popular payloads half the batches reuse (default 4)")
    p.add_argument("--seed", type=int, default=20240607)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="server log level (default info, as in production)")  # fmt: skip
    p.add_argument("--server-processes", type=int, default=0,
                   help="SDV_FANOUT_PROCESSES for the server (default 0: the server's own default)")  # fmt: skip
    p.add_argument("--tuned", action="store_true", help="also measure the raw-tuned reference (about +4 s)")
    p.add_argument("--levels", metavar="L,L,...", help="also run the scale test at these multiples, e.g. 1,10,100")
    p.add_argument("--level-batches", type=int, default=30, help="batches at level 1x (default 30)")
    p.add_argument("--level-repeats", type=int, default=5,
                   help="runs of level L: ceil(this / L), so short levels repeat (default 5)")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    n_batches = max(1, round(args.batches * args.scale))
    levels = [int(x) for x in args.levels.split(",")] if args.levels else []
    if args.rounds < (0 if levels else 1) or args.clients < 1 or args.vins < 1:
        p.error("--rounds (unless --levels), --clients and --vins must be positive")
    if levels and (min(levels) < 1 or args.level_batches < 1):
        p.error("--levels and --level-batches must be positive")

    # SIGTERM unwinds like Ctrl-C, so the finally blocks below stop every server this started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_before = os.getloadavg()[0]  # other work on the machine skews every number
    batches = make_workload(args.seed, n_batches, args.vins, args.fleet, args.blob_bytes, args.shared_blobs)
    tmp_root = Path(tempfile.mkdtemp(prefix="sdv-bench-ingest-"))
    rounds: list[dict[str, Any]] = []
    scale: dict[str, Any] | None = None
    try:
        fsync_ms = fsync_probe(tmp_root)
        for r in range(args.rounds):
            result = run_round(r, batches, tmp_root, args)
            rounds.append(result)
            print(
                f"round {r + 1}/{args.rounds}: ours {result['ours']['rows_per_s']:,.0f} rows/s, "
                f"raw {result['raw']['rows_per_s']:,.0f} rows/s, ratio {result['ratio']:.2f}",
                file=sys.stderr,
                flush=True,
            )
        if levels:
            scale = run_levels(args, levels, tmp_root)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)

    meta = {
        "rounds": args.rounds,
        "batches": n_batches,
        "vins": args.vins,
        "clients": args.clients,
        "fleet": args.fleet,
        "blob_bytes": args.blob_bytes,
        "shared_blobs": args.shared_blobs,
        "seed": args.seed,
        "log_level": args.log_level,
        "server_processes": args.server_processes,
        "fsync_ms": fsync_ms,
        "cpus": os.cpu_count(),
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": os.getloadavg()[0],
        "python": platform.python_version(),
        "grpc": grpc.__version__,
        "lmdb": lmdb.__version__,
    }
    parts = []
    if rounds:
        parts.append(markdown(rounds, meta))
    if scale:
        parts.append(markdown_levels(scale, meta))
    print("\n\n".join(parts))
    if args.json:
        out: dict[str, Any] = {"meta": meta, "summary": summarise(rounds), "rounds": rounds}
        if rounds:
            out["disk"] = disk_summary(rounds)
        if scale:
            out["levels"] = scale
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
