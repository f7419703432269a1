"""bench/pacing.py's report: achieved against set rate per setup, and the paired cost of an active policy."""

from __future__ import annotations

from typing import Any

from testkit.plumbing import dec3, min_med_max, num
from testkit.summary import PACING_COST_MIN as COST_TARGET


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = []
    if result["rates"]:
        lines += [
            f"### Pacing: achieved against set rate, {meta['seconds']:g} s per rate, endless demand",
            "",
            "| setup | set /min | starts | achieved /min | achieved / set |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in result["rates"]:
            lines.append(
                f"| {r['setup']} | {r['set']:,} | {r['starts']:,} | {r['achieved']:,.1f} | "
                f"{r['achieved'] / r['set']:.3f} |"
            )
        lines.append("")
    if result["cost"]:
        rounds = result["cost"]
        lines += [
            f"### Pacing: an active policy end to end, {meta['vehicles']} vehicles x {meta['batches']} requests "
            f"per run, {len(rounds)} rounds (LMDB, one server)",
            "",
            "| metric | min | median | max |",
            "|---|---:|---:|---:|",
            f"| off (no policy): deliveries/s | {min_med_max([r['off'] for r in rounds], num)} |",
            f"| on (10^9/min, 10^9 in flight on every request): deliveries/s | "
            f"{min_med_max([r['on'] for r in rounds], num)} |",
            f"| **ratio on / off** (paired; target ≥ {COST_TARGET}) | "
            f"{min_med_max([r['ratio'] for r in rounds], dec3)} |",
            "",
        ]
    lines.append(
        f"{meta['cpus']} CPUs; load average (1 min) {meta['loadavg_1m_before']:.2f} before, "
        f"{meta['loadavg_1m_after']:.2f} after."
    )
    return "\n".join(lines)
