"""bench/abort_reaction.py's report: per store, the abort's reaction (crossing commit -> abort
recorded, -> last row cancelled) and a plain cancel of the same rows (message -> cancel recorded,
-> last row cancelled), min / median / max over the rounds, and the paired ratio of the two walks."""

from __future__ import annotations

from typing import Any

from testkit.plumbing import conditions, mmm

#: The abort under test, and its reference: a cancel message for the same rows, measured the same way.
SIDES = ("abort", "cancel")
STORE_NAMES = {"lmdb": "LMDB", "postgresql": "PostgreSQL"}


def summarize(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per store: min / median / max of each side's two times, and of abort over cancel (last row)."""
    out: dict[str, Any] = {}
    for store, done in rounds.items():
        out[store] = {
            f"{side}_{what}": mmm([r[side][what] for r in done])
            for side in SIDES
            for what in ("recorded_s", "last_cancelled_s")
        }
        out[store]["ratio"] = mmm([r["abort"]["last_cancelled_s"] / r["cancel"]["last_cancelled_s"] for r in done])
    return out


def markdown(rounds: dict[str, list[dict[str, Any]]], summary: dict[str, Any], meta: dict[str, Any]) -> str:
    c = meta["criterion"]
    lines = [
        f"An aborted campaign of {meta['rows']:,} pending rows (criterion `{c['outcome']}` ratio {c['ratio']} "
        f"min_finished {c['min_finished']}, crossed by {meta['expiring']} rows expiring; cancel_chunk_rows "
        f"default) against a cancel message for the same rows; min / median / max over {meta['rounds']} rounds:",
        "",
        "| store | abort recorded after the crossing commit (ms) | last row cancelled after it (s) "
        "| cancel: recorded after the message (ms) | cancel: last row (s) | abort / cancel, last row |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for store, s in summary.items():
        lines.append(
            f"| {STORE_NAMES[store]} | {_ms(s['abort_recorded_s'])} | {_s(s['abort_last_cancelled_s'])} "
            f"| {_ms(s['cancel_recorded_s'])} | {_s(s['cancel_last_cancelled_s'])} | {_s(s['ratio'])} |"
        )
    lines += [
        "",
        conditions(meta),
    ]
    return "\n".join(lines)


def _ms(s: dict[str, float]) -> str:
    return " / ".join(f"{s[k] * 1000:.0f}" for k in ("min", "median", "max"))


def _s(s: dict[str, float]) -> str:
    return " / ".join(f"{s[k]:.2f}" for k in ("min", "median", "max"))
