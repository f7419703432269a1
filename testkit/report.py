"""docs/BENCHMARKS.md as bench/run_all.py writes it: the header (date, machine, versions, load,
commands), the summary table, the charts (PNG next to the report), each scenario's markdown under
a section of its own; `splice` replaces one scenario's command, rows and section in an existing
report."""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
from pathlib import Path
from typing import Any

from testkit.summary import (
    summary_rows,
)

HEADING = re.compile(r"^(#{2,6}) ")  # a script has no "# " title of its own


def data_of(res: dict[str, dict[str, Any]], name: str) -> dict[str, Any] | None:
    """A scenario's JSON numbers; None if it failed or did not run."""
    return res.get(name, {}).get("data")


def charts(res: dict[str, dict[str, Any]], out_dir: Path) -> list[tuple[str, str]]:
    """PNG charts next to the report (it links them by file name)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[tuple[str, str]] = []

    def bars(path: Path, title: str, ylabel: str, xlabels: list[str], series: dict[str, list[float]]) -> None:
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / len(series)
        for i, (label, values) in enumerate(series.items()):
            xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(values))]
            ax.bar(xs, values, width, label=label)
        ax.set_xticks(range(len(xlabels)), xlabels)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    ing = data_of(res, "ingest")
    if ing:
        rounds = ing["rounds"]
        bars(
            out_dir / "bench_ingest.png",
            "Durable ingest: ours vs raw py-lmdb, per round",
            "VIN-rows/s",
            [f"round {i}" for i in range(1, len(rounds) + 1)],
            {
                "ours (gRPC → sdv-fanout)": [r["ours"]["rows_per_s"] for r in rounds],
                "raw py-lmdb": [r["raw"]["rows_per_s"] for r in rounds],
            },
        )
        made.append(("bench_ingest.png", "Durable ingest, VIN-rows/s per round"))

    e2e = data_of(res, "e2e")
    if e2e:
        rounds = e2e["rounds"]
        bars(
            out_dir / "bench_e2e.png",
            "End to end: ours vs raw paho QoS 1, per round",
            "delivered (+acked) msgs/s",
            [f"round {i}" for i in range(1, len(rounds) + 1)],
            {
                "ours": [r["ours"]["msgs_per_s"] for r in rounds],
                "raw (a) unconstrained": [r["raw_a"]["msgs_per_s"] for r in rounds],
                "raw (b) 1 in flight/VIN": [r["raw_b"]["msgs_per_s"] for r in rounds],
            },
        )
        made.append(("bench_e2e.png", "End-to-end msgs/s per round"))

    gc = data_of(res, "gc")
    if gc:
        steps = [("export", "export"), ("gc apply", "apply"), ("embedded GC", "embedded_gc")]
        bars(
            out_dir / "bench_gc.png",
            f"GC pipeline, {gc['rows']:,} rows (half expired)",
            "rows/s (export: read; others: deleted)",
            [label for label, _ in steps],
            {"rows/s": [gc[key]["rows_per_s"] for _, key in steps]},
        )
        made.append(("bench_gc.png", "GC pipeline rows/s per step"))

    hk = data_of(res, "hooks")
    if hk:
        hooks_chart(plt, hk, out_dir / "bench_hooks.png")
        made.append(("bench_hooks.png", "Heartbeat + ack hook RPC/s per round, latency at half load, VIN scale"))
    return made


def hooks_chart(plt: Any, hk: dict[str, Any], path: Path) -> None:
    """Three panels: RPC/s per round, latency at half load, CPU per RPC per VIN level."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    rounds = hk["rounds"]
    ax = axes[0]
    names = (("ours", "ours"), ("noop", "no-op (aio)"), ("example", "EMQX example (sync)"))
    for i, (key, label) in enumerate(names):
        xs = [x + (i - 1) * 0.27 for x in range(len(rounds))]
        ax.bar(xs, [r["closed"][key]["rpc_per_s"] for r in rounds], 0.27, label=label)
    ax.set_xticks(range(len(rounds)), [f"round {i}" for i in range(1, len(rounds) + 1)])
    ax.set_title("Heartbeat + ack, closed loop, 8 channels")
    ax.set_ylabel("RPC/s")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)

    ax = axes[1]
    for i, (key, label) in enumerate(names[:2]):
        xs = [x + (i - 0.5) * 0.4 for x in range(len(rounds))]
        ax.bar(xs, [r["open"][key]["p99_ms"] for r in rounds], 0.4, label=f"{label} p99")
        ax.plot(xs, [r["open"][key]["p50_ms"] for r in rounds], "k_", markersize=12)
    ax.axhline(2.0, color="red", linestyle="--", linewidth=1, label="target p99 2 ms")
    ax.set_xticks(range(len(rounds)), [f"r{i}\n{r['half_rate']:,.0f}/s" for i, r in enumerate(rounds, 1)])
    ax.set_title("Latency at half of ours' max (bars p99, ticks p50)")
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)

    ax = axes[2]
    levels = hk["summary"].get("scale") or []
    if levels:
        med = [lv["server_cpu_us_per_rpc"]["median"] for lv in levels]
        lo = [m - lv["server_cpu_us_per_rpc"]["min"] for m, lv in zip(med, levels, strict=True)]
        hi = [lv["server_cpu_us_per_rpc"]["max"] - m for m, lv in zip(med, levels, strict=True)]
        ax.bar(range(len(levels)), med, 0.6, yerr=[lo, hi], capsize=4, label="ours, median (min-max)")
        ax.set_xticks(range(len(levels)), [f"{lv['vins']:,} VINs ({lv['factor']:g}x)" for lv in levels])
        ax.legend(fontsize=8)
    ax.set_title("Server CPU per RPC vs distinct VINs (flat = linear)")
    ax.set_ylabel("µs/RPC")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def versions() -> str:
    import grpc

    parts = [f"Python {platform.python_version()}", f"grpcio {grpc.__version__}"]
    try:
        import lmdb

        parts.append(f"py-lmdb {lmdb.__version__}")
    except ImportError:
        pass
    try:
        import paho.mqtt

        parts.append(f"paho-mqtt {paho.mqtt.__version__}")
    except ImportError:
        pass
    return ", ".join(parts)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def nest(markdown: str) -> str:
    """A script's markdown under this report's "## " section: its top heading level becomes "###",
    the others keep their distance to it."""
    levels = [len(m[1]) for ln in markdown.splitlines() if (m := HEADING.match(ln))]
    shift = max(0, 3 - min(levels)) if levels else 0
    out = []
    for ln in markdown.splitlines():
        m = HEADING.match(ln)
        out.append("#" * min(6, len(m[1]) + shift) + ln[len(m[1]) :] if m else ln)
    return "\n".join(out)


