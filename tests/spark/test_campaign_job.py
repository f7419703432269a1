"""spark/campaign_job.py against a pure-Python reference, and outcomes/generations through a real export."""

from __future__ import annotations

import csv
import json
import math
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from exhook_server.policy import Policy
from spark import ExportError, require_tables
from spark.campaign_job import (
    CHECK_COLLECTED,
    CHECK_MISMATCH,
    CHECK_OK,
    MAX_BUCKETS_ASKED,
    STATES,
    bucket_width_ms,
    build_report,
    check,
)
from storage.lmdb import batches, cancel, keys, outcomes, queue
from storage.lmdb.export import export
from storage.lmdb.outcomes import Outcome
from storage.lmdb.store import Store
from tests.spark.export_fixture import write_export

H = 3_600_000
SNAP = 1_763_800_000_000
T0 = SNAP - 48 * H
COUNTS = ("total", "pending", "delivered", "superseded", "cancelled", "expired", "failed", "responded")

#: (request_id, sha1 hex, its task type as the report must name it, states its pairs may be in, VINs).
GENERATIONS = [
    ("task_ota_update_1", "aa" * 20, "ota_update", ("delivered", "superseded"), 40),  # replaced by the next
    ("task_ota_update_1", "bb" * 20, "ota_update", ("delivered", "pending", "failed"), 40),
    ("task_cfg_7", "cc" * 20, "cfg", ("delivered", "pending", "expired", "cancelled"), 30),
    ("manual-42", "dd" * 20, "other", ("delivered", "pending"), 12),
    ("task_cfg_8", "ee" * 20, "cfg", ("delivered",), 10),  # some records collected by GC
    ("task_diag_1", "ff" * 20, "diag", ("delivered", "pending"), 8),  # counts one pending too many
    ("task_diag_2", "11" * 20, "diag", ("delivered",), 5),  # records, no counts
    # await_response: answered, timed out, cancelled, expired, still waiting
    ("task_unlock_3", "22" * 20, "unlock", ("responded", "failed", "cancelled", "expired", "pending"), 40),
    ("task_cfg_9", "33" * 20, "cfg", ("responded", "delivered"), 20),  # answers in a type with deliveries
]
COLLECTED, EXTRA_PENDING, UNCOUNTED = ("task_cfg_8", "ee" * 20), ("task_diag_1", "ff" * 20), ("task_diag_2", "11" * 20)


def seeded_export(out: Path) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Random pairs per generation, consistent counts except the three planted differences."""
    rng = random.Random(20251122)
    rows, ended, gens = [], [], []
    for rid, sha, _, states, n in GENERATIONS:
        counts = Counter[str]()
        first = last = T0 + rng.randrange(H)
        for v in range(n):
            state = rng.choice(states)
            stored = T0 + rng.randrange(36 * H)
            counts[state] += 1
            first, last = min(first, stored), max(last, stored)
            if state == "pending":
                rows.append((f"V{v:03d}", rid, stored, bytes.fromhex(sha), 100))
            else:
                end = stored + int(rng.expovariate(1 / 600_000)) + 1  # ~10 min to an outcome
                record: tuple[Any, ...] = (f"V{v:03d}", rid, sha, state, end, stored, rng.randint(1, 3))
                if state == "responded":
                    answer = rng.randbytes(rng.randrange(5))
                    record += (answer, len(answer))
                ended.append(record)
                last = max(last, end)
        counts["total"] = sum(counts.values())
        if (rid, sha) == COLLECTED:
            counts["delivered"] += 3
            counts["total"] += 3
        if (rid, sha) == EXTRA_PENDING:
            counts["pending"] += 1
            counts["total"] += 1
        if (rid, sha) != UNCOUNTED:
            gens.append((rid, sha, first, last, *(counts[c] for c in COUNTS)))
    write_export(out, rows, [], [], SNAP, outcomes=ended, generations=gens, parts=2)
    return rows, ended, gens


def percentile(values: list[int], p: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default), written out."""
    s = sorted(values)
    pos = (len(s) - 1) * p
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def latencies(ended: list[tuple[Any, ...]], keep: Any, outcome: str = "delivered") -> list[int]:
    return [e[4] - e[5] for e in ended if e[3] == outcome and keep(e)]


