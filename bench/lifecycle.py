"""Request lifecycle costs, paired: the expiry index on ingest, and response mode end to end.

    .venv/bin/python -m bench.lifecycle [--rounds 6] [--ingest-batches 1200] [--vehicles 500] [--requests 8] [--json F]

How it measures and what each flag does: bench/README.md (`bench/lifecycle.py`).
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import ingest
from exhook_server._proto import exhook_v3_pb2 as pb
from storage.lmdb.store import now_ms
from testkit.batchload import Batch, _publish_request, make_workload
from testkit.emqx_sim import Mosquitto
from testkit.plumbing import (
    CpuMeter,
    Run,
    alternate,
    conditions,
    cycle_stats,
    make_vins,
    mmm,
    order,
    quiesce,
)
from testkit.reports.lifecycle import EXPIRING, INGEST_SIDES, MODES, e2e_markdown, ingest_markdown
from testkit.rig import MAX_PER_PROC, Rig, add_rig_options, rpc_error
from testkit.status_listener import StatusListener, since

EXPIRES_AHEAD_MS = 3_600_000  # an hour: nothing expires during the run


# -- 1. ingest ------------------------------------------------------------------------------------


def ingest_workloads(args: argparse.Namespace) -> dict[str, list[Batch]]:
    """bench/ingest.py's seed batches (VINs, request ids, blobs), serialised once per side, all
    here the same way, so the sides differ only in `expires_at`."""
    base = make_workload(args.seed, args.ingest_batches, args.vins, args.fleet, args.blob_bytes, 4)
    expires_at = now_ms() + EXPIRES_AHEAD_MS
    out: dict[str, list[Batch]] = {}
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
            wire = _publish_request(rng, json.dumps(doc).encode())
            batches.append(Batch(b.vins, b.request_id, b.blob, wire))
        out[side] = batches
    return out


def measure_ingest(batches: list[Batch], tmp: Path, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """bench/ingest.py's measurement of a fresh server on `batches`, with every table of its store."""
    res = ingest.measure("ours", batches, tmp, args, env)
    disk = res.pop("disk")
    tables = {name: {"entries": disk["entries"][name], "pages": pages} for name, pages in disk["pages"].items()}
    res["lmdb"] = {"page_bytes": disk["page_bytes"], "file_used_bytes": disk["file_used_bytes"], "tables": tables}
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


# -- 2. end to end: measurement -----------------------------------------------------------------


def run_mode(rig: Rig, platform: StatusListener, mode: str, tag: str, requests: int, seed: int) -> dict[str, Any]:
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
            raise RuntimeError(f"batch {rid} not stored: {resp or rpc_error(rig)}")
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
        "status": since(
            platform.settle(quiet_s=0.3, timeout_s=5)["events"].get(mode, {}), before["events"].get(mode, {})
        ),
        "cpu": cpu,
        "cpu_us_per_request": {g: v * seconds / (n * requests) * 1e6 for g, v in cpu.items()},
    }


def run_end_to_end(args: argparse.Namespace, tmp: Path, say: Callable[[str], None]) -> dict[str, Any]:
    vins = make_vins(args.seed, args.vehicles)
    rig = Rig(args, tmp, vins)
    rig.sim_args = ["--response-bytes", str(args.response_bytes)]
    platform: StatusListener | None = None
    rounds: list[dict[str, Any]] = []
    try:
        rig.start_server()
        rig.start_sims()
        platform = StatusListener(rig.broker.port, "lifecycle", tmp)
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


# -- main -----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6, help="paired rounds of ingest and of e2e (default 6)")
    p.add_argument("--ingest-batches", type=int, default=1200, help="batches per ingest side (default 1200)")
    ingest.add_ingest_options(p)  # --clients, --vins, --fleet, --blob-bytes
    p.add_argument("--requests", type=int, default=8,
                   help="e2e requests M per vehicle and measurement: M batches naming all (default 8)")  # fmt: skip
    p.add_argument("--response-bytes", type=int, default=64, help="each vehicle's answer size (default 64)")
    p.add_argument("--only", default="ingest,e2e", help="parts to run (default ingest,e2e)")
    add_rig_options(p, vehicles=500, procs=2, deadline_s=120, seed=20261124)
    args = p.parse_args(argv)
    parts = {x.strip() for x in args.only.split(",") if x.strip()}
    if (
        parts - {"ingest", "e2e"}
        or not parts
        or min(args.rounds, args.ingest_batches, args.vehicles, args.requests) < 1
    ):
        p.error("--only takes ingest, e2e; --rounds, --ingest-batches, --vehicles, --requests must be positive")
    args.procs = max(args.procs, -(-args.vehicles // MAX_PER_PROC))
    args.max_inflight = 50  # bench/e2e.py's Rig reads it (raw publisher, not started here)

    ctx = Run("lifecycle")
    tmp_root, say, load_before = ctx.tmp, ctx.say, ctx.load_before

    say(f"1-min load average before: {load_before:.2f}")
    out: dict[str, Any] = {}
    with ctx.keeping(args.keep_tmp):
        if "ingest" in parts:
            (tmp_root / "ingest").mkdir()
            out["ingest"] = run_ingest(args, tmp_root / "ingest", say)
        if "e2e" in parts:
            (tmp_root / "e2e").mkdir()
            out["e2e"] = run_end_to_end(args, tmp_root / "e2e", say)

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
        **ctx.meta(),
    }  # fmt: skip
    say(f"1-min load average after: {meta['loadavg_1m_after']:.2f}")
    parts_md = []
    if "ingest" in out:
        parts_md.append(ingest_markdown(out["ingest"], meta))
    if "e2e" in out:
        parts_md.append(e2e_markdown(out["e2e"], meta))
    parts_md.append(conditions(meta))
    print("\n\n".join(parts_md))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, **out}, indent=2))
    problems = out.get("e2e", {}).get("problems", [])
    for problem in problems:
        print(f"not as specified: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