def write_report(
    res: dict[str, dict[str, Any]],
    started: dt.datetime,
    wall_s: float,
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
    made: list[tuple[str, str]],
) -> str:
    def load(t: tuple[float, float, float]) -> str:
        return " / ".join(f"{v:.2f}" for v in t)

    lines = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`bench/run_all.py`); do not edit by hand. See `bench/README.md` for what",
        "each scenario measures and how to read the ratios. Client, servers and reference share the machine's",
        "CPUs, so compare the paired ratios (measured in the same run), not absolute numbers across machines.",
        "",
        f"- **Date:** {started.strftime('%Y-%m-%d %H:%M UTC')}, total wall time {wall_s:.0f} s",
        f"- **Machine:** {os.cpu_count()} CPUs ({cpu_model()}), {platform.system()} {platform.release()}",
        f"- **Versions:** {versions()}",
        f"- **Load average (1/5/15 min):** {load(load_before)} before, {load(load_after)} after",
        "- **Commands** (run one after the other from the checkout, `--json` into a tmp dir):",
        "",
        "```",
        *[r["cmd"] for r in res.values()],
        "```",
        "",
        "## Summary",
        "",
        "Ratios are ours / reference, paired per round, shown as min / median / max over the rounds; "
        "PASS / FAIL compares the **median** with the target.",
        "",
        "| scenario | reference in the same run | target | measured ratio (min / median / max) | status |",
        "|---|---|---|---|---|",
    ]
    for row in summary_rows(res):
        lines.append("| " + " | ".join(row) + " |")
    failed = [f"`{name}` (exit {r['rc']})" for name, r in res.items() if r["rc"] != 0]
    if failed:
        lines += ["", f"**Failed runs:** {', '.join(failed)}; their rows above read n/a."]
    if made:
        lines += ["", "## Charts", ""]
        for fname, alt in made:
            lines += [f"![{alt}]({fname})", ""]
    for name, r in res.items():
        lines += ["", *section(name, r)]
    return "\n".join(lines).rstrip() + "\n"


