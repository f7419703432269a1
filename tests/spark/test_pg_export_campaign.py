"""spark/campaign_job.py gives the same report from a PostgreSQL export as from an LMDB one of the
same data (the campaign of tests/unit/test_pg_export.py on both stores; one local Spark session)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spark.campaign_job import CHECK_MISMATCH, build_report
from storage.lmdb.export import export as export_lmdb
from storage.postgres import export as pg_export
from tests.unit import test_pg_export as pg_exports
from tests.unit import test_store_parity_more as more

sides = pg_exports.sides  # an empty LMDB store and the emptied PostgreSQL database


def test_campaign_report_is_the_same_from_either_store(
    spark: Any, sides: tuple[more.LmdbSide, more.PgSide], tmp_path: Path
) -> None:
    """Every outcome kind, answers, expiry, a cancel-all left half done: the same totals, tables
    and bucket width (only the snapshot time and the export's path differ)."""
    lmdb_side, pg_side = sides
    pg_exports.campaign(lmdb_side)
    pg_exports.campaign(pg_side)
    export_lmdb(lmdb_side.store, tmp_path / "lmdb-export")
    pg_side._run(pg_export.export(pg_side.conn, tmp_path / "pg-export"))

    from_lmdb = build_report(spark, str(tmp_path / "lmdb-export"), str(tmp_path / "lmdb-report"))
    from_pg = build_report(spark, str(tmp_path / "pg-export"), str(tmp_path / "pg-report"))

    assert from_pg["totals"] == from_lmdb["totals"]
    assert from_pg["tables"] == from_lmdb["tables"]
    assert from_pg["bucket_ms"] == from_lmdb["bucket_ms"]
    totals = from_pg["totals"]
    assert (totals["delivered"], totals["responded"], totals["pending"]) == (2, 3, 9)
    assert totals["checks"][CHECK_MISMATCH] == 0
    campaigns = {c["request_id"]: c for c in from_pg["tables"]["campaigns"]}
    assert (campaigns["task_ota_1"]["max_per_minute"], campaigns["task_ota_1"]["aborted_ms"]) == (600, None)
    assert (campaigns["task_gone_1"]["aborted_ms"], campaigns["task_gone_1"]["abort_outcome"]) == (7, "failed")
    for name in ("generations.csv", "by_task_type.csv", "delivered_over_time.csv", "count_check.csv"):
        assert (tmp_path / "pg-report" / name).read_bytes() == (tmp_path / "lmdb-report" / name).read_bytes(), name
