"""bench/pg_failover.py's report: the summary of its rounds (min / median / max, paired ratios) and its markdown."""

from __future__ import annotations

import statistics
from typing import Any

from testkit.plumbing import dec, min_med_max, num


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def mmm(key: str) -> dict[str, float]:
        values = [r[key] for r in rounds]
        return {"min": min(values), "median": statistics.median(values), "max": max(values)}

    return {
        **{k: mmm(k) for k in ("outage_s", "kill_to_ack_s", "promote_to_ack_s", "promote_to_all_s", "slowest_error_s")},
        **{k: sum(r[k] for r in rounds) for k in ("acked", "acked_lost", "failed", "unavailable", "timed_out")},
        "other_errors": sum(r["other_errors"] for r in rounds),
        "stored_once": sum(r["stored_once"] for r in rounds),
        "not_serving_rounds": sum(r["not_serving"] for r in rounds),
    }


def report(meta: dict[str, Any], rounds: list[dict[str, Any]], s: dict[str, Any]) -> None:
    print("## PostgreSQL failover under ingest (bench/pg_failover.py)")
    print()
    print(f"`{meta['command']}`")
    print()
    print(f"{meta['cpus']} CPUs; load average (1 min) {meta['load_before']:.2f} before, {meta['load_after']:.2f} "
          f"after; {meta['instances']} instances x {meta['threads']} driver threads, {meta['vins']}-VIN batches; "
          f"primary killed -9 after {meta['warm']} acknowledged batches per instance, standby promoted "
          f"{meta['hold_s']:g} s later; server defaults (ingest_timeout_s 4 s, store_down_grace_s 10 s). "
          "Times in seconds from the first SIGKILL; \"first ack\" is the first acknowledged batch sent once every "
          "process of the primary was gone (one sent while they were dying can still commit); \"all\" is "
          "every instance having acknowledged one sent after the promote started.")  # fmt: skip
    print()
    print("| round | kill → promoted | kill → first ack | promote → first ack | promote → all | acknowledged "
          "| acknowledged lost | failed in outage | UNAVAILABLE | timed out | other errors | slowest error answer "
          "| retried, stored once | landed despite the error | NOT_SERVING |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for i, r in enumerate(rounds, 1):
        print(f"| {i} | {dec(r['outage_s'])} | {dec(r['kill_to_ack_s'])} | {dec(r['promote_to_ack_s'])} "
              f"| {dec(r['promote_to_all_s'])} | {num(r['acked'])} | **{r['acked_lost']}** | {num(r['failed'])} "
              f"| {num(r['unavailable'])} | {num(r['timed_out'])} | {num(r['other_errors'])} "
              f"| {dec(r['slowest_error_s'])} | {r['stored_once']} of {r['failed']} | {r['landed_despite_error']} "
              f"| {'yes' if r['not_serving'] else 'no'} |")  # fmt: skip
    print()
    print("| over the rounds | min | median | max |")
    print("|---|---:|---:|---:|")
    for key, label in (
        ("kill_to_ack_s", "kill → first acknowledged batch, s"),
        ("promote_to_ack_s", "promote → first acknowledged batch, s"),
        ("promote_to_all_s", "promote → every instance acknowledging, s"),
        ("slowest_error_s", "slowest error answer, s"),
    ):
        print(f"| {label} | {min_med_max([r[key] for r in rounds], dec)} |")
    print()
    print(f"Acknowledged batches lost: **{s['acked_lost']} of {s['acked']:,}**; failed batches retried and stored "
          f"exactly once: {s['stored_once']} of {s['failed']}; calls timed out: {s['timed_out']}; "
          f"rounds with a hook service NOT_SERVING: {s['not_serving_rounds']} of {len(rounds)}.")  # fmt: skip
    others = sorted({d for r in rounds for d in r["other_error_details"]})
    if others:
        print()
        print("Other error answers (neither UNAVAILABLE nor a timeout): " + "; ".join(f"`{d}`" for d in others))
