"""What the status topic costs: ingest and end to end with status on vs off, paired, and disk per outcome.

    .venv/bin/python -m bench.status_cost [--before 7fd2d64] [--rounds 6] [--json F]

How it measures and what each flag does: bench/README.md (`bench/status_cost.py`).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import ingest
from storage.lmdb import batches
from storage.lmdb.store import Store, now_ms
from testkit.batchload import make_workload
from testkit.emqx_sim import Mosquitto
from testkit.plumbing import (
    Run,
    conditions,
    make_vins,
    mmm,
    order,
    quiesce,
    unpack_tree,
)
from testkit.reports.status_cost import (
    ACKS_PER_COMMIT,
    BATCH_VINS,
    E2E_SIDES,
    OFF,
    REQUESTS_PER_VIN,
    disk_markdown,
    e2e_markdown,
    ingest_markdown,
)
from testkit.rig import MAX_PER_PROC, Rig, add_rig_options, run_ours
from testkit.status_listener import StatusListener, since

# -- 1. ingest ------------------------------------------------------------------------------------


def run_ingest(args: argparse.Namespace, tmp: Path, say: Callable[[str], None]) -> dict[str, Any]:
    batches = make_workload(
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
                before = listener.settled_counts()
                res = ingest.measure("ours", batches, tmp / f"r{r}-{side}", args, envs[side])
                res["status"] = since(listener.settled_counts(), before)
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
    summary = {k: mmm([r[k] for r in rounds]) for k in keys if k in rounds[0]}
    for side in envs:
        for key in ("rows_per_s", "server_cpu_us_per_row", "p50_ms", "p99_ms", "batches_per_commit", "other_cpu"):
            summary[f"{side}_{key}"] = mmm([r[side][key] for r in rounds])
    return {"sides": list(envs), "batches": len(batches), "rounds": rounds, "summary": summary}


# -- 2. end to end --------------------------------------------------------------------------------


def run_end_to_end(args: argparse.Namespace, tmp: Path, say: Callable[[str], None]) -> dict[str, Any]:
    vins = make_vins(args.seed, args.vehicles)
    rigs: dict[str, Rig] = {}
    listeners: dict[str, StatusListener] = {}
    rounds: list[dict[str, Any]] = []
    warm_args = copy.copy(args)
    warm_args.batches = 2
    try:
        for side, env in E2E_SIDES.items():
            (tmp / side).mkdir()
            rig = rigs[side] = Rig(args, tmp / side, vins, env)
            rig.start_server()
            rig.start_sims()
            listeners[side] = StatusListener(rig.broker.port, side, tmp)
            rig.args = warm_args  # run_ours reads the batch count from the rig's args
            run_ours(rig, "warm", args.payload_bytes, args.seed)
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
                res = run_ours(rigs[side], f"r{r}", args.payload_bytes, seed)
                res["status"] = since(listeners[side].settled_counts(quiet_s=0.3, timeout_s=5), before)
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
            totals[side] = dict(listener.settled_counts(quiet_s=0.5, timeout_s=5))
    finally:
        for listener in listeners.values():
            listener.stop()
        for rig in rigs.values():
            rig.close()
    summary = {
        k: mmm([r[k] for r in rounds])
        for k in ("on_over_off", "per_vehicle_over_off", "cpu_on_over_off", "cpu_per_vehicle_over_off")
    }
    for side in E2E_SIDES:
        summary[f"{side}_msgs_per_s"] = mmm([r[side]["msgs_per_s"] for r in rounds])
        for group in ("server", "mosquitto", "sim fleet", "bench", "total", "other processes"):
            summary[f"{side}_{group}_us_per_msg"] = mmm([r[side]["cpu_us_per_msg"][group] for r in rounds])
    expected = {"batches": gens, "deliveries": gens * args.vehicles}
    return {"rounds": rounds, "summary": summary, "status_totals": totals, "expected": expected}


# -- 3. disk per outcome --------------------------------------------------------------------------

#: The tables an outcome writes: its record, its time index entry, its generation's counts.
OUTCOME_TABLES = ("outcomes", "outcome_expiry", "gens")


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


# -- main -----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6, help="paired rounds of ingest and of e2e (default 6: every order)")
    p.add_argument("--before", metavar="REV", help="also ingest with the server of this git revision (e.g. 7fd2d64)")
    p.add_argument("--ingest-batches", type=int, default=2400,
                   help="batches per ingest side, enough to span a 5 s progress look (default 2400)")  # fmt: skip
    ingest.add_ingest_options(p)  # --clients, --vins, --fleet, --blob-bytes
    p.add_argument("--campaigns", type=int, default=0,
                   help="ingest K campaigns taking turns (a request id and payload each, new VINs) instead of "
                   "a request id per batch: batches extend generations already counted (default 0)")  # fmt: skip
    p.add_argument("--batches", type=int, default=20,
                   help="e2e batches per measurement, each naming every vehicle (default 20: ~10 s)")  # fmt: skip
    p.add_argument("--disk-n", default="10000,100000", help="outcomes per disk measurement (default 10000,100000)")
    p.add_argument("--only", default="ingest,e2e,disk", help="parts to run (default ingest,e2e,disk)")
    add_rig_options(p, vehicles=500, procs=2, deadline_s=180, seed=20261123)
    args = p.parse_args(argv)
    parts = {x.strip() for x in args.only.split(",") if x.strip()}
    if parts - {"ingest", "e2e", "disk"} or min(args.rounds, args.ingest_batches, args.vehicles, args.batches) < 1:
        p.error("--only takes ingest, e2e, disk; --rounds, --ingest-batches, --vehicles, --batches must be positive")
    args.procs = max(args.procs, -(-args.vehicles // MAX_PER_PROC))
    args.max_inflight = 50  # bench/e2e.py's Rig reads it (raw publisher, not started here)

    ctx = Run("status")
    tmp_root, say = ctx.tmp, ctx.say

    out: dict[str, Any] = {}
    with ctx.keeping(args.keep_tmp):
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
        **ctx.meta(),
    }  # fmt: skip
    parts_md = []
    if "ingest" in out:
        parts_md.append(ingest_markdown(out["ingest"], meta))
    if "e2e" in out:
        parts_md.append(e2e_markdown(out["e2e"], meta))
    if out.get("disk"):
        parts_md.append(disk_markdown(out["disk"]))
    parts_md.append(conditions(meta))
    print("\n\n".join(parts_md))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, **out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
