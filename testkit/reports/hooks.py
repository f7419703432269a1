"""bench/hooks.py's report: the summary of its rounds (min / median / max, paired ratios) and its markdown."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from testkit.plumbing import mmm

TARGETS = ("ours", "noop", "example")


def _row(label: str, values: Sequence[float], fmt: str) -> str:
    return (
        f"| {label} | "
        + " | ".join(format(v, fmt) for v in (min(values), statistics.median(values), max(values)))
        + " |"
    )


def summarise(rounds: list[dict[str, Any]], scale: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for t in TARGETS:
        for key in (
            "rpc_per_s",
            "server_cpu_us_per_rpc",
            "server_cpu",
            "client_cpu",
            "other_cpu",
            "p50_ms",
            "p99_ms",
            "drain_s",
        ):
            out[f"{t}_{key}"] = mmm([r["closed"][t][key] for r in rounds])
    out["ratio_ours_over_noop"] = mmm([r["ratio_ours_over_noop"] for r in rounds])
    out["ratio_ours_over_example"] = mmm([r["ratio_ours_over_example"] for r in rounds])
    half: dict[str, Any] = {"offered_rpc_per_s": mmm([r["half_rate"] for r in rounds])}
    for t in ("ours", "noop"):
        for key in ("achieved_rpc_per_s", "p50_ms", "p99_ms", "send_lag_p99_ms", "server_cpu_us_per_rpc", "other_cpu"):
            half[f"{t}_{key}"] = mmm([r["open"][t][key] for r in rounds])
    out["half_load"] = half
    if scale:
        levels = scale["levels"]
        lv: list[dict[str, Any]] = []
        for i, n in enumerate(levels):
            rs = [r[str(n)] for r in scale["rounds"]]
            lv.append(
                {
                    "vins": n,
                    "factor": n / levels[0],
                    "rpc_per_s": mmm([x["rpc_per_s"] for x in rs]),
                    "server_cpu_us_per_rpc": mmm([x["server_cpu_us_per_rpc"] for x in rs]),
                    "server_cpu_us_per_rpc_incl_drain": mmm([x["server_cpu_us_per_rpc_incl_drain"] for x in rs]),
                    "cost_ratio_vs_first": mmm([r["cost_ratio"][i] for r in scale["rounds"]]),
                    "rps_ratio_vs_first": mmm([r["rps_ratio"][i] for r in scale["rounds"]]),
                    "online_vehicles": scale["prefill"][str(n)]["online_vehicles"],
                    "rss_bytes": scale["prefill"][str(n)]["rss_bytes"],
                }
            )
        out["scale"] = lv
    return out


def markdown(rounds: list[dict[str, Any]], scale: dict[str, Any] | None, meta: dict[str, Any]) -> str:
    s = summarise(rounds, scale)
    names = {"ours": "ours", "noop": "no-op (aio)", "example": "EMQX example shape (sync, 10 threads)"}
    lines = [
        f"## Hook RPC path: heartbeat + ack, ours vs a no-op server vs the EMQX Python example shape "
        f"({meta['clients']} channels, {meta['vins']:,} VINs, {meta['ack_share']:.0%} acks, "
        f"{meta['rounds']} rounds)",
        "",
        f"Closed loop, one call in flight per channel, {meta['duration_s']:g} s measured after "
        f"{meta['warmup_s']:g} s of warm-up per server and round; server order alternating round by round.",
        "",
        "| metric | min | median | max |",
        "|---|---:|---:|---:|",
    ]
    for t in TARGETS:
        lines.append(_row(f"{names[t]} RPC/s", [r["closed"][t]["rpc_per_s"] for r in rounds], ",.0f"))
    lines.append(_row("**ratio ours / no-op** (paired)", [r["ratio_ours_over_noop"] for r in rounds], ".2f"))
    lines.append(_row("**ratio ours / EMQX example** (paired)", [r["ratio_ours_over_example"] for r in rounds], ".2f"))
    for t in TARGETS:
        lines.append(
            _row(f"{names[t]} server CPU µs/RPC", [r["closed"][t]["server_cpu_us_per_rpc"] for r in rounds], ".0f")
        )
    for t in TARGETS:
        lines.append(
            _row(f"{names[t]} server CPU (% of one core)", [100 * r["closed"][t]["server_cpu"] for r in rounds], ".0f")
        )
    for t in TARGETS:
        lines.append(_row(f"{names[t]} p99 ms (closed loop)", [r["closed"][t]["p99_ms"] for r in rounds], ".2f"))
    lines.append(
        _row(
            "ours: work left behind the answers (s until idle)", [r["closed"]["ours"]["drain_s"] for r in rounds], ".2f"
        )
    )
    lines.append(
        _row(
            "ours server CPU µs/RPC incl. that work",
            [r["closed"]["ours"]["server_cpu_us_per_rpc_incl_drain"] for r in rounds],
            ".0f",
        )
    )
    lines.append(
        _row("client CPU (% of one core), ours runs", [100 * r["closed"]["ours"]["client_cpu"] for r in rounds], ".0f")
    )
    lines.append(
        _row(
            "**other processes' CPU** (% of one core; should be ~0)",
            [100 * r["closed"][t]["other_cpu"] for r in rounds for t in TARGETS],
            ".0f",
        )
    )
    lines += [
        "",
        "### Latency at half load (open loop, Poisson arrivals at half of ours' closed-loop RPC/s of the round)",
        "",
        "| metric | min | median | max |",
        "|---|---:|---:|---:|",
        _row("offered RPC/s", [r["half_rate"] for r in rounds], ",.0f"),
    ]
    for t in ("ours", "noop"):
        o = [r["open"][t] for r in rounds]
        lines += [
            _row(f"{names[t]} achieved RPC/s", [x["achieved_rpc_per_s"] for x in o], ",.0f"),
            _row(f"{names[t]} p50 ms", [x["p50_ms"] for x in o], ".3f"),
            _row(f"**{names[t]} p99 ms**" if t == "ours" else f"{names[t]} p99 ms", [x["p99_ms"] for x in o], ".3f"),
            _row(f"{names[t]} server CPU µs/RPC", [x["server_cpu_us_per_rpc"] for x in o], ".0f"),
            _row(f"load generator send lag p99 ms, {t} runs", [x["send_lag_p99_ms"] for x in o], ".3f"),
            _row(f"other processes' CPU (% of one core), {t} runs", [100 * x["other_cpu"] for x in o], ".0f"),
        ]
    bad = sum(r["open"][t]["skipped"] + sum(r["open"][t]["errors"].values()) for r in rounds for t in ("ours", "noop"))
    lines += [
        "",
        "| round | order | ours RPC/s | no-op RPC/s | example RPC/s | ours/no-op | ours/example | half-load rate "
        "| ours p99 ms | no-op p99 ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(rounds, 1):
        c = r["closed"]
        lines.append(
            f"| {i} | {r['order']} | {c['ours']['rpc_per_s']:,.0f} | {c['noop']['rpc_per_s']:,.0f} "
            f"| {c['example']['rpc_per_s']:,.0f} | {r['ratio_ours_over_noop']:.2f} "
            f"| {r['ratio_ours_over_example']:.2f} "
            f"| {r['half_rate']:,.0f} | {r['open']['ours']['p99_ms']:.3f} | {r['open']['noop']['p99_ms']:.3f} |"
        )
    if scale:
        first = scale["levels"][0]
        lines += [
            "",
            f"### Scale: ours with more distinct VINs ({scale['rounds_n']} rounds, {scale['duration_s']:g} s each, "
            "order alternating; presence prefilled with one heartbeat per VIN)",
            "",
            f"| VINs | work | RPC/s (min / median / max) | server CPU µs/RPC (median) "
            f"| **cost ratio vs {first:,} VINs** (CPU/RPC, min / median / max) | RPC/s ratio (median) "
            "| online VINs | server RSS MiB |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for lv in s["scale"]:
            r, c, rr = lv["rpc_per_s"], lv["cost_ratio_vs_first"], lv["rps_ratio_vs_first"]
            lines.append(
                f"| {lv['vins']:,} | {lv['factor']:g}x | {r['min']:,.0f} / {r['median']:,.0f} / {r['max']:,.0f} "
                f"| {lv['server_cpu_us_per_rpc']['median']:.0f} | {c['min']:.2f} / {c['median']:.2f} / {c['max']:.2f} "
                f"| {rr['median']:.2f} | {lv['online_vehicles']:,} | {lv['rss_bytes'] / 2**20:.0f} |"
            )
        pre = ", ".join(f"{int(n):,} in {p['s']:.1f} s ({p['rpc_per_s']:,.0f}/s)" for n, p in scale["prefill"].items())
        others = [100 * r[str(n)]["other_cpu"] for r in scale["rounds"] for n in scale["levels"]]
        lines += [
            "",
            f"Prefill (heartbeats, 8 in flight per channel): {pre}. Other processes' CPU during the scale "
            f"measurements: {min(others):.0f} / {statistics.median(others):.0f} / {max(others):.0f} % of one core "
            "(min / median / max).",
        ]
    procs = meta["processes"]
    setting = f"SDV_FANOUT_PROCESSES={procs}" if procs is not None else "processes setting left at its default"
    acked = meta.get("ack_rows") or {}
    if acked:
        cycled = acked["calls_issued_to_ours"] > acked["calls_before_repeating"]
        lines += [
            "",
            f"Acks are real: the prefill stored {acked['rows_stored']:,} rows with the acked payload and the "
            f"acks deleted {acked['rows_deleted_by_acks']:,} of them (each delete a group-committed write)"
            + (", but the calls cycled: later acks repeated earlier ones." if cycled else "; no ack repeated."),
        ]
    lines += [
        "",
        f"Ours: `sdv-fanout serve`, delivery and metrics off, {setting} ({meta['ours_processes']} server "
        "process(es)); its CPU counts the ready-file pid and its children. No-op: testkit/noop_server.py --flavour "
        f"aio. EMQX example shape: testkit/noop_server.py --flavour sync. Ack payload {meta['payload_bytes']} B. "
        f"{meta['cpus']} CPUs shared by the load generator and the servers (one loaded at a time); 1-min load "
        f"average {meta['loadavg_1m_before']:.2f} before, {meta['loadavg_1m_after']:.2f} after; "
        f"{meta['wall_s']:.0f} s in all. Python {meta['python']}, grpcio {meta['grpc']}. Seed {meta['seed']}."
        + (f" **{bad} open-loop calls skipped or failed.**" if bad else ""),
    ]
    return "\n".join(lines)


def group_markdown(group: dict[str, Any]) -> str:
    s, n = group["summary"], group["processes"]

    def row(label: str, key: str, scale: float = 1.0, fmt: str = ",.0f") -> str:
        v = s[key]
        return f"| {label} | " + " | ".join(format(v[k] * scale, fmt) for k in ("min", "median", "max")) + " |"

    return "\n".join(
        [
            "",
            f"### One server process vs {n} (one per CPU), same load, {len(group['rounds'])} paired rounds",
            "",
            "| metric | min | median | max |",
            "|---|---:|---:|---:|",
            row("1 process RPC/s", "one_rpc_per_s"),
            row(f"{n} processes RPC/s", "group_rpc_per_s"),
            row(f"**ratio {n} processes / 1** (paired)", "ratio_group_over_one", fmt=".2f"),
            row(
                f"capacity with {n} cores to itself, {n} processes / 1 (estimate: {n} x 1-process CPU/RPC "
                f"over {n}-process CPU/RPC)",
                "capacity_estimate_group_over_one",
                fmt=".2f",
            ),
            row("1 process: server CPU (% of one core)", "one_server_cpu", 100),
            row(f"{n} processes: server CPU (% of one core)", "group_server_cpu", 100),
            row("1 process: server CPU µs/RPC", "one_server_cpu_us_per_rpc"),
            row(f"{n} processes: server CPU µs/RPC", "group_server_cpu_us_per_rpc"),
            row("load generator CPU (% of one core), 1-process runs", "one_client_cpu", 100),
            row(f"load generator CPU (% of one core), {n}-process runs", "group_client_cpu", 100),
            "",
            f"The load generator shares the {n} CPUs with the server, so the group can use at most what the "
            "generator leaves over; the server CPU rows show how much each side got.",
        ]
    )
