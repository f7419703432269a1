"""Campaign pacing: achieved against set rate, and what an active policy costs end to end.

    .venv/bin/python -m bench.pacing [--seconds 10] [--rates 60,600,6000] [--rounds 3] [--vehicles 300] [--batches 6]

`rate`: the pacing engine under endless demand, real clock: one process (its buckets in memory)
and three instances leasing from one real PostgreSQL (`pacing_buckets`), each ticking as a server
does; starts per minute after the first token against `max_per_minute`. `cost`: bench/e2e.py's
rig (mosquitto, `sdv-fanout serve` on LMDB, sim fleet processes), rounds alternating a run whose
requests carry a policy that never binds (10^9 per minute, 10^9 in flight) with one without.
How to read it and what a full run needs: bench/README.md (`bench/pacing.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RID = "task_paced_bench"
#: A policy that paces every request of a run and never binds.
OPEN_POLICY = {"max_per_minute": 1_000_000_000, "max_in_flight": 1_000_000_000}


async def _greedy(pacers: list[Any], seconds: float, tick_s: float) -> tuple[int, float]:
    """Every pacer ticks as a server does and starts all it may: the starts together, and the
    seconds from the first start to the last."""
    times: list[float] = []
    end = time.monotonic() + seconds

    async def one(pacer: Any) -> None:
        while time.monotonic() < end:
            await pacer.tick()
            while RID not in pacer.blocked():
                pacer.started(RID)
                times.append(time.monotonic())
            await asyncio.sleep(tick_s)

    await asyncio.gather(*(one(p) for p in pacers))
    return len(times), (max(times) - min(times)) if times else 0.0


async def rate_local(per_minute: int, seconds: float) -> tuple[int, float]:
    from exhook_server.dispatch.pacing import TICK_S, LocalBudget, Pacer
    from exhook_server.policy import Policy
    from storage.model import now_ms

    pacer = Pacer(LocalBudget(lambda: now_ms() / 1000))
    pacer.set(RID, Policy(max_per_minute=per_minute), now_ms())
    return await _greedy([pacer], seconds, TICK_S)


async def rate_pg(dsn: str, per_minute: int, seconds: float, instances: int) -> tuple[int, float]:
    import asyncpg

    from exhook_server.backends.postgres.backend import PgBudget
    from exhook_server.dispatch.pacing import TICK_S, Pacer
    from exhook_server.policy import Policy
    from storage.model import now_ms
    from storage.postgres import migrate

    conn = await asyncpg.connect(dsn)
    try:
        await migrate.migrate(conn)
        await conn.execute("DELETE FROM pacing_buckets")
    finally:
        await conn.close()
    pools = [await asyncpg.create_pool(dsn, min_size=1, max_size=2) for _ in range(instances)]
    try:
        pacers = [Pacer(PgBudget(lambda p=p: p, now_ms)) for p in pools]  # type: ignore[misc]
        set_ms = now_ms()
        for p in pacers:
            p.set(RID, Policy(max_per_minute=per_minute), set_ms)
        return await _greedy(pacers, seconds, TICK_S)
    finally:
        for pool in pools:
            await pool.close()


def rate_part(args: argparse.Namespace) -> list[dict[str, Any]]:
    from testkit.pg_cluster import PgCluster

    rows = []
    with PgCluster.create(name="pacing") as cluster:
        for per_minute in args.rates:
            for setup in ("1 process", "3 instances (PostgreSQL)"):
                if setup == "1 process":
                    started, span = asyncio.run(rate_local(per_minute, args.seconds))
                else:
                    dsn = cluster.new_database(f"pacing_{per_minute}")
                    started, span = asyncio.run(rate_pg(dsn, per_minute, args.seconds, 3))
                # From the first start (the bucket's first token) to the last: the rate between.
                achieved = (started - 1) / span * 60 if span else 0.0
                rows.append({"set": per_minute, "setup": setup, "starts": started, "achieved": achieved})
                print(f"{setup}: set {per_minute}/min, achieved {achieved:,.1f}/min", file=sys.stderr)
    return rows


def cost_part(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    from exhook_server.cpus import usable_cpus
    from testkit.harness import poll
    from testkit.plumbing import make_vins
    from testkit.rig import Rig, run_ours

    rig_args = argparse.Namespace(
        vehicles=args.vehicles,
        batches=args.batches,
        procs=2,
        deadline_s=180.0,
        log_level="info",
        server_processes=0,
        max_inflight=50,
        store_url="",
    )
    rig = Rig(rig_args, tmp, make_vins(args.seed, args.vehicles))
    rounds: list[dict[str, Any]] = []
    try:
        rig.start_server()
        rig.start_sims()
        assert rig.emqx is not None and rig.server is not None
        server = rig.server

        # The open policy on every request of every "on" run, set before the warm-up: their
        # buckets are full and every process follows them long before a run starts.
        tags = [f"on{r}" for r in range(args.rounds)]
        for tag in tags:
            for k in range(args.batches):
                doc = {"request_id": f"task_{tag}_{k}", **OPEN_POLICY}
                rig.emqx.publish("$SDV-FANOUT/policy", json.dumps(doc).encode())
        want = len(tags) * args.batches * usable_cpus()  # serve's default: a process per CPU
        poll(lambda: sum(1 for e in server.events() if e.get("event") == "campaign_paced") >= want, timeout_s=30)
        run_ours(rig, "warm", 256, args.seed)  # warm-up, not recorded
        for r in range(args.rounds):
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            result: dict[str, Any] = {"order": "->".join(order)}
            for side in order:
                tag = f"{side}{r}"
                result[side] = run_ours(rig, tag, 256, args.seed + r)["msgs_per_s"]
            result["ratio"] = result["on"] / result["off"]
            rounds.append(result)
            print(f"round {r + 1}: on {result['on']:,.0f}/s off {result['off']:,.0f}/s ratio {result['ratio']:.3f}",
                  file=sys.stderr)  # fmt: skip
    finally:
        rig.close()
    return rounds


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=10.0, help="measuring window per rate (a full run: 60)")
    p.add_argument("--rates", type=lambda s: [int(x) for x in s.split(",")], default=[60, 600, 6000])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--vehicles", type=int, default=300)
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--seed", type=int, default=20261128)
    p.add_argument("--only", choices=("rate", "cost"))
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    import structlog

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout is the report
    from testkit.plumbing import machine_meta
    from testkit.reports.pacing import markdown

    load_before, wall0 = os.getloadavg()[0], time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="sdv-bench-pacing-"))
    try:
        rates = rate_part(args) if args.only != "cost" else []
        cost = cost_part(args, tmp) if args.only != "rate" else []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    meta = {**machine_meta(load_before, wall0), "seconds": args.seconds, "vehicles": args.vehicles,
            "batches": args.batches}  # fmt: skip
    result = {"meta": meta, "rates": rates, "cost": cost}
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
