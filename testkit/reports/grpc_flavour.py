"""bench/grpc_flavour.py's report: the summary of its rounds (min / median / max, paired ratios) and its markdown."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

FLAVOURS = ("aio", "sync")


def _mmm(values: Sequence[float], fmt: str) -> str:
    return " | ".join(format(v, fmt) for v in (min(values), statistics.median(values), max(values)))


def markdown(rounds: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"### No-op HookProvider: grpc.aio vs sync grpc.server(ThreadPoolExecutor(10)), "
        f"{meta['clients']} channels closed loop ({meta['client_procs']} client process(es)), "
        f"{meta['duration_s']:g} s per measurement, {meta['rounds']} rounds",
        "",
        "| hook | metric | min | median | max |",
        "|---|---|---:|---:|---:|",
    ]
    for hook in meta["hooks"]:
        rs = [r[hook] for r in rounds]

        def col(flavour: str, key: str, rs: list[dict[str, Any]] = rs) -> list[float]:
            return [r[flavour][key] for r in rs]

        rows = [
            ("aio RPC/s", col("aio", "rpc_per_s"), ",.0f"),
            ("sync RPC/s", col("sync", "rpc_per_s"), ",.0f"),
            ("**ratio aio/sync RPC/s** (paired)", [r["ratio"] for r in rs], ".2f"),
            ("aio p50 ms", col("aio", "p50_ms"), ".3f"),
            ("sync p50 ms", col("sync", "p50_ms"), ".3f"),
            ("aio p99 ms", col("aio", "p99_ms"), ".3f"),
            ("sync p99 ms", col("sync", "p99_ms"), ".3f"),
            ("aio server CPU us/RPC", col("aio", "server_cpu_us_per_rpc"), ".1f"),
            ("sync server CPU us/RPC", col("sync", "server_cpu_us_per_rpc"), ".1f"),
            ("aio server CPU (of one core)", [v * 100 for v in col("aio", "server_cpu")], ".0f"),
            ("sync server CPU (of one core)", [v * 100 for v in col("sync", "server_cpu")], ".0f"),
            ("client CPU (of one core), aio runs", [v * 100 for v in col("aio", "client_cpu")], ".0f"),
            ("client CPU (of one core), sync runs", [v * 100 for v in col("sync", "client_cpu")], ".0f"),
        ]
        for label, values, fmt in rows:
            lines.append(f"| {hook} | {label} | {_mmm(values, fmt)} |")
    lines += [
        "",
        f"{meta['cpus']} CPUs shared by the load generator and both servers (only one server is loaded at a "
        f"time); 1-min load average {meta['loadavg_1m_before']:.2f} before, {meta['loadavg_1m_after']:.2f} after. "
        f"Python {meta['python']}, grpcio {meta['grpc']}.",
    ]
    return "\n".join(lines)


def summarise(rounds: list[dict[str, Any]], hooks: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for hook in hooks:
        rs = [r[hook] for r in rounds]
        entry: dict[str, Any] = {}
        for flavour in FLAVOURS:
            for key in ("rpc_per_s", "p50_ms", "p99_ms", "server_cpu_us_per_rpc", "server_cpu", "client_cpu"):
                vals = [r[flavour][key] for r in rs]
                entry[f"{flavour}_{key}"] = {"min": min(vals), "median": statistics.median(vals), "max": max(vals)}
        ratios = [r["ratio"] for r in rs]
        entry["ratio_aio_over_sync"] = {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)}
        out[hook] = entry
    return out
