"""bench/e2e_emqx.py's report: the summary of its rounds (min / median / max, paired ratios) and its markdown."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from testkit.plumbing import (
    dec,
    min_med_max,
    num,
    share,
)

SIDES = ("ours", "ours_rule", "raw_paced", "raw_loop")
OURS = ("ours", "ours_rule")
LABELS = {"ours": "ours (hook acks)", "ours_rule": "ours (rule acks)", "raw_paced": "raw paced", "raw_loop": "raw loop"}


def summarise(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    series = {f"{side}_deliveries_per_s": [r[side]["deliveries_per_s"] for r in rounds] for side in SIDES}
    for ours, key in (("ours", ""), ("ours_rule", "rule_")):
        series[f"ratio_{ours}_over_raw_paced"] = [r[f"ratio_{key}paced"] for r in rounds]
        series[f"ratio_{ours}_over_raw_loop"] = [r[f"ratio_{key}loop"] for r in rounds]
        series[f"cost_ratio_raw_paced_over_{ours}"] = [r[f"cost_ratio_{key}paced"] for r in rounds]
        for group in ("server", "emqx"):
            series[f"{ours}_{group}_us_per_delivery"] = [r[ours]["cpu_us_per_delivery"][group] for r in rounds]
    series["raw_paced_emqx_us_per_delivery"] = [r["raw_paced"]["cpu_us_per_delivery"]["emqx"] for r in rounds]
    return {k: {"min": min(v), "median": statistics.median(v), "max": max(v)} for k, v in series.items()}


def version_markdown(v: dict[str, Any], meta: dict[str, Any]) -> str:
    rounds = v["rounds"]
    n, k = meta["vehicles"], meta["requests"]

    def col(side: str, key: str) -> str:
        return min_med_max([r[side][key] for r in rounds], num if key == "deliveries_per_s" else dec)

    def cpu(side: str, group: str) -> list[float]:
        return [r[side]["cpu_us_per_delivery"][group] for r in rounds]

    def ratio(key: str) -> str:
        return min_med_max([r[key] for r in rounds], dec)

    def per(side: str, key: str, by: float, fmt: Callable[[float], str]) -> str:
        return min_med_max([r[side][key] / by for r in rounds], fmt)

    lines = [
        f"### EMQX {v['version']} (ExHook {v['protocol']}): {n:,} vehicles x {k} requests = {n * k:,} deliveries "
        f"per measurement, {len(rounds)} rounds",
        "",
        "| metric | min | median | max |",
        "|---|---:|---:|---:|",
        f"| ours, hook acks ($SDV-FANOUT batch → ExHook → LMDB → MQTT → PUBACK → message.acked → next) "
        f"deliveries/s | {col('ours', 'deliveries_per_s')} |",
        f"| ours, rule acks (… → PUBACK → rule → MQTT ack message → next) deliveries/s | "
        f"{col('ours_rule', 'deliveries_per_s')} |",
        f"| raw, broker-paced (EMQX max_inflight 1 queues per session) deliveries/s | "
        f"{col('raw_paced', 'deliveries_per_s')} |",
        f"| raw, closed loop (next on the vehicle's signal) deliveries/s | {col('raw_loop', 'deliveries_per_s')} |",
        f"| **ratio ours (hook acks) / raw broker-paced** (paired per round) | {ratio('ratio_paced')} |",
        f"| **ratio ours (rule acks) / raw broker-paced** (paired per round) | {ratio('ratio_rule_paced')} |",
        f"| ratio ours (hook acks) / raw closed loop (paired per round) | {ratio('ratio_loop')} |",
        f"| ratio ours (rule acks) / raw closed loop (paired per round) | {ratio('ratio_rule_loop')} |",
        f"| CPU per delivery, all the rig's processes: raw broker-paced / ours hook acks (paired) | "
        f"{ratio('cost_ratio_paced')} |",
        f"| CPU per delivery, all the rig's processes: raw broker-paced / ours rule acks (paired) | "
        f"{ratio('cost_ratio_rule_paced')} |",
        f"| ours hook acks: per-vehicle cycle (receive → next receive) p50 ms | {col('ours', 'cycle_p50_ms')} |",
        f"| ours rule acks: per-vehicle cycle p50 ms | {col('ours_rule', 'cycle_p50_ms')} |",
        f"| ours hook acks: per-vehicle cycle p99 ms | {col('ours', 'cycle_p99_ms')} |",
        f"| ours rule acks: per-vehicle cycle p99 ms | {col('ours_rule', 'cycle_p99_ms')} |",
        f"| raw broker-paced: per-vehicle cycle p50 ms | {col('raw_paced', 'cycle_p50_ms')} |",
        f"| raw closed loop: per-vehicle cycle p50 ms | {col('raw_loop', 'cycle_p50_ms')} |",
        f"| ours hook acks: hook calls EMQX counted as answered, per delivery | "
        f"{per('ours', 'hook_calls', n * k, dec)} |",
        f"| ours rule acks: hook calls EMQX counted as answered, per delivery | "
        f"{per('ours_rule', 'hook_calls', n * k, dec)} |",
        f"| ours hook acks: hook calls EMQX counted as failed | {per('ours', 'hook_failures', 1, num)} |",
        f"| ours rule acks: hook calls EMQX counted as failed | {per('ours_rule', 'hook_failures', 1, num)} |",
        "",
        "CPU per delivery (median over rounds, µs of CPU per delivery, and share of one core):",
        "",
        "| process | " + " | ".join(f"{LABELS[side]} µs | core" for side in SIDES) + " |",
        "|---|" + "---:|---:|" * len(SIDES),
    ]
    for label, group in (
        (f"sdv-fanout server measured ({v['server_processes']} process(es))", "server"),
        (f"EMQX {v['version']}", "emqx"),
        ("fleet (vehicles)", "fleet"),
        ("raw publisher", "raw publisher"),
        ("this bench (the platform client for ours)", "bench"),
        ("**all of the above**", "total"),
        ("other processes on the machine (the idle server included)", "other processes"),
    ):
        cells = []
        for side in SIDES:
            us = statistics.median(cpu(side, group))
            core = statistics.median(r[side]["cpu"][group] for r in rounds)
            cells += [num(us), share(core)]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    lines += [
        "",
        "| round | order | hook /s | rule /s | raw paced /s | raw loop /s | hook/paced | rule/paced | hook/loop "
        "| rule/loop |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(rounds, 1):
        rates = " | ".join(f"{r[side]['deliveries_per_s']:,.0f}" for side in SIDES)
        lines.append(
            f"| {i} | {r['order']} | {rates} | {r['ratio_paced']:.2f} | {r['ratio_rule_paced']:.2f} | "
            f"{r['ratio_loop']:.2f} | {r['ratio_rule_loop']:.2f} |"
        )
    dups = sum(r[s]["duplicates"] for r in rounds for s in SIDES)
    lines += ["", f"Duplicate deliveries over all rounds: {dups}."]
    if v["profile"]:
        lines += ["", f"#### Where the servers' time goes (py-spy, EMQX {v['version']})", "", v["profile"]]
    return "\n".join(lines)


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "### Summary: ours / raw EMQX QoS 1 with one message in flight per vehicle (medians, min to max)",
        "",
        "| EMQX | ExHook | acks | ours deliveries/s | raw broker-paced /s | **ours / paced** | raw closed loop /s | "
        "ours / loop | CPU cost raw paced / ours | server µs/delivery | EMQX µs/delivery |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v in results:
        s = v["summary"]

        def m(key: str, fmt: Callable[[float], str], s: dict[str, dict[str, float]] = s) -> str:
            return f"{fmt(s[key]['median'])} ({fmt(s[key]['min'])} to {fmt(s[key]['max'])})"

        for ours, acks in (("ours", "hook"), ("ours_rule", "rule")):
            lines.append(
                f"| {v['version']} | {v['protocol']} | {acks} | {m(f'{ours}_deliveries_per_s', num)} | "
                f"{m('raw_paced_deliveries_per_s', num)} | **{m(f'ratio_{ours}_over_raw_paced', dec)}** | "
                f"{m('raw_loop_deliveries_per_s', num)} | {m(f'ratio_{ours}_over_raw_loop', dec)} | "
                f"{m(f'cost_ratio_raw_paced_over_{ours}', dec)} | {m(f'{ours}_server_us_per_delivery', num)} | "
                f"{m(f'{ours}_emqx_us_per_delivery', num)} |"
            )
    lines += [
        "",
        f"Fleet: {meta['vehicles']:,} paho MQTT 5 vehicles (clientid = VIN) in {meta['procs']} processes on a "
        f"listener with `mqtt.max_inflight = 1`, {meta['requests']} requests per vehicle per measurement, payload "
        f"{meta['payload_bytes']} B; raw publisher window {meta['max_inflight']}; server processes "
        f"{', '.join(str(v['server_processes']) for v in results)} (each of the two servers); ExHook pool_size 8; "
        f"raw broker-paced EMQX µs/delivery "
        f"{', '.join(num(v['summary']['raw_paced_emqx_us_per_delivery']['median']) for v in results)}. "
        f"{meta['cpus']} CPUs shared by "
        f"broker, servers, fleet and bench; 1-min load average {meta['loadavg_1m_before']:.2f} before, "
        f"{meta['loadavg_1m_after']:.2f} after; {meta['wall_s']:.0f} s wall. Seed {meta['seed']}.",
    ]
    for v in results:
        lines += ["", version_markdown(v, meta)]
    return "\n".join(lines)
