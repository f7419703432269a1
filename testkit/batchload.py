"""Ingest load for the benches: seed-format batches (200 VINs, 1 KiB blobs, half of them shared so
dedup kicks in) serialised once as OnMessagePublish calls, a closed-loop gRPC driver over C
channels (a batch counts once answered, i.e. fsynced), `serve_batches` (a fresh `sdv-fanout serve`
fed them, with CPU and disk), and the LMDB disk-usage and fsync probes."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import lmdb

from exhook_server._proto import exhook_v3_pb2 as pb
from storage.lmdb import keys
from testkit.harness import SubprocessServer
from testkit.plumbing import VIN_CHARS, descendants, group_cpu_s, machine_busy_s, own_cpu_s, pct

METHOD = "/emqx.exhook.v3.HookProvider/OnMessagePublish"


BATCH_TOPIC = "$SDV-FANOUT"


TASK_TYPES = ("ota", "config", "diag", "remote", "campaign")


#: Same LMDB options as storage/lmdb/store.py, so the reference pays the same fsyncs.
LMDB_OPTS: dict[str, Any] = {
    "map_size": 1 << 30,
    "max_dbs": 7,
    "sync": True,
    "metasync": True,
    "readahead": False,
    "max_readers": 1024,
}


#: More than the named databases of any storage/lmdb/store.py schema, for opening one read-only.
MAX_DBS = 64


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


def last_txnid(data_dir: Path) -> int:
    """LMDB's last committed write-transaction id: one per commit, i.e. one per fsync group."""
    env = lmdb.open(str(data_dir), readonly=True, lock=True, max_dbs=MAX_DBS, map_size=0)
    try:
        return int(env.info()["last_txnid"])
    finally:
        env.close()


def disk_usage(data_dir: Path) -> dict[str, Any]:
    """What the rows and blobs cost on disk, from LMDB's own page counts (read-only, after the run).

    bytes_per_row: pages of `ids` + `expiry` over rows (branch, leaf, overflow);
    blob_overhead_bytes: pages of `data` + `touched` less the payload bytes, over blobs;
    file_used_bytes: (last_pgno + 1) x page size, i.e. with free pages, meta pages and every table;
    pages and entries of every named database, ours or not (an older tree's store has fewer).
    """
    env = lmdb.open(str(data_dir), readonly=True, lock=True, max_dbs=MAX_DBS, map_size=0)
    try:
        psize = int(env.stat()["psize"])
        used = (int(env.info()["last_pgno"]) + 1) * psize
        pages: dict[str, int] = {}
        entries: dict[str, int] = {}
        payload = 0
        with env.begin(buffers=True) as txn:
            tables = sorted(bytes(k).decode() for k in txn.cursor().iternext(values=False))
            for name in tables:
                try:
                    db = env.open_db(name.encode(), txn=txn, create=False)
                except lmdb.Error:
                    continue  # a plain key of the main table, not a named database
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
        "entries": entries,
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


def serve_batches(
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
