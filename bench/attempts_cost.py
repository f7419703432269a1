"""What keeping delivery attempts in LMDB costs end to end: this checkout against an older commit, same run.

    .venv/bin/python -m bench.attempts_cost [--base 2d572fd] [--rounds 7] [--vehicles 500] [--batches 10]

How it measures and what each flag does: bench/README.md (`bench/attempts_cost.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def serve_rig(args: argparse.Namespace) -> int:
    """Child: one rig of the tree it runs in (PYTHONPATH); runs `run_ours` on each {"cmd": "run"}."""
    try:
        from testkit.plumbing import make_vins
        from testkit.rig import Rig, run_ours
    except ImportError:  # an older tree: its rig lived in bench/e2e.py
        from bench.e2e import Rig, make_vins, run_ours  # type: ignore[no-redef]
    rig_args = argparse.Namespace(
        vehicles=args.vehicles,
        batches=args.batches,
        procs=args.procs,
        deadline_s=180.0,
        log_level="info",  # the rig waits for the mqtt_connected line
        server_processes=0,
        max_inflight=50,
        store_url="",
    )
    vins = make_vins(args.seed, args.vehicles)
    rig = Rig(rig_args, Path(args.tmp), vins)
    try:
        rig.start_server()
        rig.start_sims()
        print(json.dumps({"ready": len(vins)}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                break
            out = run_ours(rig, cmd["tag"], args.payload_bytes, cmd["seed"])
            print(
                json.dumps({"msgs_per_s": out["msgs_per_s"], "server_us": out["cpu_us_per_msg"]["server"]}), flush=True
            )
    finally:
        rig.close()
    return 0


def cells(s: dict[str, float]) -> str:
    return f"{s['min']:,.2f} | {s['median']:,.2f} | {s['max']:,.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="2d572fd", help="git revision to compare with (default: the commit "
                   "before attempts were kept, 2d572fd)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--vehicles", type=int, default=500)
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--procs", type=int, default=2, help="sim fleet processes per rig")
    p.add_argument("--payload-bytes", type=int, default=256)
    p.add_argument("--seed", type=int, default=20261128)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--serve-rig", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_rig:
        return serve_rig(args)
    from testkit.plumbing import Child, machine_meta, mmm, unpack_tree

    load_before, wall0 = os.getloadavg()[0], time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="sdv-bench-attempts-"))
    base = unpack_tree(args.base, tmp / "base-tree", ("exhook_server", "storage", "tests", "bench"))
    builds = {"this": ROOT, "base": base}
    rigs: dict[str, Child] = {}
    rounds: list[dict[str, Any]] = []
    try:
        for name, tree in builds.items():
            (tmp / name).mkdir()
            script = tree / "bench" / "attempts_cost.py"
            if tree != ROOT:
                shutil.copy(__file__, script)  # the same driver, importing that tree
            argv_ = [sys.executable, str(script), "--serve-rig", "--tmp", str(tmp / name)]
            argv_ += ["--vehicles", str(args.vehicles), "--batches", str(args.batches), "--procs", str(args.procs)]
            argv_ += ["--payload-bytes", str(args.payload_bytes), "--seed", str(args.seed)]
            os.environ["PYTHONPATH"] = str(tree)  # the child and its server import that checkout
            rigs[name] = Child(name, argv_, tmp / f"{name}.log")
            rigs[name].recv(300)  # {"ready": n}
        os.environ.pop("PYTHONPATH", None)
        for rig in rigs.values():  # warm-up, not recorded
            rig.send({"cmd": "run", "tag": "warm", "seed": args.seed})
            rig.recv(300)
        for r in range(args.rounds):
            order = ("this", "base") if r % 2 == 0 else ("base", "this")
            result: dict[str, Any] = {"order": "->".join(order)}
            for name in order:
                rigs[name].send({"cmd": "run", "tag": f"r{r}", "seed": args.seed + r})
                result[name] = rigs[name].recv(300)
            result["ratio"] = result["this"]["msgs_per_s"] / result["base"]["msgs_per_s"]
            rounds.append(result)
            print(
                f"round {r + 1}: this {result['this']['msgs_per_s']:,.0f}/s, "
                f"base {result['base']['msgs_per_s']:,.0f}/s, ratio {result['ratio']:.3f}",
                file=sys.stderr,
            )
    finally:
        for rig in rigs.values():
            rig.stop()
    meta = {**machine_meta(load_before, wall0), "base": args.base, "vehicles": args.vehicles, "batches": args.batches}
    summary = {
        "this_msgs_per_s": mmm([x["this"]["msgs_per_s"] for x in rounds]),
        "base_msgs_per_s": mmm([x["base"]["msgs_per_s"] for x in rounds]),
        "ratio": mmm([x["ratio"] for x in rounds]),
        "this_server_us": mmm([x["this"]["server_us"] for x in rounds]),
        "base_server_us": mmm([x["base"]["server_us"] for x in rounds]),
        "cpu_ratio": mmm([x["this"]["server_us"] / x["base"]["server_us"] for x in rounds]),
    }
    n = args.vehicles * args.batches
    print(f"### Attempts kept in LMDB: {args.vehicles} vehicles x {args.batches} batches = {n:,} deliveries "
          f"per run, {args.rounds} rounds, this checkout vs {args.base}\n")  # fmt: skip
    print(f"{meta['cpus']} CPUs; load average (1 min) {meta['loadavg_1m_before']:.2f} before, "
          f"{meta['loadavg_1m_after']:.2f} after.\n")  # fmt: skip
    print("| metric | min | median | max |\n|---|---:|---:|---:|")
    print(f"| this: deliveries/s | {cells(summary['this_msgs_per_s'])} |")
    print(f"| {args.base}: deliveries/s | {cells(summary['base_msgs_per_s'])} |")
    print(f"| **ratio this / {args.base}** (paired per round) | {cells(summary['ratio'])} |")
    print(f"| this: server CPU µs per delivery | {cells(summary['this_server_us'])} |")
    print(f"| {args.base}: server CPU µs per delivery | {cells(summary['base_server_us'])} |")
    print(f"| server CPU per delivery, this / {args.base} (paired) | {cells(summary['cpu_ratio'])} |\n")
    print("| round | order | this /s | base /s | ratio |\n|---:|---|---:|---:|---:|")
    for i, x in enumerate(rounds, 1):
        print(f"| {i} | {x['order']} | {x['this']['msgs_per_s']:,.0f} | {x['base']['msgs_per_s']:,.0f} | "
              f"{x['ratio']:.2f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rounds": rounds, "summary": summary}, indent=2))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
