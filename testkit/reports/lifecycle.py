"""bench/lifecycle.py's report: the summary of its rounds (min / median / max, paired ratios) and its markdown."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from testkit.plumbing import (
    dec,
    dec3,
    min_med_max,
    num,
    share,
)

MODES = ("puback", "response")
#: The ingest sides: the batches as today, and with `expires_at` an hour ahead, once the same
#: instant for every batch (a campaign's deadline) and once each batch its own, later than the one
#: before (as a platform stamping now + 1 h at each send would).
INGEST_SIDES = ("without", "with", "per_batch")
EXPIRING = ("with", "per_batch")
INGEST_LABEL = {
    "without": "without `expires_at`",
    "with": "with `expires_at`, one epoch-ms an hour ahead for every batch",
    "per_batch": "with `expires_at`, an hour ahead, each batch 1 ms later than the one before",
}


def ingest_markdown(ing: dict[str, Any], meta: dict[str, Any]) -> str:
    rounds = ing["rounds"]

    def col(side: str, key: str) -> list[float]:
        return [r[side][key] for r in rounds]

    def ratio(key: str) -> str:
        return min_med_max([r[key] for r in rounds], dec3)

    lines = [
        f"### Ingest: the expiry index, {ing['batches']:,} batches x {meta['vins']} VINs per side, "
        f"{len(rounds)} rounds, {meta['clients']} channels, 1 KiB blobs",
        "",
        "| metric | min | median | max |",
        "|---|---:|---:|---:|",
    ]
    for side in INGEST_SIDES:
        lines.append(f"| {INGEST_LABEL[side]}: VIN-rows/s | {min_med_max(col(side, 'rows_per_s'), num)} |")
    lines += [
        f"| **ratio with/without VIN-rows/s** (paired; one deadline for every batch) | {ratio('with_over_without')} |",
        f"| ratio per_batch/without VIN-rows/s (paired; a deadline per batch) | {ratio('per_batch_over_without')} |",
    ]
    for side in INGEST_SIDES:
        lines.append(f"| {side}: server CPU µs per VIN-row | {min_med_max(col(side, 'server_cpu_us_per_row'), dec)} |")
    lines += [
        f"| server CPU per row, with/without (paired) | {ratio('cpu_with_over_without')} |",
        f"| server CPU per row, per_batch/without (paired) | {ratio('cpu_per_batch_over_without')} |",
    ]
    for side in INGEST_SIDES:
        lines += [
            f"| {side}: batch latency p50 / p99 ms (medians) | {statistics.median(col(side, 'p50_ms')):.1f} / "
            f"{statistics.median(col(side, 'p99_ms')):.1f} | | |",
            f"| {side}: batches per commit | {min_med_max(col(side, 'batches_per_commit'), dec)} |",
        ]
    for side in EXPIRING:
        lines.append(
            f"| LMDB file bytes used per row, {side} - without (free pages included) | "
            f"{min_med_max([r[f'{side}_file_extra_bytes_per_row'] for r in rounds], num)} |"
        )
    other = [r[s]["other_cpu"] for r in rounds for s in INGEST_SIDES]
    lines.append(f"| **other processes' CPU** (of one core; mosquitto included) | {min_med_max(other, share)} |")
    lines += [
        "",
        "| round | order | without rows/s | with rows/s | per_batch rows/s | with/without | per_batch/without | "
        "server µs/row without / with / per_batch |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for i, r in enumerate(rounds, 1):
        us = " / ".join(f"{r[s]['server_cpu_us_per_row']:.2f}" for s in INGEST_SIDES)
        lines.append(
            f"| {i} | {r['order']} | "
            + " | ".join(f"{r[s]['rows_per_s']:,.0f}" for s in INGEST_SIDES)
            + f" | {r['with_over_without']:.3f} | {r['per_batch_over_without']:.3f} | {us} |"
        )

    def growth(side: str) -> str:
        return ", ".join(
            f"`{name}` {g['bytes_per_row']:+.1f} B"
            + (f" (+{g['extra_entries']:,.0f} entries)" if g["extra_entries"] else "")
            for name, g in ing["growth"][side].items()
        )

    lines += [
        "",
        f"Each side: a fresh server ({rounds[0]['with']['server_processes']} process(es)) and data dir, its delivery "
        "client connected to the run's mosquitto (no vehicle online: nothing delivered), the same batches (a request "
        "id each) differing only in `expires_at`; the order of the three sides rotates round by round. LMDB pages "
        f"per row over the paired run without `expires_at` (medians): with: {growth('with')}; per_batch: "
        f"{growth('per_batch')}.",
    ]
    return "\n".join(lines)


def e2e_markdown(e: dict[str, Any], meta: dict[str, Any]) -> str:
    rounds = e["rounds"]
    n, m = meta["vehicles"], meta["requests"]

    def col(mode: str, key: str) -> list[float]:
        return [r[mode][key] for r in rounds]

    def cpu(mode: str, group: str) -> list[float]:
        return [r[mode]["cpu_us_per_request"][group] for r in rounds]

    lines = [
        f"### End to end: response mode next to PUBACK mode, {n:,} vehicles x {m} requests = {n * m:,} requests "
        f"per measurement, {len(rounds)} rounds",
        "",
        "| metric | min | median | max |",
        "|---|---:|---:|---:|",
        f"| puback (PUBACK completes the request) completed requests/s | {min_med_max(col('puback', 'per_s'), num)} |",
        f'| response (`"await_response": true`, answer after the PUBACK) completed requests/s | '
        f"{min_med_max(col('response', 'per_s'), num)} |",
        f"| **ratio response/puback requests/s** (paired) | "
        f"{min_med_max([r['response_over_puback'] for r in rounds], dec3)} |",
        f"| puback: server CPU µs per completed request | {min_med_max(cpu('puback', 'server'), num)} |",
        f"| response: server CPU µs per completed request | {min_med_max(cpu('response', 'server'), num)} |",
        f"| server CPU per request, response/puback (paired) | "
        f"{min_med_max([r['cpu_response_over_puback'] for r in rounds], dec3)} |",
        f"| per-vehicle cycle p50 ms (receive -> next receive), puback / response (medians) | "
        f"{statistics.median(col('puback', 'cycle_p50_ms')):.1f} / "
        f"{statistics.median(col('response', 'cycle_p50_ms')):.1f} | | |",
    ]
    for group, label in (
        ("mosquitto", "mosquitto"),
        ("sim fleet", "sim fleet (vehicles + EMQX hook driver)"),
        ("platform", "the platform's status subscriber"),
        ("bench", "this bench (FakeEmqx batches)"),
        ("total", "all of the above + server"),
        ("other processes", "other processes"),
    ):
        cells = " / ".join(f"{statistics.median(cpu(mode, group)):,.0f}" for mode in MODES)
        lines.append(f"| {label} CPU µs per request, puback / response (medians) | {cells} | | |")
    lines += [
        "",
        "| round | order | puback req/s | response req/s | response/puback | server µs/req puback / response | "
        "status events (response mode) |",
        "|---:|---|---:|---:|---:|---|---|",
    ]
    for i, r in enumerate(rounds, 1):
        got = ", ".join(f"{k} {v:,}" for k, v in r["response"]["status"].items()) or "none"
        lines.append(
            f"| {i} | {r['order']} | {r['puback']['per_s']:,.0f} | {r['response']['per_s']:,.0f} | "
            f"{r['response_over_puback']:.3f} | {r['puback']['cpu_us_per_request']['server']:,.0f} / "
            f"{r['response']['cpu_us_per_request']['server']:,.0f} | {got} |"
        )
    totals = e["status_totals"]
    checks = []
    for mode in MODES:
        counts = totals["completed"].get(mode, {})
        shown = ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items()) if v) or "none"
        checks.append(
            f"{mode}: {totals['completed_gens'].get(mode, 0):,} of {e['expected_gens'][mode]:,} generations "
            f"completed ({shown}; {e['expected_requests'][mode]:,} requests sent)"
        )
    answers: Counter[str] = Counter()
    for r in rounds:
        answers.update(r["response"]["answers"])
    dups = sum(r[mode]["duplicates"] for r in rounds for mode in MODES)
    lines += [
        "",
        "Outcomes the platform's subscriber summed from the `completed` events (warm-up included): "
        + "; ".join(checks)
        + ". The vehicles' answers, as `message.publish` answered them: "
        + (", ".join(f"{k} {v:,}" for k, v in sorted(answers.items())) or "none")
        + f". Duplicate deliveries over all rounds: {dups}. One rig for the whole run (mosquitto, server with "
        f"{meta['server_processes_label']}, {meta['procs']} sim fleet processes), request payload "
        f"{meta['payload_bytes']} B, answer {meta['response_bytes']} B, status topic on (defaults).",
    ]
    for problem in e["problems"]:
        lines += ["", f"**(!) Not as specified:** {problem}."]
    return "\n".join(lines)
