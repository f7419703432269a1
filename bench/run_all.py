"""Run every benchmark in bench/ with moderate settings and write docs/BENCHMARKS.md + PNG charts.

    .venv/bin/python bench/run_all.py            # what `make bench` runs (~2-3 min on 2 cores)

Each script runs as its own subprocess, one after the other (never in parallel: they share the
machine's CPUs), with --json into a tmp dir. The summary table is built from those JSON files;
each script's markdown output follows verbatim. A script that fails is reported as such and the
others still run; the exit code is then 1.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# (name, script, args, title): moderate settings, chosen so the whole run stays under ~10 min.
SCRIPTS: list[tuple[str, str, list[str], str]] = [
    ("ingest", "bench/ingest.py", [], "Durable ingest (bench/ingest.py)"),
    (
        "grpc_flavour",
        "bench/grpc_flavour.py",
        ["--rounds", "3", "--duration", "2"],
        "grpc.aio vs sync no-op server (bench/grpc_flavour.py)",
    ),
    (
        "e2e",
        "bench/e2e.py",
        ["--vehicles", "500", "--batches", "10", "--rounds", "2", "--procs", "2"],
        "End-to-end delivery (bench/e2e.py)",
    ),
    ("gc", "bench/gc.py", ["--rows", "300000"], "GC pipeline (bench/gc.py)"),
]


def mmm(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def fmt_mmm(s: dict[str, float] | None, fmt: str = "{:.2f}") -> str:
    if not s:
        return "n/a"
    return " / ".join(fmt.format(s[k]) for k in ("min", "median", "max"))


def verdict(s: dict[str, float] | None, target: float, higher_is_better: bool = True) -> str:
    if not s:
        return "not measured (run failed)"
    ok = s["median"] >= target if higher_is_better else s["median"] <= target
    return "**PASS**" if ok else "**FAIL**"


def run_script(name: str, script: str, args: list[str], tmp: Path) -> dict[str, Any]:
    json_path = tmp / f"{name}.json"
    cmd = [sys.executable, script, *args, "--json", str(json_path)]
    shown = " ".join(shlex.quote(c) for c in [".venv/bin/python", script, *args, "--json", f"{name}.json"])
    print(f"== {shown}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    # stderr (progress) goes straight to the terminal; stdout is the markdown we keep.
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=False)
    wall = time.monotonic() - t0
    data = None
    if proc.returncode == 0 and json_path.exists():
        data = json.loads(json_path.read_text())
    print(f"== {name}: exit {proc.returncode}, {wall:.0f} s", file=sys.stderr, flush=True)
    return {"cmd": shown, "rc": proc.returncode, "wall_s": wall, "markdown": proc.stdout.strip(), "data": data}


# -- summary ------------------------------------------------------------------------------


def summary_rows(res: dict[str, dict[str, Any]]) -> list[tuple[str, str, str, str, str]]:
    """(scenario, reference, target, measured, status) rows, all numbers from the JSON files."""
    rows: list[tuple[str, str, str, str, str]] = []

    ing = res["ingest"]["data"]
    s = ing["summary"]["ratio_ours_over_raw"] if ing else None
    meas = fmt_mmm(s) + "x" if s else "n/a"
    if ing:
        meas += (
            f" (ours {ing['summary']['ours_rows_per_s']['median']:,.0f} vs raw "
            f"{ing['summary']['raw_rows_per_s']['median']:,.0f} VIN-rows/s, medians)"
        )
    rows.append(
        (
            "Durable ingest, VIN-rows/s",
            "raw py-lmdb loop, same batches, 1 synced txn per batch",
            "≥ 1.5x",
            meas,
            verdict(s, 1.5),
        )
    )

    rows.append(
        (
            "Hook RPC/s (heartbeat / ack hooks), our server",
            "no-op ExHook server",
            "≥ 0.8x",
            "not measured yet: bench/grpc_flavour.py compares two no-op servers (aio vs sync), "
            "no scenario drives our server's hooks against a no-op one",
            "not measured",
        )
    )

    e2e = res["e2e"]["data"]
    for key, label in (
        ("ratio_ours_over_raw_a", "raw paho QoS 1 (a): one publisher, window 50, unconstrained"),
        ("ratio_ours_over_raw_b", "raw paho QoS 1 (b): one message in flight per subscriber"),
    ):
        s = e2e["summary"][key] if e2e else None
        meas = fmt_mmm(s) + "x" if s else "n/a"
        if e2e:
            raw_key = "raw_a_msgs_per_s" if key.endswith("_a") else "raw_b_msgs_per_s"
            meas += (
                f" (ours {e2e['summary']['ours_msgs_per_s']['median']:,.0f} vs raw "
                f"{e2e['summary'][raw_key]['median']:,.0f} msgs/s, medians)"
            )
        rows.append(("End-to-end delivered+acked msgs/s", label, "≥ 0.5x", meas, verdict(s, 0.5)))

    if e2e:
        lat = e2e["latency"]
        meas = (
            f"p50 {lat['p50_ms']:.1f} ms / p99 {lat['p99_ms']:.1f} ms "
            f"({lat['samples']:,} samples at {lat['offered_msgs_per_s']:,.0f} msgs/s offered)"
        )
    else:
        meas = "n/a"
    rows.append(("Batch-to-delivery latency", "publish_batch returned → on_message", "report", meas, "reported"))

    if e2e:
        rss = e2e["rss"]
        pres = rss["presence"]
        per_vin = pres["bytes_per_vin"]
        n = e2e["meta"]["vehicles"]
        e2e_per_vin = (rss["e2e_after"] - rss["e2e_before"]) / n
        meas = (
            f"{per_vin:,.0f} B ({pres['sessions']:,} synthetic sessions, delivery off); "
            f"{e2e_per_vin:,.0f} B in the e2e run ({n:,} real vehicles, includes fleet channels)"
        )
        status = "**PASS**" if per_vin <= 300 else "**FAIL**"
    else:
        meas, status = "n/a", "not measured (run failed)"
    rows.append(("RSS per online VIN", "—", "≤ 300 B", meas, status))

    gc = res["gc"]["data"]
    if gc:
        meas = (
            f"{gc['rows']:,} rows: export {gc['export']['rows_per_s']:,} rows/s "
            f"(peak RSS {gc['export']['peak_rss_mib']} MiB); Spark plan {gc['spark_plan']['s']} s "
            f"(driver RSS {gc['spark_plan']['peak_rss_mib_driver_python']} MiB); apply "
            f"{gc['apply']['rows_per_s']:,} deleted/s ({gc['apply']['peak_rss_mib']} MiB); embedded GC "
            f"{gc['embedded_gc']['rows_per_s']:,} deleted/s ({gc['embedded_gc']['peak_rss_mib']} MiB); "
            f"results agree: {gc['agree']}"
        )
    else:
        meas = "n/a"
    rows.append(("GC pipeline rows/s and peak RSS", "—", "report", meas, "reported" if gc else "run failed"))
    return rows


# -- charts -------------------------------------------------------------------------------


def charts(res: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
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

    ing = res["ingest"]["data"]
    if ing:
        rounds = ing["rounds"]
        bars(
            DOCS / "bench_ingest.png",
            "Durable ingest: ours vs raw py-lmdb, per round",
            "VIN-rows/s",
            [f"round {i}" for i in range(1, len(rounds) + 1)],
            {
                "ours (gRPC → sdv-fanout)": [r["ours"]["rows_per_s"] for r in rounds],
                "raw py-lmdb": [r["raw"]["rows_per_s"] for r in rounds],
            },
        )
        made.append(("bench_ingest.png", "Durable ingest, VIN-rows/s per round"))

    e2e = res["e2e"]["data"]
    if e2e:
        rounds = e2e["rounds"]
        bars(
            DOCS / "bench_e2e.png",
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

    gc = res["gc"]["data"]
    if gc:
        steps = [("export", "export"), ("gc apply", "apply"), ("embedded GC", "embedded_gc")]
        bars(
            DOCS / "bench_gc.png",
            f"GC pipeline, {gc['rows']:,} rows (half expired)",
            "rows/s (export: read; others: deleted)",
            [label for label, _ in steps],
            {"rows/s": [gc[key]["rows_per_s"] for _, key in steps]},
        )
        made.append(("bench_gc.png", "GC pipeline rows/s per step"))
    return made


# -- report -------------------------------------------------------------------------------


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
    titles = {name: title for name, _, _, title in SCRIPTS}
    for name, r in res.items():
        lines += [
            "",
            f"## {titles[name]}",
            "",
            f"`{r['cmd']}` — exit {r['rc']}, {r['wall_s']:.0f} s",
            "",
            # a script's own top-level "## " heading sits under this section's "## ", so demote it
            "\n".join("#" + ln if ln.startswith("## ") else ln for ln in r["markdown"].splitlines()) or "_(no output)_",
        ]
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(DOCS / "BENCHMARKS.md"), help="report path (default docs/BENCHMARKS.md)")
    args = p.parse_args()
    DOCS.mkdir(exist_ok=True)
    started = dt.datetime.now(dt.UTC)
    load_before = os.getloadavg()
    t0 = time.monotonic()
    res: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="sdv-bench-all-") as tmp:
        for name, script, script_args, _ in SCRIPTS:
            res[name] = run_script(name, script, script_args, Path(tmp))
    load_after = os.getloadavg()
    made = charts(res)
    wall = time.monotonic() - t0
    report = write_report(res, started, wall, load_before, load_after, made)
    Path(args.out).write_text(report)
    print(f"wrote {args.out} and {', '.join('docs/' + f for f, _ in made) or 'no charts'} in {wall:.0f} s",
          file=sys.stderr)  # fmt: skip
    return 0 if all(r["rc"] == 0 for r in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
