"""Cross-process forwarding vs store claims on LMDB, side by side, paired rounds.

    .venv/bin/python -m bench.lmdb_claims [--rounds 5 --duration 1.5 --vins 10000 --rows-per-vin 4

How it measures and what each flag does: bench/README.md (`bench/lmdb_claims.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import shutil
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import lmdb

from storage.lmdb import batches, keys
from storage.lmdb.keys import Row
from storage.lmdb.store import Store
from testkit.plumbing import Child, machine_busy_s, machine_meta, make_vins, proc_cpu_s
from testkit.reports.lmdb_claims import report

NODE = "emqx@10.0.0.7"
#: The marker: sha1, sent-at (ms), attempts, flags, process index, session address (IPv4 + port),
#: session node id; then the request id. 42 B + a 14-18 B request id.
_MARK = struct.Struct(">20sQHBB6sI")
MARKS_MAP_BYTES = 256 << 20


def request_id(r: int) -> str:
    return f"task_ota_{(r * 7919) % 1_000_000:06d}"


def marker(row: Row, process: int) -> bytes:
    return (
        _MARK.pack(row.sha1, time.time_ns() // 1_000_000, 1, row.flags, process, b"\x0a\x00\x00\x07\x75\x30", 7)
        + row.request_id.encode()
    )


def open_marks(path: Path) -> lmdb.Environment:
    """The in-flight markers: soft state, so no fsync of data or meta page."""
    return lmdb.open(str(path), map_size=MARKS_MAP_BYTES, sync=False, metasync=False, readahead=False, max_readers=126)


# -- helper: forwarding over the real Peers -----------------------------------------------------


def forward_helper(args: argparse.Namespace) -> int:
    import structlog

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    from exhook_server.backends.lmdb.peers import Group, Peers
    from exhook_server.backends.lmdb.pool import Dispatcher
    from exhook_server.dispatch.commands import Session

    index = args.fwd_index
    group = Group(index, 2, args.fwd_key, 0)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        state = {"confirmed": 0, "received": 0}
        credit = asyncio.Event()
        ended: asyncio.Future[int] | None = None
        peers: Peers

        def on_item(item: Any) -> None:
            nonlocal ended
            if index == 1:  # the owner: count, confirm every 256, answer the end marker
                if type(item) is tuple:  # the end of a phase: how many came, then start again
                    peers.send(0, ("end_ack", state["received"]))
                    state["received"] = 0
                    return
                state["received"] += 1
                if not state["received"] & 255:
                    peers.send(0, ("credit", state["received"]))
                return
            kind, count = item
            state["confirmed"] = max(state["confirmed"], count)
            credit.set()
            if kind == "end_ack" and ended is not None and not ended.done():
                ended.set_result(count)

        peers = Peers(group, on_item, lambda q: None)
        await peers.start()
        # Process 0 routes like a server process: a Dispatcher over both processes' workers, whose
        # forward is this Peers. Only VINs process 1 owns are used, so every event crosses.
        dispatcher = Dispatcher(
            cast(Any, None),  # no rows, no publisher: every VIN is owned elsewhere, nothing runs here
            cast(Any, None),
            workers=2,
            inflight_timeout_s=30,
            vin_from_clientid=lambda c: len(c) == 17,
            process=index,
            processes=2,
            forward=peers.send,
        )
        vins = [v for v in make_vins(args.seed, 8000) if dispatcher.worker_of(v) is None][:4096]
        sessions = [Session(NODE, v, f"10.{i >> 8 & 255}.{i & 255}.9", 40000 + i % 20000) for i, v in enumerate(vins)]
        digests = [bytes([i & 255]) * 20 for i in range(len(vins))]
        rids = [request_id(i) for i in range(len(vins))]
        hb, acked = dispatcher.heartbeat, dispatcher.acked

        def event(i: int) -> None:
            j = i % len(vins)
            if i & 1:
                hb(sessions[j], vins[j])
            else:
                acked(sessions[j], vins[j], rids[j], digests[j])

        def no_event(i: int) -> None:
            j = i % len(vins)
            if i & 1:
                (sessions[j], vins[j])
            else:
                (sessions[j], vins[j], rids[j], digests[j])

        async def drive(fn: Callable[[int], None], burst: int, until: float, turns: int, window: int) -> int:
            """`burst` calls of fn per loop turn until `until` (monotonic) or for `turns` turns."""
            i = 0
            t = 0
            now = time.monotonic
            while (turns and t < turns) or (not turns and now() < until):
                if window and i - state["confirmed"] > window:
                    credit.clear()
                    await credit.wait()
                    continue
                for _ in range(burst):
                    fn(i)
                    i += 1
                t += 1
                await asyncio.sleep(0)
            return i

        # Commands on stdin, read by the loop itself (no reader thread in the measured process).
        stdin = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
        while True:
            line = await stdin.readline()
            if not line:
                break
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                break
            if cmd["cmd"] != "forward":
                continue
            burst, window = cmd["burst"], cmd["window"]
            state["confirmed"] = 0
            ended = loop.create_future()
            cpu0, t0 = time.process_time(), time.perf_counter()
            sent = await drive(event, burst, time.monotonic() + cmd["duration"], 0, window)
            peers.send(1, ("end", sent))
            got = await asyncio.wait_for(ended, 60)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            # The driver loop alone, same turns, no dispatcher call: what is not forwarding.
            b0 = time.process_time()
            await drive(no_event, burst, 0, max(1, sent // burst), 0)
            base = time.process_time() - b0
            print(
                json.dumps(
                    {
                        "events": sent,
                        "received": got,
                        "wall_s": wall,
                        "cpu_s": cpu,
                        "base_cpu_s": base,
                    }
                ),
                flush=True,
            )
        await peers.stop(linger_s=0.5)

    asyncio.run(run())
    return 0


# -- helper: claims and the read fast path -------------------------------------------------------


def store_helper(args: argparse.Namespace) -> int:
    store = Store(args.store)
    marks = open_marks(Path(args.marks))
    all_vins = make_vins(args.seed, args.vins)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        vins = all_vins[cmd["part"] :: cmd["parts"]]
        vkeys = [v.encode() for v in vins]
        delay = cmd["start_at"] - time.time()
        if delay > 0:
            time.sleep(delay)
        fn = {"claims": claim_loop, "reads": read_loop, "oldest": oldest_loop}[cmd["cmd"]]
        print(json.dumps(fn(store, marks, vins, vkeys, cmd["duration"], cmd["part"])), flush=True)
    marks.close()
    store.close()
    return 0


def claim_loop(
    store: Store, marks: lmdb.Environment, vins: list[str], vkeys: list[bytes], duration: float, part: int
) -> dict[str, Any]:
    clock, tclock = time.perf_counter, time.thread_time
    n = claimed = released = sampled = 0
    wait = held = held_cpu = 0.0
    mark_bytes = 0
    i, size = 0, len(vins)
    cpu0, t0 = time.process_time(), clock()
    end = t0 + duration
    while n & 31 or clock() < end:
        vin, k = vins[i], vkeys[i]
        i = i + 1 if i + 1 < size else 0
        sample = not n & 7  # every 8th cycle: also the CPU spent holding the lock
        a = clock()
        txn = marks.begin(write=True)
        b = clock()
        tb = tclock() if sample else 0.0
        row = None
        if txn.get(k) is None:
            found, _ = store.oldest(vin)
            if found is not None:
                row = found[0]
                value = marker(row, part)
                mark_bytes += len(value)
                txn.put(k, value)
                claimed += 1
        txn.commit()
        tc = tclock() if sample else 0.0
        c = clock()
        # The ack: clear the marker if it names the row it acknowledges.
        txn = marks.begin(write=True)
        d = clock()
        td = tclock() if sample else 0.0
        current = txn.get(k)
        if row is not None and current is not None and current[:20] == row.sha1:
            txn.delete(k)
            released += 1
        txn.commit()
        if sample:
            held_cpu += tclock() - td + tc - tb
            sampled += 1
        e = clock()
        wait += (b - a) + (d - c)
        held += (c - b) + (e - d)
        n += 1
    wall, cpu = clock() - t0, time.process_time() - cpu0
    return {
        "cycles": n,
        "claimed": claimed,
        "released": released,
        "wall_s": wall,
        "cpu_s": cpu,
        "lock_wait_s": wait,
        "lock_held_s": held,
        "lock_held_cpu_s": held_cpu / max(1, sampled) * n,
        "mark_bytes": mark_bytes / max(1, claimed),
    }


def read_loop(
    store: Store, marks: lmdb.Environment, vins: list[str], vkeys: list[bytes], duration: float, part: int
) -> dict[str, Any]:
    clock = time.perf_counter
    n = want = 0
    i, size = 0, len(vins)
    prefixes = [keys.vin_prefix(v) for v in vins]
    ids = store.tables.ids
    cpu0, t0 = time.process_time(), clock()
    end = t0 + duration
    while n & 63 or clock() < end:
        prefix, k = prefixes[i], vkeys[i]
        i = i + 1 if i + 1 < size else 0
        # Anything pending: one seek to the vehicle's first row in `ids` (no count needed).
        with store.read() as txn:
            cur = txn.cursor(ids)
            pending = cur.set_range(prefix) and cur.key()[: len(prefix)] == prefix
        with marks.begin(buffers=True) as txn:
            free = txn.get(k) is None
        if pending and free:
            want += 1  # a claim would follow
        n += 1
    wall, cpu = clock() - t0, time.process_time() - cpu0
    return {"reads": n, "want_claim": want, "wall_s": wall, "cpu_s": cpu}


def oldest_loop(
    store: Store, marks: lmdb.Environment, vins: list[str], vkeys: list[bytes], duration: float, part: int
) -> dict[str, Any]:
    """The reference: the row read alone (what today's owner does per delivery, outside any lock)."""
    clock = time.perf_counter
    n = found = 0
    i, size = 0, len(vins)
    oldest = store.oldest
    cpu0, t0 = time.process_time(), clock()
    end = t0 + duration
    while n & 63 or clock() < end:
        vin = vins[i]
        i = i + 1 if i + 1 < size else 0
        if oldest(vin)[0] is not None:
            found += 1
        n += 1
    wall, cpu = clock() - t0, time.process_time() - cpu0
    return {"reads": n, "want_claim": found, "wall_s": wall, "cpu_s": cpu}


# -- the run -------------------------------------------------------------------------------------


def build_store(path: Path, vins: list[str], rows_per_vin: int, blob_bytes: int) -> None:
    with Store(path) as store:
        t0 = 1_700_000_000_000
        for r in range(rows_per_vin):
            blob = bytes([r & 255]) * blob_bytes
            for k in range(0, len(vins), 200):  # 200-VIN batches, as the platform sends them
                with store.write() as txn:
                    batches.store_batch(txn, store.tables, vins[k : k + 200], request_id(r), blob, t0 + r * 1000 + k)


class Rig:
    """The helper processes: f0 sends, f1 owns (forwarding); s0.. run claims and reads."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.children: list[Child] = []
        me = [sys.executable, "-m", "bench.lmdb_claims"]
        key = f"bench-{os.getpid()}-{random.Random().getrandbits(32):08x}"
        common = ["--seed", str(args.seed), "--vins", str(args.vins)]
        self.fwd = [
            self._spawn(f"fwd{i}", [*me, "--role", "forward", "--fwd-index", str(i), "--fwd-key", key, *common])
            for i in (0, 1)
        ]
        paths = ["--store", str(tmp / "store"), "--marks", str(tmp / "marks")]
        self.st = [self._spawn(f"store{i}", [*me, "--role", "store", *paths, *common]) for i in range(max(args.procs))]

    def _spawn(self, name: str, argv: list[str]) -> Child:
        child = Child(name, argv, self.tmp / f"{name}.log")
        self.children.append(child)
        return child

    def pids(self) -> list[int]:
        return [os.getpid(), *(c.proc.pid for c in self.children)]

    def stop(self) -> None:
        for c in self.children:  # the sender first: its link closes, the owner's stop is quick
            with contextlib.suppress(Exception):
                c.stop()


def measured(rig: Rig, body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one phase; add the CPU of processes that are not this bench's, as a share of one core."""
    pids = rig.pids()
    c0, m0, t0 = sum(map(proc_cpu_s, pids)), machine_busy_s(), time.monotonic()
    out = body()
    wall = time.monotonic() - t0
    ours = sum(map(proc_cpu_s, pids)) - c0
    out["other_cpu"] = max(0.0, (machine_busy_s() - m0 - ours) / wall)
    return out


def phase_forward(rig: Rig, burst: int, duration: float) -> dict[str, Any]:
    sender, owner = rig.fwd

    def body() -> dict[str, Any]:
        r0 = proc_cpu_s(owner.proc.pid)
        sender.send({"cmd": "forward", "burst": burst, "duration": duration, "window": rig.args.window})
        res = sender.recv(120)
        res["owner_cpu_s"] = proc_cpu_s(owner.proc.pid) - r0
        return res

    res = measured(rig, body)
    if res["received"] != res["events"]:
        raise RuntimeError(f"forwarding lost events: {res['received']} of {res['events']}")
    ev = res["events"]
    return {
        "events_s": ev / res["wall_s"],
        "send_us": res["cpu_s"] / ev * 1e6,
        "send_net_us": (res["cpu_s"] - res["base_cpu_s"]) / ev * 1e6,
        "recv_us": res["owner_cpu_s"] / ev * 1e6,
        "both_net_us": (res["cpu_s"] - res["base_cpu_s"] + res["owner_cpu_s"]) / ev * 1e6,
        "other_cpu": res["other_cpu"],
    }


def phase_store(rig: Rig, kind: str, procs: int, duration: float) -> dict[str, Any]:
    def body() -> dict[str, Any]:
        start_at = time.time() + 0.15
        for p in range(procs):
            rig.st[p].send({"cmd": kind, "part": p, "parts": procs, "duration": duration, "start_at": start_at})
        return {"parts": [rig.st[p].recv(60 + duration) for p in range(procs)]}

    res = measured(rig, body)
    parts = res["parts"]
    unit = "cycles" if kind == "claims" else "reads"
    n = sum(p[unit] for p in parts)
    out = {
        "rate": sum(p[unit] / p["wall_s"] for p in parts),
        "per_proc": [p[unit] / p["wall_s"] for p in parts],
        "cpu_us": sum(p["cpu_s"] for p in parts) / n * 1e6,
        "other_cpu": res["other_cpu"],
    }
    if kind == "claims":
        if any(p["claimed"] != p["cycles"] or p["released"] != p["cycles"] for p in parts):
            raise RuntimeError(f"a claim or release did not happen: {parts}")
        out["wait_us"] = sum(p["lock_wait_s"] for p in parts) / n * 1e6
        out["held_us"] = sum(p["lock_held_s"] for p in parts) / n * 1e6
        out["held_cpu_us"] = sum(p["lock_held_cpu_s"] for p in parts) / n * 1e6
        # How much of the lock's time the claims used, counting only CPU spent holding it.
        out["lock_use"] = out["rate"] * out["held_cpu_us"] / 1e6
        out["mark_bytes"] = statistics.mean(p["mark_bytes"] for p in parts)
    else:
        if any(p["want_claim"] != p["reads"] for p in parts):
            raise RuntimeError(f"{kind}: every VIN should have a row pending (and no marker)")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="paired rounds (default 5)")
    p.add_argument("--duration", type=float, default=1.5, help="seconds per phase (default 1.5)")
    p.add_argument("--vins", type=int, default=10_000, help="VINs in the store (default 10,000)")
    p.add_argument("--rows-per-vin", type=int, default=4, help="pending rows per VIN (default 4)")
    p.add_argument("--blob-bytes", type=int, default=1024, help="payload size (default 1024)")
    p.add_argument("--bursts", default="1,8", help="forwarded events per loop turn, comma-separated (default 1,8)")
    p.add_argument("--window", type=int, default=8192, help="forwarded events not yet confirmed, at most")
    p.add_argument("--procs", default="1,2", help="process counts for claims and reads (default 1,2)")
    p.add_argument("--seed", type=int, default=20261201)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    p.add_argument("--role", choices=("forward", "store"), help=argparse.SUPPRESS)
    p.add_argument("--fwd-index", type=int, help=argparse.SUPPRESS)
    p.add_argument("--fwd-key", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--marks", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "forward":
        return forward_helper(args)
    if args.role == "store":
        return store_helper(args)
    args.bursts = [int(x) for x in args.bursts.split(",")]
    args.procs = sorted({1, *(int(x) for x in args.procs.split(","))})

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    load_before = os.getloadavg()[0]
    wall0 = time.monotonic()
    say(f"1-min load average before: {load_before:.2f}")
    tmp = Path(tempfile.mkdtemp(prefix="sdv-bench-claims-"))
    rig: Rig | None = None
    ok = False
    try:
        vins = make_vins(args.seed, args.vins)
        build_store(tmp / "store", vins, args.rows_per_vin, args.blob_bytes)
        open_marks(tmp / "marks").close()
        say(f"store built: {len(vins) * args.rows_per_vin:,} rows ({time.monotonic() - wall0:.1f} s)")
        rig = Rig(args, tmp)
        phases: list[tuple[str, Callable[[float], dict[str, Any]]]] = []
        for b in args.bursts:
            phases.append((f"fwd{b}", functools.partial(phase_forward, rig, b)))
        phases.append(("oldest1", functools.partial(phase_store, rig, "oldest", 1)))
        for kind in ("claims", "reads"):
            for n in args.procs:
                phases.append((f"{kind}{n}", functools.partial(phase_store, rig, kind, n)))
        for _, fn in phases:  # warm-up: links up, pages cached, not recorded
            fn(min(0.3, args.duration))
        rounds = []
        for r in range(args.rounds):
            order = phases if r % 2 == 0 else phases[::-1]
            res = {}
            for name, fn in order:
                res[name] = fn(args.duration)
                shown = {k: round(v, 2) for k, v in res[name].items() if k != "per_proc"}
                say(f"round {r + 1}: {name} {json.dumps(shown)}")
            rounds.append(res)
        meta = machine_meta(load_before, wall0)
        say(f"1-min load average after: {meta['loadavg_1m_after']:.2f}")
        print(report(args, rounds, meta), end="")
        if args.json:
            Path(args.json).write_text(json.dumps({"meta": meta, "rounds": rounds}, indent=1))
        ok = True
    finally:
        if rig is not None:
            rig.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