def assert_percentiles(got: dict[str, Any], times: list[int], prefix: str = "") -> None:
    for p, col in ((0.5, "p50_ms"), (0.95, "p95_ms"), (0.99, "p99_ms")):
        value = got[prefix + col]
        if times:
            assert float(value) == pytest.approx(percentile(times, p), abs=0.001), prefix + col
        else:
            assert value in ("", None), prefix + col


def test_campaign_report_equals_a_python_reference(spark: Any, tmp_path: Path) -> None:
    """Counts of every outcome, delivery and response percentiles, per-type totals, the series and the check agree."""
    export_dir, report = tmp_path / "export", tmp_path / "report"
    rows, ended, gens = seeded_export(export_dir)
    types = {(rid, sha): t for rid, sha, t, _, _ in GENERATIONS}

    summary = build_report(spark, str(export_dir), str(report), bucket_ms=H)

    got = {(g["request_id"], g["sha1"]): g for g in read_csv(report / "generations.csv")}
    assert set(got) == {(g[0], g[1]) for g in gens}
    for rid, sha, first, last, *counts in gens:
        g = got[rid, sha]
        assert [int(g[c]) for c in COUNTS] == counts and (int(g["first_ms"]), int(g["last_ms"])) == (first, last)
        assert g["task_type"] == types[rid, sha]
        for outcome, prefix in (("delivered", ""), ("responded", "response_")):
            times = latencies(ended, lambda e: (e[1], e[2]) == (rid, sha), outcome)  # noqa: B023 (called at once)
            assert int(g[f"{outcome}_records"]) == len(times)
            assert_percentiles(g, times, prefix)
        pending = [r[2] for r in rows if (r[1], r[3].hex()) == (rid, sha)]
        assert g["oldest_pending_ms"] == (str(min(pending)) if pending else "")
    assert [g["first_ms"] for g in read_csv(report / "generations.csv")] == sorted(
        (str(g[2]) for g in gens), key=int, reverse=True
    )

    by_type = {t["task_type"]: t for t in read_csv(report / "by_task_type.csv")}
    assert set(by_type) == {"ota_update", "cfg", "other", "diag", "unlock"}
    for name, t in by_type.items():
        mine = [g for g in gens if types[g[0], g[1]] == name]
        assert [int(t[c]) for c in COUNTS] == [sum(g[4 + i] for g in mine) for i in range(len(COUNTS))]
        for outcome, prefix in (("delivered", ""), ("responded", "response_")):
            times = latencies(ended, lambda e: types[e[1], e[2]] == name, outcome)  # noqa: B023 (called at once)
            assert int(t[f"{outcome}_records"]) == len(times)
            assert_percentiles(t, times, prefix)
    assert by_type["unlock"]["p50_ms"] == "" and int(by_type["unlock"]["responded"]) > 0
    assert int(by_type["unlock"]["cancelled"]) > 0 and int(by_type["unlock"]["expired"]) > 0
    everything = latencies(ended, lambda e: True)
    answers = latencies(ended, lambda e: True, "responded")
    assert summary["totals"]["p99_ms"] == pytest.approx(percentile(everything, 0.99), abs=0.001)
    assert summary["totals"]["response_p99_ms"] == pytest.approx(percentile(answers, 0.99), abs=0.001)
    for i, c in enumerate(COUNTS):
        assert summary["totals"][c] == sum(g[4 + i] for g in gens), c
    assert summary["totals"]["responded_records"] == len(answers) == summary["totals"]["responded"]

    per_hour = {o: Counter(e[4] - e[4] % H for e in ended if e[3] == o) for o in ("delivered", "responded")}
    buckets = per_hour["delivered"] | per_hour["responded"]
    series = read_csv(report / "delivered_over_time.csv")
    assert [int(s["bucket_ms"]) for s in series] == list(range(min(buckets), max(buckets) + H, H))
    for o in ("delivered", "responded"):
        assert [int(s[o]) for s in series] == [per_hour[o][int(s["bucket_ms"])] for s in series]
    assert (int(series[-1]["cumulative"]), int(series[-1]["responded_cumulative"])) == (len(everything), len(answers))
    by_type_series = read_csv(report / "delivered_by_task_type.csv")
    diag = [s for s in by_type_series if s["task_type"] == "diag"]
    assert int(diag[-1]["cumulative"]) == len(latencies(ended, lambda e: e[1].startswith("task_diag_")))
    unlock = [s for s in by_type_series if s["task_type"] == "unlock"]
    assert (int(unlock[-1]["cumulative"]), int(unlock[-1]["responded_cumulative"])) == (
        0,
        len(latencies(ended, lambda e: e[1] == "task_unlock_3", "responded")),
    )

    checks = {(c["request_id"], c["sha1"]): c for c in read_csv(report / "count_check.csv")}
    assert {k: c["check"] for k, c in checks.items()} == {
        COLLECTED: CHECK_COLLECTED,
        EXTRA_PENDING: CHECK_MISMATCH,
        UNCOUNTED: CHECK_MISMATCH,
    }
    assert int(checks[EXTRA_PENDING]["stored_pending"]) == int(checks[EXTRA_PENDING]["recounted_pending"]) + 1
    assert checks[UNCOUNTED]["stored_total"] == "" and int(checks[UNCOUNTED]["recounted_total"]) == 5
    assert summary["totals"]["checks"] == {CHECK_OK: 6, CHECK_COLLECTED: 1, CHECK_MISMATCH: 2}
    # An export without a policies table (from before it) has no campaign policies.
    assert summary["totals"]["campaigns"] == 0 and read_csv(report / "campaigns.csv") == []
    assert not (report / "campaigns.png").exists()

    png = (report / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000
    assert json.loads((report / "report.json").read_text())["bucket_ms"] == H
    assert "records_collected" in (report / "README.md").read_text()


def test_export_round_trip_of_outcomes_and_generations(tmp_path: Path) -> None:
    """What storage.lmdb.batches records (supersede, deliver, fail) comes out of `export` as the store holds it."""
    with Store(tmp_path / "lmdb") as store:

        def run(op: Any, **kw: Any) -> Any:
            with store.write() as txn:
                return op(txn, t=store.tables, **kw)

        run(batches.store_batch, vins=["V1", "V2", "V3"], request_id="task_ota_1", blob=b"fw1", now_ms=1_000)
        run(batches.store_batch, vins=["V2"], request_id="task_ota_1", blob=b"fw2", now_ms=1_500)
        run(batches.store_batch, vins=["V9"], request_id="manual", blob=b"x", now_ms=1_200)
        awaited = batches.RowSpec(expires_ms=5_000, flags=keys.FLAG_AWAIT_RESPONSE)
        run(
            batches.store_batch,
            vins=["V1", "V4", "V5"],
            request_id="task_unlock_1",
            blob=b"open",
            now_ms=1_800,
            spec=awaited,
        )
        awaited_later = batches.RowSpec(expires_ms=9_000, flags=keys.FLAG_AWAIT_RESPONSE)
        run(
            batches.store_batch, vins=["V6"], request_id="task_unlock_2", blob=b"lock", now_ms=1_900, spec=awaited_later
        )
        fw1, opened = batches.sha1_of(b"fw1"), batches.sha1_of(b"open")
        for vin, outcome, attempts in (("V1", Outcome.DELIVERED, 2), ("V3", Outcome.FAILED, 3)):
            assert run(
                batches.delete_row_if,
                vin=vin,
                request_id="task_ota_1",
                sha1=fw1,
                now_ms=2_000,
                outcome=outcome,
                attempts=attempts,
            )
        answer = b"unlocked \xff"  # not UTF-8: the export keeps bytes as they came
        assert run(
            batches.delete_row_if,
            vin="V1",
            request_id="task_unlock_1",
            sha1=opened,
            now_ms=2_100,
            outcome=Outcome.RESPONDED,
            attempts=1,
            response=answer,
        )
        assert run(cancel.cancel_vins, request_id="task_unlock_1", vins=["V4"], now_ms=2_200).total == 1
        assert len(run(queue.expire_due, now_ms=5_000, limit=10)) == 1  # V5; V6 expires at 9_000
        manifest = export(store, tmp_path / "export")
        with store.read() as txn:
            held = outcomes.all_generations(txn, store.tables)

    assert manifest["format_version"] == 3
    assert manifest["counts"] == {"rows": 3, "blobs": 5, "aliases": 0, "outcomes": 6, "generations": 5, "policies": 0}
    rows = ds.dataset(tmp_path / "export" / "rows").to_table().to_pylist()
    assert sorted((r["vin"], r["request_id"], r["ts_ms"], r["expires_at_ms"], r["await_response"]) for r in rows) == [
        ("V2", "task_ota_1", 1_500, None, False),
        ("V6", "task_unlock_2", 1_900, 9_000, True),
        ("V9", "manual", 1_200, None, False),
    ]
    got = ds.dataset(tmp_path / "export" / "outcomes").to_table().to_pylist()
    assert [r.pop("sent_ms") for r in got] == [None] * len(got)  # no publish was recorded here
    assert sorted(tuple(r.values()) for r in got) == [
        ("V1", "task_ota_1", fw1.hex(), "delivered", 2_000, 1_000, 2, None, None),
        ("V1", "task_unlock_1", opened.hex(), "responded", 2_100, 1_800, 1, answer, len(answer)),
        ("V2", "task_ota_1", fw1.hex(), "superseded", 1_500, 1_000, 0, None, None),
        ("V3", "task_ota_1", fw1.hex(), "failed", 2_000, 1_000, 3, None, None),
        ("V4", "task_unlock_1", opened.hex(), "cancelled", 2_200, 1_800, 0, None, None),
        ("V5", "task_unlock_1", opened.hex(), "expired", 5_000, 1_800, 0, None, None),
    ]
    gens = {
        (g["request_id"], g["sha1"]): g for g in ds.dataset(tmp_path / "export" / "generations").to_table().to_pylist()
    }
    assert gens == {
        (g.request_id, g.sha1.hex()): {
            "request_id": g.request_id,
            "sha1": g.sha1.hex(),
            "first_ms": g.first_ms,
            "last_ms": g.last_ms,
            **g.counts,
        }
        for g in held
    }
    for (rid, sha), counts in (
        (("task_ota_1", fw1.hex()), (3, 0, 1, 1, 0, 0, 1, 0)),
        (("task_unlock_1", opened.hex()), (3, 0, 0, 0, 1, 1, 0, 1)),
    ):
        assert gens[rid, sha] | {"first_ms": 0, "last_ms": 0} == {
            "request_id": rid,
            "sha1": sha,
            "first_ms": 0,
            "last_ms": 0,
            **dict(zip(COUNTS, counts, strict=True)),
        }


def test_export_batches_are_bounded_by_the_answers_they_hold(tmp_path: Path, monkeypatch: Any) -> None:
    """Outcome records with large answers go out in smaller record batches (Arrow memory stays bounded)."""
    import storage.export_format as export_module

    monkeypatch.setattr(export_module, "BATCH_BYTES", 10_000)
    with Store(tmp_path / "lmdb") as store:
        spec = batches.RowSpec(flags=keys.FLAG_AWAIT_RESPONSE)
        vins = [f"V{n:02d}" for n in range(12)]
        with store.write() as txn:
            batches.store_batch(txn, store.tables, vins, "task_unlock_1", b"open", now_ms=1_000, spec=spec)
            for vin in vins:
                batches.delete_row_if(
                    txn,
                    store.tables,
                    vin,
                    "task_unlock_1",
                    batches.sha1_of(b"open"),
                    2_000,
                    Outcome.RESPONDED,
                    1,
                    b"a" * 4096,
                )
        export(store, tmp_path / "export")

    part = pq.ParquetFile(tmp_path / "export" / "outcomes" / "part-00000.parquet")
    assert part.metadata.num_rows == 12 and part.num_row_groups == 4  # 3 answers of 4 KiB reach 10,000 bytes
    assert {len(r) for r in part.read(columns=["response"]).column("response").to_pylist()} == {4096}


def test_report_on_a_real_store_finds_its_counts_consistent(spark: Any, tmp_path: Path) -> None:
    """Batches, replacements, acks, answers, cancels and expiry sweeps through storage: every generation is `ok`."""
    assert ("total", *STATES) == keys.COUNT_NAMES  # the job's state names are the store's
    rng = random.Random(7)
    with Store(tmp_path / "lmdb") as store:
        t = store.tables
        for n in range(400):
            now = T0 + n * 60_000
            vins = [f"V{rng.randrange(25)}" for _ in range(rng.randint(1, 5))]
            rid, blob = f"task_t{n % 3}_{rng.randrange(3)}", bytes([rng.randrange(3)])
            with store.write() as txn:
                roll = rng.random()
                if roll < (0.55 if n < 300 else 0):  # the last 100 steps only end rows (a re-store revives them)
                    spec = batches.RowSpec(
                        expires_ms=rng.choice([0, now + rng.randrange(1, 60) * 60_000]),
                        flags=rng.choice([0, keys.FLAG_AWAIT_RESPONSE]),
                        max_pending=8,
                    )
                    batches.store_batch(txn, t, vins, rid, blob, now_ms=now, spec=spec)
                elif roll < 0.9:
                    # What dispatch ends rows with (a cancelled pair's is amended); the others below.
                    outcome = rng.choice([Outcome.DELIVERED, Outcome.FAILED, Outcome.RESPONDED])
                    answer = rng.randbytes(3) if outcome is Outcome.RESPONDED else b""
                    batches.delete_row_if(txn, t, vins[0], rid, batches.sha1_of(blob), now + 5, outcome, 1, answer)
                elif roll < 0.95:
                    cancel.cancel_vins(txn, t, rid, vins, now + 5)
                else:
                    queue.expire_due(txn, t, now + 5, limit=100)
        export(store, tmp_path / "export")
        with store.read() as txn:
            held = outcomes.all_generations(txn, store.tables)

    summary = build_report(spark, str(tmp_path / "export"), str(tmp_path / "report"))

    assert summary["totals"]["checks"] == {CHECK_OK: len(held), CHECK_COLLECTED: 0, CHECK_MISMATCH: 0}
    for c in COUNTS:
        assert summary["totals"][c] == sum(g.counts[c] for g in held)
        assert summary["totals"][c] > 0, c  # every state is exercised
    assert 0 < summary["totals"]["delivered_records"] == summary["totals"]["delivered"]
    assert 0 < summary["totals"]["responded_records"] == summary["totals"]["responded"]


def test_a_version_1_export_reads_as_one_without_answers(spark: Any, tmp_path: Path) -> None:
    """An export from before the `responded` outcome (7 counts, no answers) gives the same report, none responded."""
    sha = "aa" * 20
    ended = [
        ("V1", "task_ota_1", sha, "delivered", T0 + 60_000, T0, 1),
        ("V2", "task_ota_1", sha, "delivered", T0 + 180_000, T0, 2),
        ("V3", "task_ota_1", sha, "cancelled", T0 + 200_000, T0, 0),
    ]
    rows = [("V4", "task_ota_1", T0, bytes.fromhex(sha), 10)]
    gens = [("task_ota_1", sha, T0, T0 + 200_000, 4, 1, 2, 0, 1, 0, 0)]
    write_export(tmp_path / "export", rows, [], [], SNAP, outcomes=ended, generations=gens, version=1)

    summary = build_report(spark, str(tmp_path / "export"), str(tmp_path / "report"))

    [g] = read_csv(tmp_path / "report" / "generations.csv")
    assert [g[c] for c in COUNTS] == ["4", "1", "2", "0", "1", "0", "0", "0"] and g["check"] == CHECK_OK
    assert (g["p50_ms"], g["responded_records"], g["response_p50_ms"]) == ("120000.0", "0", "")
    assert summary["totals"]["checks"] == {CHECK_OK: 1, CHECK_COLLECTED: 0, CHECK_MISMATCH: 0}
    series = read_csv(tmp_path / "report" / "delivered_over_time.csv")
    assert (series[-1]["cumulative"], series[-1]["responded_cumulative"]) == ("2", "0")


def test_an_empty_export_gives_empty_tables_and_a_chart(spark: Any, tmp_path: Path) -> None:
    """No generations at all: header-only CSVs, zero totals, no percentiles, and still a PNG."""
    write_export(tmp_path / "export", [], [], [], SNAP, outcomes=[], generations=[])

    summary = build_report(spark, str(tmp_path / "export"), str(tmp_path / "report"))

    assert (summary["totals"]["generations"], summary["totals"]["total"], summary["totals"]["p50_ms"]) == (0, 0, None)
    assert read_csv(tmp_path / "report" / "generations.csv") == []
    assert (tmp_path / "report" / "delivered_over_time.csv").read_text() == (
        "bucket_ms,bucket,delivered,cumulative,responded,responded_cumulative\n"
    )
    assert (tmp_path / "report" / "report.png").read_bytes().startswith(b"\x89PNG")


def test_count_check_tells_collected_records_from_a_mismatch() -> None:
    """Only ended counts above the recount is GC's doing; a pending difference or a missing side is not."""
    recounted = dict(zip(COUNTS, (6, 2, 3, 0, 0, 0, 0, 1), strict=True))
    assert check(dict(recounted), recounted) == CHECK_OK
    assert check({**recounted, "total": 10, "delivered": 5, "expired": 2}, recounted) == CHECK_COLLECTED
    assert check({**recounted, "total": 7, "responded": 2}, recounted) == CHECK_COLLECTED
    assert check({**recounted, "responded": 0}, recounted) == CHECK_MISMATCH
    assert check({**recounted, "total": 6, "pending": 3}, recounted) == CHECK_MISMATCH
    assert check({**recounted, "total": 4, "delivered": 2}, recounted) == CHECK_MISMATCH  # fewer than the records
    assert check({**recounted, "delivered": 4}, recounted) == CHECK_MISMATCH  # total disagrees with the states
    assert check(None, recounted) == CHECK_MISMATCH
    assert check({**dict.fromkeys(COUNTS, 0), "total": 4, "delivered": 4}, None) == CHECK_COLLECTED


def test_bucket_width_is_the_smallest_ladder_step_that_fits() -> None:
    """Auto buckets: 1 min up to 240 of them, then 5 min, ...; whole days past a week; a tiny --bucket is refused."""
    assert bucket_width_ms(0, 240 * 60_000 - 1) == 60_000
    assert bucket_width_ms(0, 240 * 60_000) == 300_000
    assert bucket_width_ms(0, 10 * 365 * 24 * H) == 16 * 24 * H
    assert bucket_width_ms(5, 5) == 60_000 and bucket_width_ms(0, 9 * H, asked_ms=H) == H
    with pytest.raises(ValueError, match="buckets"):
        bucket_width_ms(0, MAX_BUCKETS_ASKED * 1_000, asked_ms=1_000)


def test_an_export_without_outcomes_is_refused() -> None:
    """An export from before outcomes and generations existed gets a clear error, not an empty report."""
    with pytest.raises(ExportError, match="outcomes, generations"):
        require_tables({"counts": {"rows": 1, "blobs": 1, "aliases": 0}}, "x", "rows", "outcomes", "generations")


DAY = 24 * H
DAY0 = SNAP - SNAP % DAY  # midnight UTC of the snapshot's day (the snapshot is at 08:26)
PACED = {"max_per_minute": 60, "ramp": {"start_per_minute": 10, "factor": 2.0, "every_s": 30}}
PACED_SET_MS = DAY0 + 6 * H + 17_000  # 17 s into a minute: the ramp steps mid-minute
WINDOWED = {"windows": [{"cron": "0 2 * * *", "duration_s": 7200, "tz": "UTC"}]}
WINDOWED_FIRST_MS = DAY0 - DAY + 3 * H  # an hour into yesterday's window
GUARDED = {"abort": [{"outcome": "failed", "ratio": 0.2, "min_finished": 10}]}
ABORT_MS = DAY0 + 7 * H


def policy_export(out: Path) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """A paced campaign, one with a daily window (pending still), an aborted one and a paused one
    with no rows; their outcome records and generation counts."""
    rng = random.Random(26)
    ended: list[tuple[Any, ...]] = []
    rows: list[tuple[Any, ...]] = []

    def end(rid: str, outcome: str, at: int, stored: int) -> None:
        ended.append((f"V{len(ended):04d}", rid, "ab" * 20, outcome, at, stored, 1))

    for _ in range(150):
        end("task_paced_1", "delivered", PACED_SET_MS + rng.randrange(6 * 60_000), PACED_SET_MS - 1_000)
    for outcome in ("failed", "responded"):  # not in the achieved rate: no PUBACK time kept
        end("task_paced_1", outcome, PACED_SET_MS + 70_000, PACED_SET_MS - 1_000)
    for day, n in ((DAY0 - DAY, 10), (DAY0, 30)):
        lo = max(day + 2 * H, WINDOWED_FIRST_MS)
        for _ in range(n):
            end("task_window_1", "delivered", lo + rng.randrange(day + 4 * H - lo), WINDOWED_FIRST_MS)
    for _ in range(4):  # outside every window (a delivery started inside may end outside)
        end("task_window_1", "delivered", DAY0 + 4 * H + rng.randrange(H), WINDOWED_FIRST_MS)
    rows.append(("V9999", "task_window_1", WINDOWED_FIRST_MS, bytes.fromhex("ab" * 20), 10))
    plan = [("delivered", -1, 8), ("failed", -1, 3), ("cancelled", -1, 1), ("cancelled", 0, 20)]
    plan += [("delivered", 1, 2), ("failed", 1, 1)]
    for outcome, side, n in plan:
        for _ in range(n):
            at = ABORT_MS + (side * (1 + rng.randrange(60_000)) if side else 0)
            end("task_abort_1", outcome, at, ABORT_MS - 10 * 60_000)
    gens = []
    for rid in ("task_paced_1", "task_window_1", "task_abort_1"):
        mine = [e for e in ended if e[1] == rid]
        pending = sum(1 for r in rows if r[1] == rid)
        counts = Counter(e[3] for e in mine)
        first = min(e[5] for e in mine)
        total = len(mine) + pending
        gens.append((rid, "ab" * 20, first, max(e[4] for e in mine), total, pending, *(counts[c] for c in COUNTS[2:])))
    aborted = {"criterion": GUARDED["abort"][0], "counts": {"finished": 12, "failed": 3}, "at_ms": ABORT_MS}
    policies = [
        ("task_abort_1", json.dumps(GUARDED), ABORT_MS - H, json.dumps(aborted)),
        ("task_idle_1", json.dumps({"paused": True}), DAY0, None),
        ("task_paced_1", json.dumps(PACED), PACED_SET_MS, None),
        ("task_window_1", json.dumps(WINDOWED), WINDOWED_FIRST_MS, None),
    ]
    write_export(out, rows, [], [], SNAP, outcomes=ended, generations=gens, policies=policies)
    return ended, gens


def reference_allowed(set_ms: int, minute_ms: int) -> float:
    """What PACED allows in one minute: its rate at each millisecond of it, summed."""
    policy = Policy.decode(json.dumps(PACED).encode())
    return sum(policy.rate_per_minute(t - set_ms) or 0.0 for t in range(minute_ms, minute_ms + 60_000)) / 60_000


def test_campaign_policies_in_the_report_equal_a_python_reference(spark: Any, tmp_path: Path) -> None:
    """Per request with a policy: deliveries per minute against its (ramping) rate, time inside and
    outside its windows with the deliveries in each, and its abort point, as a reference computes them."""
    ended, _ = policy_export(tmp_path / "export")
    summary = build_report(spark, str(tmp_path / "export"), str(tmp_path / "report"))
    assert summary["totals"]["campaigns"] == 4
    got = {c["request_id"]: c for c in read_csv(tmp_path / "report" / "campaigns.csv")}
    assert sorted(got) == ["task_abort_1", "task_idle_1", "task_paced_1", "task_window_1"]

    per_minute = Counter(e[4] - e[4] % 60_000 for e in ended if e[1] == "task_paced_1" and e[3] == "delivered")
    rates = [r for r in read_csv(tmp_path / "report" / "rate_per_minute.csv") if r["request_id"] == "task_paced_1"]
    assert [(int(r["minute_ms"]), int(r["delivered"])) for r in rates] == sorted(per_minute.items())
    for r in rates:
        limit = reference_allowed(PACED_SET_MS, int(r["minute_ms"]))
        assert float(r["policy_per_minute"]) == pytest.approx(limit, abs=0.001)
        assert float(r["ratio"]) == pytest.approx(int(r["delivered"]) / limit, abs=0.001)
    assert float(rates[0]["policy_per_minute"]) == pytest.approx(10 * 47 / 60 + 20 * 13 / 60, abs=0.001)
    assert float(rates[-1]["policy_per_minute"]) == pytest.approx(60, abs=0.001)
    paced = got["task_paced_1"]
    assert (int(paced["delivered"]), int(paced["minutes"]), paced["max_per_minute"]) == (150, len(rates), "60")
    assert int(paced["peak_per_minute"]) == max(per_minute.values())
    assert paced["window_open_ms"] == "" and paced["aborted_ms"] == ""

    windowed = got["task_window_1"]
    in_window = [e for e in ended if e[1] == "task_window_1" and 2 * H <= e[4] % DAY < 4 * H]
    assert (int(windowed["delivered_in_window"]), int(windowed["delivered_outside_window"])) == (len(in_window), 4)
    span = SNAP - WINDOWED_FIRST_MS  # rows still pending: up to the snapshot
    assert (int(windowed["span_start_ms"]), int(windowed["span_end_ms"])) == (WINDOWED_FIRST_MS, SNAP)
    assert (int(windowed["window_open_ms"]), int(windowed["window_closed_ms"])) == (3 * H, span - 3 * H)
    assert windowed["windows_truncated"] == "False"

    aborted = got["task_abort_1"]
    assert (int(aborted["aborted_ms"]), aborted["abort_outcome"], float(aborted["abort_ratio"])) == (
        ABORT_MS,
        "failed",
        0.2,
    )
    assert json.loads(aborted["abort_counts"]) == {"failed": 3, "finished": 12}
    assert (int(aborted["cancelled_by_abort"]), int(aborted["ended_after_abort"])) == (20, 3)

    idle = got["task_idle_1"]
    assert (int(idle["delivered"]), idle["window_open_ms"], idle["peak_per_minute"]) == (0, "", "")
    assert json.loads(idle["policy"]) == {"paused": True}
    assert (tmp_path / "report" / "campaigns.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_the_rate_per_minute_counts_deliveries_in_the_minute_they_were_sent(spark: Any, tmp_path: Path) -> None:
    """With send times in the export, a pair counts in the minute of its first publish whatever
    its outcome (what max_per_minute limits): minute 0 has 3 (one PUBACKed in minute 1, one
    failed), minute 1 one; a delivered pair without a send time (a record from before they were
    kept) counts at its PUBACK (minute 2); a pair never sent not at all."""
    rid, sha1, m0 = "task_sent_1", "ab" * 20, DAY0 + 6 * H
    ended = [
        ("V1", rid, sha1, "delivered", m0 + 10_000, m0, 1, None, None, m0 + 5_000),
        ("V2", rid, sha1, "delivered", m0 + 70_000, m0, 1, None, None, m0 + 50_000),
        ("V3", rid, sha1, "failed", m0 + 90_000, m0, 3, None, None, m0 + 55_000),
        ("V4", rid, sha1, "delivered", m0 + 65_000, m0, 1, None, None, m0 + 61_000),
        ("V5", rid, sha1, "delivered", m0 + 125_000, m0, 1, None, None, None),
        ("V6", rid, sha1, "cancelled", m0 + 30_000, m0, 0, None, None, None),
    ]
    counts = Counter(e[3] for e in ended)
    gens = [(rid, sha1, m0, m0 + 125_000, len(ended), 0, *(counts[c] for c in COUNTS[2:]))]
    policies = [(rid, json.dumps({"max_per_minute": 60}), m0 - H, None)]
    write_export(tmp_path / "export", [], [], [], m0 + H, outcomes=ended, generations=gens, policies=policies)
    build_report(spark, str(tmp_path / "export"), str(tmp_path / "report"))
    rates = read_csv(tmp_path / "report" / "rate_per_minute.csv")
    assert [(int(r["minute_ms"]) - m0, int(r["delivered"])) for r in rates] == [(0, 3), (60_000, 1), (120_000, 1)]
