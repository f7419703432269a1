"""End to end through a real EMQX: sdv-fanout's deliveries/s next to the broker's own QoS 1 with one
message in flight per vehicle, same fleet, same broker, same run; EMQX 5.8.9 (ExHook v2) and 5.9.1 (v3).

    .venv/bin/python -m bench.e2e_emqx [--versions 5.8.9,5.9.1] [--vehicles 500] [--requests 5] [--rounds 3]

How it measures and what each flag does: bench/README.md (`bench/e2e_emqx.py`).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import paho.mqtt
import structlog

from testkit.emqx_real import find_release
from testkit.emqx_rig import (
    EXHOOK,
    RULE_BATCH,
    RULE_EXHOOK,
    Rig,
    batch,
    result,
)
from testkit.plumbing import (
    Run,
    arm_fleets,
    collect_fleets,
    make_vins,
)
from testkit.reports.e2e_emqx import LABELS, OURS, SIDES, markdown, summarise
from testkit.rig import MAX_PER_PROC, add_rig_options

# -- measurements ---------------------------------------------------------------------------------


def run_ours(rig: Rig, side: str, tag: str, seed: int, requests: int | None = None) -> dict[str, Any]:
    """One measurement of a server: "ours" (hook acks) or "ours_rule" (rule acks, rule enabled meanwhile)."""
    assert rig.platform is not None
    rule = side == "ours_rule"
    exhook, topic = (RULE_EXHOOK, RULE_BATCH) if rule else (EXHOOK, "$SDV-FANOUT")
    k = requests or rig.args.requests
    rng = random.Random(seed)
    payloads = [batch(rig.vins, f"task_{tag}_{i}", rng.randbytes(rig.args.payload_bytes)) for i in range(k)]
    if rule:
        rig.set_rule(True)
    try:
        arm_fleets(rig.fleets, k, rig.args.deadline_s)
        hooks0 = rig.exhook_counts(exhook)
        meter = rig.meter(side)
        t0 = rig.platform.publish_all(topic, payloads, rig.args.deadline_s)
        done = collect_fleets(rig.fleets, len(rig.vins) * k, rig.args.deadline_s)
        out = result(t0, done, meter)
        rig.settle()
    finally:
        if rule:
            rig.set_rule(False)
    hooks1 = rig.exhook_counts(exhook)  # once idle: EMQX counts a call when it is answered
    out["hook_calls"] = hooks1["succeed"] - hooks0["succeed"]
    out["hook_failures"] = hooks1["failed"] - hooks0["failed"]
    return out


def run_raw(rig: Rig, loop: bool, tag: str, seed: int, requests: int | None = None) -> dict[str, Any]:
    assert rig.pub is not None
    k = requests or rig.args.requests
    arm_fleets(rig.fleets, k, rig.args.deadline_s, signal=loop)
    meter = rig.meter("raw")
    rids = [f"task_{tag}_{i}" for i in range(k)]
    rig.pub.send({"cmd": "run", "mode": "b" if loop else "a", "rids": rids, "payload_bytes": rig.args.payload_bytes,
                  "seed": seed, "deadline_s": rig.args.deadline_s})  # fmt: skip
    res = rig.pub.recv(rig.args.deadline_s + 30)["done"]
    if not res["ok"]:
        raise RuntimeError(f"raw publisher did not finish: {res}")
    done = collect_fleets(rig.fleets, len(rig.vins) * k, rig.args.deadline_s)
    out = result(res["first"], done, meter)
    rig.settle()
    return out


def cost(side: dict[str, Any]) -> float:
    """CPU µs per delivery of every process of the rig (not the rest of the machine)."""
    return float(side["cpu_us_per_delivery"]["total"])


def measure(rig: Rig, side: str, tag: str, seed: int, requests: int | None = None) -> dict[str, Any]:
    if side in OURS:
        return run_ours(rig, side, tag, seed, requests)
    return run_raw(rig, side == "raw_loop", tag, seed, requests)


def run_version(
    version: str, args: argparse.Namespace, tmp: Path, vins: list[str], say: Callable[[str], None]
) -> dict[str, Any]:
    rig = Rig(version, args, tmp, vins)
    rounds: list[dict[str, Any]] = []
    profile = ""
    try:
        rig.start(say)
        for side in SIDES:
            measure(rig, side, f"warm{side[-1]}", args.seed, requests=1)
        for r in range(args.rounds):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            res: dict[str, Any] = {"order": " → ".join(order)}
            for i, side in enumerate(order):
                res[side] = measure(rig, side, f"r{r}{side[-1]}", args.seed + 100 * r + i)
            for ours, key in (("ours", ""), ("ours_rule", "rule_")):
                res[f"ratio_{key}paced"] = res[ours]["deliveries_per_s"] / res["raw_paced"]["deliveries_per_s"]
                res[f"ratio_{key}loop"] = res[ours]["deliveries_per_s"] / res["raw_loop"]["deliveries_per_s"]
                # All the bench's processes' CPU per delivery, raw over ours: what the ratio would be
                # on a machine they saturate alone (the rest of the machine's load moves it little).
                res[f"cost_ratio_{key}paced"] = cost(res["raw_paced"]) / cost(res[ours])
            rounds.append(res)
            rates = ", ".join(f"{LABELS[side]} {res[side]['deliveries_per_s']:,.0f}/s" for side in SIDES)
            say(
                f"EMQX {version} round {r + 1}/{args.rounds}: {rates}; over raw paced: hook "
                f"{res['ratio_paced']:.2f}, rule {res['ratio_rule_paced']:.2f}"
            )
        if args.profile:
            profile = "\n\n".join(
                run_profile(rig, side, Path(f"{args.profile}.{version}.{side}.txt"), say) for side in OURS
            )
        assert rig.broker is not None
        protocol = rig.broker.protocol
        processes = max(1, len(rig.server_pids["ours"]) - 1)  # a parent with children only runs several
    finally:
        rig.close()
    return {"version": version, "protocol": protocol, "server_processes": processes, "rounds": rounds,
            "summary": summarise(rounds), "profile": profile}  # fmt: skip


def run_profile(rig: Rig, side: str, out: Path, say: Callable[[str], None]) -> str:
    """py-spy on one server (all its processes) during one more run of its side, 4 x --requests."""
    from testkit.hookload import top_functions

    server = rig.servers[side]
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        raise SystemExit("py-spy is not installed: .venv/bin/pip install py-spy")
    cmd = [str(spy), "record", "--rate", "200", "--format", "raw", "--subprocesses", "-o", str(out)]
    # --native pauses the server for each sample (slower, but shows where grpc's C core spends);
    # otherwise read the stacks without pausing it, and native time counts for its Python caller.
    cmd.append("--native" if rig.args.profile_native else "--nonblocking")
    spy_proc = subprocess.Popen([*cmd, "--pid", str(server.proc.pid)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)  # fmt: skip
    try:
        time.sleep(1.0)  # py-spy attaches
        res = run_ours(rig, side, f"prof{side[-1]}", rig.args.seed + 99, requests=4 * rig.args.requests)
    finally:
        spy_proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        try:
            spy_proc.wait(60)
        except subprocess.TimeoutExpired:
            spy_proc.kill()
            spy_proc.wait(10)
    if not out.exists():
        err = spy_proc.stderr.read().decode(errors="replace") if spy_proc.stderr else ""
        raise SystemExit(f"py-spy wrote nothing:\n{err}")
    say(f"profiled {side}: {res['deliveries_per_s']:,.0f} deliveries/s under py-spy: {out}")
    label = LABELS[side]
    return f"{label}: {res['deliveries_per_s']:,.0f} deliveries/s while sampled. " + top_functions(out.read_text(), 15)


# -- main -----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--versions", default="5.8.9,5.9.1", help="EMQX versions, one after the other (default both)")
    p.add_argument("--requests", type=int, default=5, help="requests per vehicle per measurement (default 5)")
    p.add_argument("--rounds", type=int, default=3, help="paired rounds per version (default 3)")
    p.add_argument("--max-inflight", type=int, default=50, help="raw publisher window (server default: 50)")
    # One server process: the fastest on 2 shared cores.
    add_rig_options(p, vehicles=500, procs=2, deadline_s=120, seed=20240611, server_processes=1)
    p.add_argument("--profile", metavar="PATH", help="also py-spy the server in one more ours run (PATH.<version>.txt)")
    p.add_argument("--profile-native", action="store_true", help="--profile with native frames (py-spy --native)")
    args = p.parse_args(argv)
    if min(args.vehicles, args.requests, args.rounds, args.procs) < 1:
        p.error("--vehicles, --requests, --rounds and --procs must be positive")
    versions = [v.strip() for v in args.versions.split(",") if v.strip()]
    missing = [v for v in versions if find_release(v) is None]
    if missing:
        p.error(f"no EMQX release for {', '.join(missing)} (see /work/shared/emqx/README.md)")

    ctx = Run("e2e-emqx")
    tmp_root, say = ctx.tmp, ctx.say
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # the launcher's log lines
    vins = make_vins(args.seed, args.vehicles)

    results = []
    with ctx.keeping(args.keep_tmp, "EMQX, server and fleet logs, LMDB"):
        for version in versions:
            (tmp_root / version).mkdir()
            results.append(run_version(version, args, tmp_root / version, vins, say))
    meta = {
        "versions": versions,
        "vehicles": args.vehicles,
        "requests": args.requests,
        "rounds": args.rounds,
        "procs": max(args.procs, -(-args.vehicles // MAX_PER_PROC)),
        "payload_bytes": args.payload_bytes,
        "max_inflight": args.max_inflight,
        "seed": args.seed,
        "log_level": args.log_level,
        **ctx.meta(),
        "paho": paho.mqtt.__version__,
    }
    print(markdown(results, meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "versions": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
