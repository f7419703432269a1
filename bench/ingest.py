"""Durable ingest throughput: sdv-fanout over gRPC against a raw py-lmdb loop, same run.

Scenario: R rounds of B seed-000 batches ({"ids": [V VINs], "request_id":
"task_<type>_<n>", "data": base64 of a 1 KiB blob}), half of them reusing a
blob from a small shared set so dedup kicks in. Each round runs, in
alternating order, two measurements on the same pre-generated batches:

* ours: a real `sdv-fanout serve` subprocess on 127.0.0.1 with a fresh data
  dir, fed OnMessagePublish (emqx.exhook.v3) from C concurrent client channels
  (grpc.aio, pre-serialised requests, closed loop), like EMQX's pool of C.
  A batch counts once its answer is back, i.e. once it is fsynced.
* raw: one thread, fresh LMDB env with the server's options (sync, metasync),
  writing the same rows with the same key layout (blob put if absent, one
  `ids` row and one `expiry` row per VIN) in one write transaction per batch:
  commit = fsync per batch. No gRPC, no JSON, no validation, no logging.

Prints a markdown table (min / median / max over rounds) and optionally JSON.

    .venv/bin/python bench/ingest.py [--rounds 5] [--batches 300] [--clients 8] [--vins 200] [--scale 1] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, for tests.harness

from exhook_server._proto import exhook_v3_pb2 as pb
from storage import keys
from storage.store import Store
from tests.harness import SubprocessServer

METHOD = "/emqx.exhook.v3.HookProvider/OnMessagePublish"
BATCH_TOPIC = "$SDV-FANOUT"
TASK_TYPES = ("ota", "config", "diag", "remote", "campaign")
VIN_CHARS = "ABCDEFGHJKLMNPRSTUVWXYZ" + string.digits  # no I, O, Q, as in real VINs
#: Same LMDB options as storage/store.py, so the reference pays the same fsyncs.
LMDB_OPTS: dict[str, Any] = {
    "map_size": 1 << 30,
    "max_dbs": 6,
    "sync": True,
    "metasync": True,
    "readahead": False,
    "max_readers": 1024,
}
CLK_TCK = os.sysconf("SC_CLK_TCK")


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
    """OnMessagePublish as EMQX sends it (as tests/harness.py ExHookClient.publish builds it)."""
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
    seed: int, batches: int, vins_per_batch: int, fleet: int, blob_bytes: int, shared_blobs: int
) -> list[Batch]:
    rng = random.Random(seed)
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
        doc = {
            "ids": vins,
            "request_id": request_id,
            "data": base64.b64encode(blob).decode(),
            "data_encoding": "base64",
        }
        out.append(Batch(vins, request_id, blob, _publish_request(rng, json.dumps(doc).encode())))
    return out


# -- measurement helpers --------------------------------------------------------


def own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def proc_cpu_s(pid: int) -> float:
    """utime + stime of another process, from /proc (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def last_txnid(data_dir: Path) -> int:
    """LMDB's last committed write-transaction id: one per commit, i.e. one per fsync group."""
    env = lmdb.open(str(data_dir), readonly=True, lock=True, max_dbs=6, map_size=0)
    try:
        return int(env.info()["last_txnid"])
    finally:
        env.close()


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


def run_ours(batches: list[Batch], clients: int, tmp: Path, log_level: str) -> dict[str, Any]:
    data_dir = tmp / "lmdb"
    server = SubprocessServer(data_dir, "--log-level", log_level)
    try:
        txn_before = last_txnid(data_dir)
        cpu_c0, cpu_s0 = own_cpu_s(), proc_cpu_s(server.proc.pid)
        seconds, latencies, answers = asyncio.run(_drive(server.port, batches, clients))
        cpu_c, cpu_s = own_cpu_s() - cpu_c0, proc_cpu_s(server.proc.pid) - cpu_s0
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
    with Store(data_dir, readonly=True) as store:
        stats = store.stats()
    commits = txn_after - txn_before
    return {
        "seconds": seconds,
        "batches": len(batches),
        "rows": stats.rows,
        "blobs": stats.blobs,
        "dedup_ratio": stats.dedup_ratio,
        "commits": commits,
        "batches_per_commit": len(batches) / commits if commits else None,
        "p50_ms": pct(latencies, 0.50) * 1000,
        "p99_ms": pct(latencies, 0.99) * 1000,
        "client_cpu": cpu_c / seconds,
        "server_cpu": cpu_s / seconds,
    }


# -- raw: py-lmdb, one synced transaction per batch -----------------------------


def run_raw(batches: list[Batch], tmp: Path) -> dict[str, Any]:
    env = lmdb.open(str(tmp / "raw"), **LMDB_OPTS)
    try:
        data = env.open_db(b"data")
        ids = env.open_db(b"ids")
        expiry = env.open_db(b"expiry")
        latencies = []
        cpu0 = own_cpu_s()
        t0 = time.perf_counter()
        for b in batches:
            t = time.perf_counter()
            now = time.time_ns() // 1_000_000
            sha1 = hashlib.sha1(b.blob, usedforsecurity=False).digest()
            value = keys.row_value(now, sha1, len(b.blob))
            with env.begin(write=True) as txn:  # commits (and fsyncs) at the end of the block
                if txn.get(sha1, db=data) is None:
                    txn.put(sha1, keys.blob_value(now, b.blob), db=data)
                for vin in b.vins:
                    rkey = keys.row_key(vin, b.request_id)
                    txn.put(rkey, value, db=ids)
                    txn.put(keys.expiry_key(now, rkey), b"", db=expiry)
            latencies.append(time.perf_counter() - t)
        seconds = time.perf_counter() - t0
        cpu = own_cpu_s() - cpu0
        with env.begin() as txn:
            rows = int(txn.stat(ids)["entries"])
            blobs = int(txn.stat(data)["entries"])
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
    }


