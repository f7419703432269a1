"""bench/lmdb_claims.py's report: the summary of its rounds (min / median / max, paired ratios) and its markdown."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import lmdb

from testkit.plumbing import dec, num


def med3(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    return f"{fmt(min(values))} | {fmt(statistics.median(values))} | {fmt(max(values))}"


def report(args: argparse.Namespace, rounds: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"#### Forwarding over Peers vs LMDB claims (bench/lmdb_claims.py), {len(rounds)} paired rounds",
        "",
        "| metric | min | median | max |",
        "|---|---:|---:|---:|",
    ]

    def row(label: str, values: Sequence[float], fmt: Callable[[float], str] = num) -> None:
        lines.append(f"| {label} | {med3(values, fmt)} |")

    for b in args.bursts:
        f = [r[f"fwd{b}"] for r in rounds]
        tag = f"(a) forward, {b} event(s) per loop turn"
        row(f"{tag}: **events/s** one process hands to another", [x["events_s"] for x in f])
        row(f"{tag}: sender CPU µs/event (driver loop included)", [x["send_us"] for x in f], dec)
        row(f"{tag}: sender CPU µs/event, net of the driver loop", [x["send_net_us"] for x in f], dec)
        row(f"{tag}: owner (receiver) CPU µs/event", [x["recv_us"] for x in f], dec)
        row(f"{tag}: **sender net + owner CPU µs/event**", [x["both_net_us"] for x in f], dec)
    one = [r["claims1"] for r in rounds]
    row("(b) claim+release, 1 process: **cycles/s**", [x["rate"] for x in one])
    row("(b) 1 process: CPU µs/cycle (2 write txns)", [x["cpu_us"] for x in one], dec)
    row(
        "(b) reference, 1 process: CPU µs of Store.oldest alone (the row read today's owner also does, lock-free)",
        [r["oldest1"]["cpu_us"] for r in rounds],
        dec,
    )
    row(
        "(b) 1 process: claim cycle CPU µs net of that row read (paired)",
        [r["claims1"]["cpu_us"] - r["oldest1"]["cpu_us"] for r in rounds],
        dec,
    )
    row("(b) 1 process: CPU µs/cycle spent holding the writer lock", [x["held_cpu_us"] for x in one], dec)
    row("(b) 1 process: writer lock held, wall µs/cycle", [x["held_us"] for x in one], dec)
    for p in args.procs:
        if p == 1:
            continue
        many = [r[f"claims{p}"] for r in rounds]
        row(f"(b) {p} processes at once: **cycles/s, all together**", [x["rate"] for x in many])
        row(f"(b) {p} processes: cycles/s per process", [statistics.mean(x["per_proc"]) for x in many])
        row(f"(b) **ratio {p} processes / 1** (paired)", paired(many, one), dec)
        row(f"(b) {p} processes: CPU µs/cycle", [x["cpu_us"] for x in many], dec)
        row(f"(b) {p} processes: waiting for the writer lock µs/cycle", [x["wait_us"] for x in many], dec)
        row(f"(b) {p} processes: CPU µs/cycle spent holding the writer lock", [x["held_cpu_us"] for x in many], dec)
        row(f"(b) {p} processes: writer lock held, wall µs/cycle", [x["held_us"] for x in many], dec)
        row(f"(b) {p} processes: writer lock in use, % (CPU held x cycles/s)", [x["lock_use"] * 100 for x in many])
    row(
        "(b) **writer-lock ceiling**, any number of processes: cycles/s (1e6 / CPU µs held per cycle, 1 process)",
        [1e6 / x["held_cpu_us"] for x in one],
    )
    rone = [r["reads1"] for r in rounds]
    row("(c) heartbeat fast path, 1 process: **reads/s**", [x["rate"] for x in rone])
    row("(c) 1 process: CPU µs/read (2 read txns)", [x["cpu_us"] for x in rone], dec)
    for p in args.procs:
        if p == 1:
            continue
        many = [r[f"reads{p}"] for r in rounds]
        row(f"(c) {p} processes at once: **reads/s, all together**", [x["rate"] for x in many])
        row(f"(c) **ratio {p} processes / 1** (paired)", paired(many, rone), dec)
        row(f"(c) {p} processes: CPU µs/read", [x["cpu_us"] for x in many], dec)
    others = [ph["other_cpu"] * 100 for r in rounds for ph in r.values() if isinstance(ph, dict)]
    row("**other processes' CPU** during the phases (% of one core; should be ~0)", others)
    mark = statistics.mean(r["claims1"]["mark_bytes"] for r in rounds)
    lines += [
        "",
        f"Store: {args.vins:,} VINs x {args.rows_per_vin} rows (storage/lmdb/batches.py store_batch, 200-VIN batches, "
        f"{args.blob_bytes} B payloads), the claim reads the oldest row and its payload (Store.oldest); marker "
        f"env sync=False, metasync=False, markers {mark:.0f} B under the 17-char VIN. Forwarding: window "
        f"{args.window} unconfirmed events, an even mix of heartbeat ClientEvents and Acknowledges through "
        f"Dispatcher.heartbeat/acked into Peers. {args.duration} s per phase, phase order reversed every other "
        f"round. {meta['cpus']} CPUs shared with everything else on the machine; 1-min load average "
        f"{meta['loadavg_1m_before']:.2f} before, {meta['loadavg_1m_after']:.2f} after; {meta['wall_s']:.0f} s "
        f"in all. Python {meta['python']}, py-lmdb {lmdb.__version__} (LMDB {'.'.join(map(str, lmdb.version()))}). "
        f"Seed {args.seed}.",
    ]
    return "\n".join(lines) + "\n"


def paired(many: Sequence[dict[str, Any]], one: Sequence[dict[str, Any]]) -> list[float]:
    """Rate with several processes over rate with one, round by round."""
    return [m["rate"] / o["rate"] for m, o in zip(many, one, strict=True)]
