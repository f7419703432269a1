"""bench/e2e.py's report: the summary of its rounds (min / median / max, paired ratios) and its markdown."""

from __future__ import annotations

import statistics
from typing import Any

from testkit.plumbing import (
    dec,
    mib,
    num,
    share,
)
from testkit.plumbing import min_med_max as _mmm


def summarise(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    series: dict[str, list[float]] = {
        "ours_msgs_per_s": [r["ours"]["msgs_per_s"] for r in rounds],
        "raw_a_msgs_per_s": [r["raw_a"]["msgs_per_s"] for r in rounds],
        "raw_b_msgs_per_s": [r["raw_b"]["msgs_per_s"] for r in rounds],
        "ratio_ours_over_raw_a": [r["ratio_a"] for r in rounds],
        "ratio_ours_over_raw_b": [r["ratio_b"] for r in rounds],
    }
    return {k: {"min": min(v), "median": statistics.median(v), "max": max(v)} for k, v in series.items()}


def markdown(rounds: list[dict[str, Any]], lat: dict[str, Any], rss: dict[str, Any], meta: dict[str, Any]) -> str:
    n, b = meta["vehicles"], meta["batches"]
    if meta.get("store_url"):
        commits = "PostgreSQL write transactions/s (xids assigned)"
    else:
        commits = "LMDB commits/s (group commits, 1 fsync each)"

    def col(side: str, key: str) -> list[float]:
        return [r[side][key] for r in rounds]

    def cpu(side: str, group: str) -> list[float]:
        return [r[side]["cpu"].get(group, 0.0) for r in rounds]

    lines = [
        f"### End to end: {n:,} vehicles x {b} batches = {n * b:,} QoS 1 deliveries per measurement, "
        f"{meta['rounds']} rounds",
        "",
        "| metric | min | median | max |",
        "|---|---:|---:|---:|",
        f"| ours (batch → LMDB → MQTT → PUBACK → acked hook → row deleted) msgs/s | {_mmm(col('ours', 'msgs_per_s'), num)} |",  # noqa: E501
        f"| raw (a) paho QoS 1, unconstrained, msgs/s | {_mmm(col('raw_a', 'msgs_per_s'), num)} |",
        f"| raw (b) paho QoS 1, one in flight per subscriber, msgs/s | {_mmm(col('raw_b', 'msgs_per_s'), num)} |",
        f"| **ratio ours/raw (a)** (paired per round) | {_mmm([r['ratio_a'] for r in rounds], dec)} |",
        f"| **ratio ours/raw (b)** (paired per round) | {_mmm([r['ratio_b'] for r in rounds], dec)} |",
        f"| ours seconds (first publish → 0 rows) | {_mmm(col('ours', 'seconds'), dec)} |",
        f"| ours: the {b} publish_batch calls took s | {_mmm(col('ours', 'publish_s'), dec)} |",
        f"| ours: one publish_batch ({n:,} VINs) p50 ms | {_mmm(col('ours', 'publish_p50_ms'), dec)} |",
        f"| ours: one publish_batch max ms | {_mmm(col('ours', 'publish_max_ms'), dec)} |",
        f"| ours: a no-op hook RPC meanwhile (IGNOREd publish, every 0.1 s) p50 ms | "
        f"{_mmm(col('ours', 'probe_p50_ms'), dec)} |",
        f"| ours: no-op hook RPC p99 ms | {_mmm(col('ours', 'probe_p99_ms'), dec)} |",
        f"| ours: last vehicle receive at s | {_mmm(col('ours', 'last_receive_s'), dec)} |",
        f"| ours: per-vehicle cycle (receive → next receive) p50 ms | {_mmm(col('ours', 'cycle_p50_ms'), dec)} |",
        f"| ours: per-vehicle cycle p99 ms | {_mmm(col('ours', 'cycle_p99_ms'), dec)} |",
        f"| ours: fleet part (receive → PUBACK + acked RPC answered) p50 ms | "
        f"{_mmm(col('ours', 'fleet_p50_ms'), dec)} |",
        f"| ours: of which the message.acked RPC round trip p50 ms | {_mmm(col('ours', 'rpc_p50_ms'), dec)} |",
        f"| ours: server part (acked RPC answered → next receive) p50 ms | {_mmm(col('ours', 'turn_p50_ms'), dec)} |",
        f"| raw (b): per-vehicle cycle p50 ms | {_mmm(col('raw_b', 'cycle_p50_ms'), dec)} |",
        f"| ours hook RPCs/s handled (acked + batches) | {_mmm(col('ours', 'hook_rpcs_per_s'), num)} |",
        f"| ours {commits} | {_mmm(col('ours', 'commits_per_s'), num)} |",
        f"| ours write ops per commit (row deletes + batches) | {_mmm(col('ours', 'ops_per_commit'), dec)} |",
        "",
        "| round | order | ours msgs/s | raw (a) msgs/s | raw (b) msgs/s | ours/(a) | ours/(b) | ours s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(rounds, 1):
        lines.append(
            f"| {i} | {r['order']} | {r['ours']['msgs_per_s']:,.0f} | {r['raw_a']['msgs_per_s']:,.0f} | "
            f"{r['raw_b']['msgs_per_s']:,.0f} | {r['ratio_a']:.2f} | {r['ratio_b']:.2f} | "
            f"{r['ours']['seconds']:.2f} |"
        )

    def med(side: str, key: str, group: str) -> float:
        return float(statistics.median(r[side][key].get(group, 0.0) for r in rounds))

    lines += [
        "",
        "#### Where the CPU went (median over rounds): µs of CPU per delivered message, and share of one core",
        "",
        "| process | ours µs/msg | ours core | raw (a) µs/msg | raw (a) core | raw (b) µs/msg | raw (b) core |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, ours_group, raw_group in (
        ("sdv-fanout server / raw publisher", "server", "raw publisher"),
        ("mosquitto", "mosquitto", "mosquitto"),
        ("fleet: sim (vehicles + EMQX hook driver) / raw subscribers", "sim fleet", "raw fleet"),
        ("this bench process", "bench", "bench"),
        ("**all of the above**", "total", "total"),
        ("other processes on the machine (not this bench)", "other processes", "other processes"),
    ):
        cells = [f"{med('ours', 'cpu_us_per_msg', ours_group):,.0f}", share(med("ours", "cpu", ours_group))]
        for side in ("raw_a", "raw_b"):
            cells += [f"{med(side, 'cpu_us_per_msg', raw_group):,.0f}", share(med(side, "cpu", raw_group))]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    lines.append(
        f"| server's busiest thread | {med('ours', 'cpu_us_per_msg', 'server busiest thread'):,.0f} | "
        f"{share(med('ours', 'cpu', 'server busiest thread'))} | | | | |"
    )
    dups = sum(r[s]["duplicates"] for r in rounds for s in ("ours", "raw_a", "raw_b"))
    lines += [
        "",
        f"### Batch → vehicle latency at about half load: {lat['batches']} batches of {n:,} VINs, "
        f"one every {lat['interval_s']:.2f} s",
        "",
        "| metric | value |",
        "|---|---:|",
        f"| offered (half of ours' median) msgs/s | {lat['offered_msgs_per_s']:,.0f} |",
        f"| achieved (first publish → 0 rows) msgs/s | {lat['achieved_msgs_per_s']:,.0f} |",
        f"| samples (VIN, request) | {lat['samples']:,} |",
        f"| latency from publish_batch returning: p50 ms | {lat['p50_ms']:.1f} |",
        f"| p90 ms | {lat['p90_ms']:.1f} |",
        f"| p99 ms | {lat['p99_ms']:.1f} |",
        f"| max ms | {lat['max_ms']:.1f} |",
        f"| min ms (negative: received before the hook's answer was back) | {lat['min_ms']:.1f} |",
        f"| received before publish_batch returned | {lat['before_return']:,} |",
        f"| latency from publish_batch called: p50 / p99 ms | {lat['call_p50_ms']:.1f} / {lat['call_p99_ms']:.1f} |",
        f"| publish_batch call ({n:,} VINs, durable) p50 ms | {lat['publish_p50_ms']:.1f} |",
        f"| CPU server / mosquitto / sim fleet / other processes (of one core) | {share(lat['cpu']['server'])} / "
        f"{share(lat['cpu']['mosquitto'])} / {share(lat['cpu']['sim fleet'])} / "
        f"{share(lat['cpu']['other processes'])} |",
        "",
        rss_markdown(rss, meta),
        "",
        f"Duplicate deliveries over all rounds: {dups}. Payload {meta['payload_bytes']} B, mosquitto "
        f"max_inflight_messages 32, publisher window {meta['max_inflight']}, server workers = CPUs.",
    ]
    return "\n".join(lines)


def rss_markdown(rss: dict[str, Any], meta: dict[str, Any]) -> str:
    """The RSS-per-VIN table (RSS summed over the server's processes) and the run's conditions."""
    lines = [
        f"### Server RSS per online VIN ({meta['server_processes']} server process(es) after the parent; "
        "RSS summed over all)",
        "",
        "| measure | VINs | RSS before MiB | RSS after MiB | bytes per VIN |",
        "|---|---:|---:|---:|---:|",
    ]
    if "e2e_before" in rss:
        n = meta["vehicles"]
        lines.append(
            f"| e2e: {n:,} vehicles connected + subscribed (delivery on; includes fleet gRPC channels) | {n:,} | "
            f"{mib(rss['e2e_before'])} | {mib(rss['e2e_after'])} | {(rss['e2e_after'] - rss['e2e_before']) / n:,.0f} |"
        )
    pres = rss["presence"]
    for p in pres["points"]:
        lines.append(
            f"| synthetic OnSessionSubscribed, delivery off (after {pres['warm']:,} warm-up sessions) | "
            f"{p['sessions']:,} | {mib(pres['rss_base'])} | {mib(p['rss'])} | {p['bytes_per_vin']:,.0f} |"
        )
    lines += [
        "",
        f"Synthetic presence: {pres['rpc_per_s']:,.0f} OnSessionSubscribed RPC/s from {meta['presence_clients']} "
        f"channels, {pres['server_cpu_us_per_rpc']:.0f} µs server CPU per RPC. "
        f"{meta['cpus']} CPUs shared by broker, server, fleets and bench; 1-min load average "
        f"{meta['loadavg_1m_before']:.2f} before, {meta['loadavg_1m_after']:.2f} after; {meta['wall_s']:.0f} s "
        f"wall. Seed {meta['seed']}.",
    ]
    return "\n".join(lines)


def levels_markdown(levels: list[dict[str, Any]], vehicles: int) -> str:
    lines = [
        "",
        f"### Ours alone at growing work ({vehicles:,} vehicles; medians of 5 runs at 1x, 2 at 10x, 1 at 100x)",
        "",
        "| level | messages | msgs/s | server CPU µs/msg | **server cost vs 1x** | all processes µs/msg | other CPU |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in levels:
        lines.append(
            f"| {lv['level']}x | {lv['messages']:,} | {lv['msgs_per_s']:,.0f} | {lv['server_us_per_msg']:,.0f} | "
            f"{lv['server_cost_vs_first']:.2f} | {lv['total_us_per_msg']:,.0f} | {lv['other_processes']:.0%} |"
        )
    return "\n".join(lines)
