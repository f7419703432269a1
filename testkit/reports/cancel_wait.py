"""bench/cancel_wait.py's report: the summary of its rounds (min / median / max, paired ratios) and its markdown."""

from __future__ import annotations

import statistics
from typing import Any

from exhook_server.config import Config
from testkit.plumbing import conditions

SIDES = {"unchunked": 10_000, "chunked": Config().cancel_chunk_rows}


def markdown(rounds: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"Batch answers during a cancel of every vehicle of {meta['rows']:,} rows ({meta['store']}, trickle "
        f"batches of {'the cancelled request' if meta['trickle_request'] == 'big' else 'their own requests'}; "
        f"{meta['clients']} channels "
        f"of {meta['vins']}-VIN batches, {meta['gap_ms']:g} ms apart each; min / median / max over "
        f"{meta['rounds']} rounds, ms):",
        "",
        "| side | cancel_chunk_rows | worst wait during the cancel | p99 during | median during | worst before it "
        "| p99 before | cancel took (s) | batches during | batches failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for side, chunk in SIDES.items():
        mine = [r[side] for r in rounds]
        lines.append(
            f"| {side} | {chunk:,} | {ms([m['during']['max_s'] for m in mine])} "
            f"| {ms([m['during']['p99_s'] for m in mine])} | {ms([m['during']['median_s'] for m in mine])} "
            f"| {ms([m['before']['max_s'] for m in mine])} | {ms([m['before']['p99_s'] for m in mine])} "
            f"| {' / '.join(format(m['cancel_s'], '.1f') for m in mine)} | {sum(m['during']['n'] for m in mine)} "
            f"| {sum(m['errors'] for m in mine)} |"
        )
    lines += [
        "",
        conditions(meta),
    ]
    return "\n".join(lines)


def ms(values: list[float]) -> str:
    """min / median / max in ms."""
    return " / ".join(f"{v * 1000:.0f}" for v in (min(values), statistics.median(values), max(values)))
