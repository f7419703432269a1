"""spark/report_job.py: the fleet report's tables, CSV, chart and README on a small export."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest

from spark.report_job import build_report
from tests.spark.export_fixture import write_export

H = 3_600_000
D = 24 * H
SNAP = 1_763_800_000_000
SHA = b"\x07" * 20


def small_export(out: Path) -> None:
    """25 vehicles: VIN00 has 6 pending requests, one per age bucket; VIN01..VIN24 have one or two each."""
    ages = [30 * 60_000, 2 * H, 12 * H, 2 * D, 5 * D, 8 * D]  # one in each bucket
    rows = [("VIN00", f"task_ota_update_{i}", SNAP - age, SHA, 10) for i, age in enumerate(ages)]
    for n in range(1, 25):
        rows.append((f"VIN{n:02d}", "task_cfg_1", SNAP - H, SHA, 1))  # exactly 1h old: the 1-6h bucket
        if n <= 3:
            rows.append((f"VIN{n:02d}", "manual-7" if n == 1 else "task_", SNAP - 10 * D - n, SHA, 1))
    write_export(out, rows, [(SHA, 0, 0, 10)], [], SNAP)


def parquet(report: Path, table: str) -> list[dict[str, Any]]:
    return ds.dataset(report / "parquet" / table, format="parquet").to_table().to_pylist()  # type: ignore[no-any-return]


def csv_rows(report: Path, table: str) -> list[dict[str, str]]:
    (part,) = (report / "csv" / table).glob("part-*.csv")
    with part.open(newline="") as f:
        return list(csv.DictReader(f))


def test_report_tables_csv_and_chart(spark: Any, tmp_path: Path) -> None:
    """Pending by task type, the age histogram and the top 20 VINs are right in Parquet and CSV; the PNG is drawn."""
    export, report = tmp_path / "export", tmp_path / "report"
    small_export(export)

    summary = build_report(spark, str(export), str(report))

    assert (summary["pending"], summary["vins"], summary["snapshot_ms"]) == (33, 25, SNAP)
    by_type = parquet(report, "by_task_type")
    assert [(r["task_type"], r["pending"], r["vins"], r["bytes"]) for r in by_type] == [
        ("cfg", 24, 24, 24),
        ("ota_update", 6, 1, 60),
        ("other", 3, 3, 3),  # "manual-7" and "task_" have no <type>_<n>
    ]
    assert by_type[2]["oldest_ts_ms"] == SNAP - 10 * D - 3
    assert csv_rows(report, "by_task_type")[0] == {
        "task_type": "cfg",
        "pending": "24",
        "vins": "24",
        "bytes": "24",
        "oldest_ts_ms": str(SNAP - H),
    }

    histogram = parquet(report, "age_histogram")
    assert [(r["bucket"], r["pending"]) for r in histogram] == [
        ("<1h", 1),
        ("1-6h", 25),
        ("6-24h", 1),
        ("1-3d", 1),
        ("3-7d", 1),
        (">7d", 4),
    ]
    assert (histogram[1]["min_age_ms"], histogram[1]["max_age_ms"], histogram[5]["max_age_ms"]) == (H, 6 * H, None)
    assert [r["pending"] for r in csv_rows(report, "age_histogram")] == ["1", "25", "1", "1", "1", "4"]

    top = parquet(report, "top_vins")
    assert len(top) == 20 and [r["rank"] for r in top] == list(range(1, 21))
    assert [(r["vin"], r["pending"]) for r in top[:4]] == [("VIN00", 6), ("VIN03", 2), ("VIN02", 2), ("VIN01", 2)]
    assert top[0]["oldest_age_ms"] == 8 * D
    assert [r["vin"] for r in csv_rows(report, "top_vins")] == [r["vin"] for r in top]

    png = (report / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert "deliveries per day" in (report / "README.md").read_text()
    assert json.loads((report / "report.json").read_text())["tables"]["age_histogram"][5]["pending"] == 4
    assert (summary["backlog_bound"], summary["vins_at_bound"], summary["rows_with_expiry"]) == (1000, 0, 0)
    assert parquet(report, "at_bound") == [] and parquet(report, "expiring_requests") == []


def lifecycle_export(out: Path, version: int = 2) -> None:
    """VIN-A and VIN-B hold 4 pending each (B's oldest is older), VIN-C 3. task_unlock_1 expires for A
    (overdue: past it at the snapshot), B and C (later); task_unlock_2 expires later for A and awaits an
    answer; task_cfg_1 has no expiry."""
    rows: list[tuple[Any, ...]] = []
    for vin, n, oldest in (("VIN-A", 2, SNAP - 2 * H), ("VIN-B", 2, SNAP - 5 * H), ("VIN-C", 2, SNAP - H)):
        rows += [(vin, f"task_cfg_{i}", oldest + i, SHA, 10) for i in range(n)]
    rows += [
        ("VIN-A", "task_unlock_1", SNAP - 30 * 60_000, SHA, 10, SNAP - 60_000, False),
        ("VIN-B", "task_unlock_1", SNAP - 30 * 60_000, SHA, 10, SNAP + 60_000, False),
        ("VIN-C", "task_unlock_1", SNAP - 30 * 60_000, SHA, 10, SNAP + 120_000, False),
        ("VIN-A", "task_unlock_2", SNAP - 10 * 60_000, SHA, 10, SNAP + H, True),
        ("VIN-B", "manual-9", SNAP - 10 * 60_000, SHA, 10, None, True),
    ]
    if version < 2:
        rows = [r[:5] for r in rows]
    write_export(out, rows, [(SHA, 0, 0, 10)], [], SNAP, version=version)


def test_vehicles_at_the_backlog_bound_and_requests_with_an_expiry(spark: Any, tmp_path: Path) -> None:
    """Vehicles at the bound are listed longest-waiting first, expiring requests soonest first with overdue rows."""
    export, report = tmp_path / "export", tmp_path / "report"
    lifecycle_export(export)

    summary = build_report(spark, str(export), str(report), max_pending_per_vehicle=4)

    assert {k: summary[k] for k in ("backlog_bound", "vins_at_bound")} == {"backlog_bound": 4, "vins_at_bound": 2}
    at_bound = parquet(report, "at_bound")
    assert [(r["rank"], r["vin"], r["pending"]) for r in at_bound] == [(1, "VIN-B", 4), (2, "VIN-A", 4)]
    assert at_bound[0]["oldest_age_ms"] == 5 * H and at_bound[0]["bytes"] == 40
    assert [r["vin"] for r in csv_rows(report, "at_bound")] == ["VIN-B", "VIN-A"]
    assert {k: summary[k] for k in ("rows_with_expiry", "overdue_rows", "requests_with_expiry")} == {
        "rows_with_expiry": 4,
        "overdue_rows": 1,
        "requests_with_expiry": 2,
    }
    assert summary["await_response_rows"] == 2
    expiring = parquet(report, "expiring_requests")
    assert [(r["request_id"], r["task_type"], r["pending"], r["overdue"]) for r in expiring] == [
        ("task_unlock_1", "unlock", 3, 1),
        ("task_unlock_2", "unlock", 1, 0),
    ]
    assert (expiring[0]["earliest_expires_at_ms"], expiring[0]["latest_expires_at_ms"]) == (
        SNAP - 60_000,
        SNAP + 120_000,
    )
    assert (expiring[0]["expires_in_ms"], expiring[1]["expires_in_ms"]) == (-60_000, H)
    assert csv_rows(report, "expiring_requests")[1]["expires_in_ms"] == str(H)
    text = (report / "README.md").read_text()
    assert "2 vehicles hold at least 4 pending requests" in text and "1 of them past it" in text
    assert json.loads((report / "report.json").read_text())["tables"]["at_bound"][0]["vin"] == "VIN-B"

    skipped = build_report(spark, str(export), str(tmp_path / "skipped"), max_pending_per_vehicle=0)
    assert (skipped["backlog_bound"], skipped["vins_at_bound"]) == (None, None)
    assert parquet(tmp_path / "skipped", "at_bound") == []
    with pytest.raises(ValueError, match="max_pending_per_vehicle"):
        build_report(spark, str(export), str(tmp_path / "bad"), max_pending_per_vehicle=-1)


def test_a_version_1_export_reads_as_one_without_expiries_or_answers(spark: Any, tmp_path: Path) -> None:
    """An export from before the lifecycle columns still gives the whole report: no expiry, nothing awaited."""
    export, report = tmp_path / "export", tmp_path / "report"
    lifecycle_export(export, version=1)

    summary = build_report(spark, str(export), str(report), max_pending_per_vehicle=4)

    assert (summary["pending"], summary["vins_at_bound"]) == (11, 2)
    assert (summary["rows_with_expiry"], summary["requests_with_expiry"], summary["await_response_rows"]) == (0, 0, 0)
    assert parquet(report, "expiring_requests") == []