def section(name: str, r: dict[str, Any], note: str = "") -> list[str]:
    """A scenario's "## " section: its command, exit code and wall time, then its markdown."""
    return [
        f"## {r['title']}",
        "",
        f"`{r['cmd']}` — exit {r['rc']}, {r['wall_s']:.0f} s{note}",
        "",
        nest(r["markdown"]) or "_(no output)_",
    ]


def splice(report: str, res: dict[str, dict[str, Any]], started: dt.datetime, titles: dict[str, str]) -> str:
    """The report with the command, summary rows and section of each scenario in `res` replaced by
    the new run's (or added: rows at the end of the summary table, sections in the order of `titles`)."""
    lines = report.rstrip("\n").split("\n")
    note = f" (run alone with `run_all.py --only` on {started.strftime('%Y-%m-%d %H:%M UTC')})"
    fence = [i for i, ln in enumerate(lines) if ln == "```"][:2]
    if len(fence) != 2:
        raise SystemExit("the report has no commands block: run the whole `make bench` first")
    for r in res.values():
        module = r["cmd"].split()[2]  # ".venv/bin/python -m bench.x ...", or bench/x.py in an older report
        mine = (module, module.replace(".", "/") + ".py")
        at = next((i for i in range(fence[0] + 1, fence[1]) if set(lines[i].split()[1:3]) & set(mine)), None)
        if at is None:
            lines.insert(fence[1], r["cmd"])
            fence[1] += 1
        else:
            lines[at] = r["cmd"]
    new_rows = summary_rows(res)
    scenarios = {row[0] for row in new_rows}
    table = [i for i, ln in enumerate(lines) if ln.startswith("| ") and i > fence[1]]
    head = table[0] + 2 if table else None  # the header line and |---|
    if head is None or not lines[table[0]].startswith("| scenario |"):
        raise SystemExit("the report has no summary table: run the whole `make bench` first")
    end = head
    while end < len(lines) and lines[end].startswith("| "):
        end += 1
    rows = lines[head:end]
    old = [i for i, ln in enumerate(rows) if ln.split(" | ")[0][2:] in scenarios]
    at = old[0] if old else len(rows)
    rows = [ln for i, ln in enumerate(rows) if i not in old]
    rows[at:at] = ["| " + " | ".join(row) + " |" for row in new_rows]
    lines[head:end] = rows
    for name, r in res.items():
        title = section(name, r)[0]
        new = section(name, r, note)
        start = next((i for i, ln in enumerate(lines) if ln == title), None)
        if start is None:
            names = list(titles)
            later = {f"## {titles[n]}" for n in names[names.index(name) + 1 :]}
            at = next((i for i, ln in enumerate(lines) if ln in later), None)
            if at is None:
                lines += ["", *new]
            else:
                lines[at:at] = [*new, ""]
            continue
        stop = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines[start:stop] = [*new, ""] if stop < len(lines) else new
    return "\n".join(lines).rstrip() + "\n"