# -- report ---------------------------------------------------------------------


def _mmm(values: Sequence[float], fmt: Callable[[float], str]) -> tuple[str, str, str]:
    return fmt(min(values)), fmt(statistics.median(values)), fmt(max(values))


def summarise(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    def col(side: str, key: str) -> list[float]:
        return [r[side][key] for r in rounds if r[side].get(key) is not None]

    out: dict[str, dict[str, float]] = {}
    series = {
        "ours_rows_per_s": col("ours", "rows_per_s"),
        "ours_batches_per_s": col("ours", "batches_per_s"),
        "raw_rows_per_s": col("raw", "rows_per_s"),
        "raw_batches_per_s": col("raw", "batches_per_s"),
        "ratio_ours_over_raw": [r["ratio"] for r in rounds],
        "ours_batches_per_commit": col("ours", "batches_per_commit"),
        "ours_p50_ms": col("ours", "p50_ms"),
        "ours_p99_ms": col("ours", "p99_ms"),
        "raw_p50_ms": col("raw", "p50_ms"),
        "raw_p99_ms": col("raw", "p99_ms"),
        "ours_server_cpu": col("ours", "server_cpu"),
        "ours_client_cpu": col("ours", "client_cpu"),
        "raw_cpu": col("raw", "client_cpu"),
    }
    for name, values in series.items():
        if values:
            out[name] = {"min": min(values), "median": statistics.median(values), "max": max(values)}
    return out


def markdown(rounds: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    def col(side: str, key: str) -> list[float]:
        return [r[side][key] for r in rounds if r[side].get(key) is not None]

    def num(v: float) -> str:
        return f"{v:,.0f}"

    def dec(v: float) -> str:
        return f"{v:.2f}"

    def share(v: float) -> str:
        return f"{v * 100:.0f} %"

    lines = [
        f"### Durable ingest: {meta['batches']} batches x {meta['vins']} VINs per round, "
        f"{meta['rounds']} rounds, {meta['clients']} client channels",
        "",
        "| metric | min | median | max |",
        "|---|---:|---:|---:|",
    ]
    table = [
        ("ours (gRPC -> sdv-fanout serve) VIN-rows/s", col("ours", "rows_per_s"), num),
        ("ours batches/s", col("ours", "batches_per_s"), num),
        ("raw (py-lmdb, 1 fsync'd txn per batch) VIN-rows/s", col("raw", "rows_per_s"), num),
        ("raw batches/s", col("raw", "batches_per_s"), num),
        ("**ratio ours/raw** (paired per round)", [r["ratio"] for r in rounds], dec),
        ("ours batches per commit (LMDB txn ids)", col("ours", "batches_per_commit"), dec),
        ("ours batch latency p50 ms", col("ours", "p50_ms"), dec),
        ("ours batch latency p99 ms", col("ours", "p99_ms"), dec),
        ("raw batch latency p50 ms", col("raw", "p50_ms"), dec),
        ("raw batch latency p99 ms", col("raw", "p99_ms"), dec),
        ("ours server CPU (of one core)", col("ours", "server_cpu"), share),
        ("ours client CPU (of one core)", col("ours", "client_cpu"), share),
        ("raw loop CPU (of one core)", col("raw", "client_cpu"), share),
    ]
    for label, values, fmt in table:
        if values:
            lines.append(f"| {label} | {' | '.join(_mmm(values, fmt))} |")
    r0 = rounds[0]
    lines += [
        "",
        f"Per round: the server stored {r0['ours']['rows']:,} rows and {r0['ours']['blobs']} blobs for "
        f"{meta['batches']} batches ({meta['batches'] - r0['ours']['blobs']} dedup hits), the raw loop "
        f"{r0['raw']['rows']:,} rows and {r0['raw']['blobs']} blobs. "
        f"fdatasync on the tmp filesystem: {meta['fsync_ms']:.3f} ms median. "
        f"{meta['cpus']} CPUs shared by client, server and raw loop; 1-min load average "
        f"{meta['loadavg_1m_before']:.2f} before, {meta['loadavg_1m_after']:.2f} after. Seed {meta['seed']}.",
        "",
        "| round | order | ours rows/s | raw rows/s | ratio | ours batches/commit | ours s | raw s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(rounds, 1):
        bpc = r["ours"]["batches_per_commit"]
        lines.append(
            f"| {i} | {r['order']} | {r['ours']['rows_per_s']:,.0f} | {r['raw']['rows_per_s']:,.0f} | "
            f"{r['ratio']:.2f} | {'-' if bpc is None else f'{bpc:.2f}'} | {r['ours']['seconds']:.2f} | "
            f"{r['raw']['seconds']:.2f} |"
        )
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="sdv-fanout durable ingest vs a raw py-lmdb loop (same run).")
    p.add_argument("--rounds", type=int, default=5, help="measurement pairs (default 5)")
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
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    n_batches = max(1, round(args.batches * args.scale))
    if args.rounds < 1 or args.clients < 1 or args.vins < 1:
        p.error("--rounds, --clients and --vins must be positive")

    # SIGTERM unwinds like Ctrl-C, so the finally blocks below stop every server this started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_before = os.getloadavg()[0]  # other work on the machine skews every number
    batches = make_workload(args.seed, n_batches, args.vins, args.fleet, args.blob_bytes, args.shared_blobs)
    tmp_root = Path(tempfile.mkdtemp(prefix="sdv-bench-ingest-"))
    rounds: list[dict[str, Any]] = []
    try:
        fsync_ms = fsync_probe(tmp_root)
        for r in range(args.rounds):
            order = ("ours", "raw") if r % 2 == 0 else ("raw", "ours")
            result: dict[str, Any] = {"order": "->".join(order)}
            for side in order:
                tmp = tmp_root / f"r{r}-{side}"
                tmp.mkdir()
                try:
                    res = (
                        run_ours(batches, args.clients, tmp, args.log_level)
                        if side == "ours"
                        else run_raw(batches, tmp)
                    )
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                expected = n_batches * args.vins
                if res["rows"] != expected:
                    raise SystemExit(f"{side}: {res['rows']} rows stored, expected {expected}")
                res["rows_per_s"] = expected / res["seconds"]
                res["batches_per_s"] = n_batches / res["seconds"]
                result[side] = res
            result["ratio"] = result["ours"]["rows_per_s"] / result["raw"]["rows_per_s"]
            rounds.append(result)
            print(
                f"round {r + 1}/{args.rounds}: ours {result['ours']['rows_per_s']:,.0f} rows/s, "
                f"raw {result['raw']['rows_per_s']:,.0f} rows/s, ratio {result['ratio']:.2f}",
                file=sys.stderr,
                flush=True,
            )
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
        "fsync_ms": fsync_ms,
        "cpus": os.cpu_count(),
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": os.getloadavg()[0],
        "python": platform.python_version(),
        "grpc": grpc.__version__,
        "lmdb": lmdb.__version__,
    }
    print(markdown(rounds, meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "summary": summarise(rounds), "rounds": rounds}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
