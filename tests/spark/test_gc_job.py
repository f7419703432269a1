"""spark/gc_job.py: the GC plan over an export follows storage/lmdb/gc.py's rules, as of the snapshot."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest

from spark import ExportError, parse_duration_ms
from spark.gc_job import build_plan
from tests.spark.export_fixture import write_export

ROOT = Path(__file__).resolve().parents[2]
H = 3_600_000
D = 24 * H
SNAP = 1_763_800_000_000
RETENTION = 7 * D
GRACE = H
CUTOFF = SNAP - RETENTION
BLOB_CUTOFF = SNAP - GRACE
PLAN_COLUMNS = {
    "expired_rows": ["vin", "request_id", "ts_ms"],
    "expired_aliases": ["data_id", "ts_ms"],
    "garbage_blobs": ["sha1", "size"],
}


def sha(n: int) -> bytes:
    return bytes([n]) * 20


def read_plan(plan: Path, table: str) -> set[tuple[Any, ...]]:
    """A plan table as `gc apply` reads it (pyarrow dataset: skips _SUCCESS and .crc files)."""
    data = ds.dataset(plan / table, format="parquet").to_table()
    assert data.column_names == PLAN_COLUMNS[table]
    return set(zip(*(data.column(c).to_pylist() for c in PLAN_COLUMNS[table]), strict=True))


def test_durations_parse_to_milliseconds() -> None:
    """`7d`, `1h`, `30m`, `45s` and plain seconds become milliseconds; anything else is refused."""
    assert [parse_duration_ms(t) for t in ("7d", "1h", "30m", "45s", "90", "1.5h")] == [
        RETENTION,
        H,
        1_800_000,
        45_000,
        90_000,
        5_400_000,
    ]
    for bad in ("", "7w", "-1h", "h", "1 day"):
        with pytest.raises(ValueError):
            parse_duration_ms(bad)


def test_plan_on_a_hand_built_export(spark: Any, tmp_path: Path) -> None:
    """Boundaries, alias, grace and touch rules each decide one row, alias or blob as storage/lmdb/gc.py would."""
    rows = [
        ("VIN1", "task_ota_1", CUTOFF - 1, sha(1), 100),  # expired; its blob only has expired rows → garbage
        ("VIN1", "task_ota_2", CUTOFF, sha(2), 200),  # exactly at the cutoff: kept
        ("VIN2", "task_cfg_1", CUTOFF + 1, sha(2), 200),
        ("VIN2", "task_cfg_2", CUTOFF - 100, sha(3), 300),  # expired, but a live alias keeps its blob
        ("VIN3", "task_x_9", CUTOFF - 5, sha(8), 800),  # expired; its blob was touched within the grace
        ("VIN3", "manual-7", CUTOFF + 5, sha(9), 900),  # refers to a blob the export lacks: harmless
    ]
    aliases = [
        ("d-live", sha(3), CUTOFF),  # at the cutoff: kept, keeps sha(3)
        ("d-old", sha(4), CUTOFF - 1),  # expired: sha(4) becomes garbage
        ("d-old2", sha(8), CUTOFF - 2),
    ]
    blobs = [
        (sha(1), CUTOFF - 10, CUTOFF - 1, 100),
        (sha(2), 1_000, 0, 200),  # ancient, never touched, but a live row refers to it
        (sha(3), 1_000, CUTOFF - 100, 300),
        (sha(4), 1_000, CUTOFF - 1, 400),
        (sha(5), BLOB_CUTOFF, 0, 500),  # unreferenced, created exactly at the grace cutoff: kept
        (sha(6), BLOB_CUTOFF - 1, 0, 600),  # unreferenced, just past the grace: garbage
        (sha(7), 1_000, SNAP - 600_000, 700),  # unreferenced, old, touched 10 minutes ago: kept
        (sha(8), 1_000, BLOB_CUTOFF + 1, 800),  # only expired rows/aliases refer to it, touched recently: kept
    ]
    export, plan = tmp_path / "export", tmp_path / "plan"
    write_export(export, rows, blobs, aliases, SNAP)

    summary = build_plan(spark, str(export), str(plan), RETENTION, GRACE)

    assert read_plan(plan, "expired_rows") == {
        ("VIN1", "task_ota_1", CUTOFF - 1),
        ("VIN2", "task_cfg_2", CUTOFF - 100),
        ("VIN3", "task_x_9", CUTOFF - 5),
    }
    assert read_plan(plan, "expired_aliases") == {("d-old", CUTOFF - 1), ("d-old2", CUTOFF - 2)}
    assert read_plan(plan, "garbage_blobs") == {(sha(1), 100), (sha(4), 400), (sha(6), 600)}
    assert summary == {
        "format": "sdv-fanout-gc-plan",
        "format_version": 1,
        "export": export.resolve().as_uri(),
        "snapshot_ms": SNAP,
        "retention_ms": RETENTION,
        "grace_ms": GRACE,
        "counts": {
            "expired_rows": 3,
            "expired_aliases": 2,
            "garbage_blobs": 3,
            "garbage_bytes": 1_100,
            "rows_kept": 3,
            "blobs_kept": 5,
        },
    }
    assert json.loads((plan / "summary.json").read_text()) == summary
    assert not list(plan.glob("*summary.json*tmp*")) and not list(plan.glob(".*crc"))


def random_export(rng: random.Random) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """5,000 rows, 300 blobs, 50 aliases, times spread across both cutoffs and some exactly on them."""

    def when(span: int) -> int:
        return rng.choice([CUTOFF, BLOB_CUTOFF, CUTOFF - 1, BLOB_CUTOFF - 1]) if rng.random() < 0.05 else SNAP - span

    blobs = []
    for _ in range(300):
        created = when(rng.randrange(10 * D))
        touched = 0 if rng.random() < 0.4 else rng.randint(created, SNAP)
        blobs.append((rng.randbytes(20), created, touched, rng.randrange(1, 5_000)))
    referable = [b[0] for b in blobs[:240]]  # the last 60 blobs are referenced only by chance of a dangling id
    rows = []
    for i in range(5_000):
        sha1 = rng.randbytes(20) if rng.random() < 0.01 else rng.choice(referable)
        vin = f"VIN{rng.randrange(400):014d}"
        rows.append((vin, f"task_{rng.choice(['ota', 'cfg', 'diag'])}_{i}", when(rng.randrange(9 * D)), sha1, 7))
    aliases = [(f"d-{i}", rng.choice([b[0] for b in blobs]), when(rng.randrange(9 * D))) for i in range(50)]
    return rows, blobs, aliases


def test_randomized_plan_equals_a_pure_python_reference(spark: Any, tmp_path: Path) -> None:
    """On a seeded random export split into several part files, the plan equals the rules computed in plain Python."""
    rows, blobs, aliases = random_export(random.Random(20_251_122))
    export, plan = tmp_path / "export", tmp_path / "plan"
    write_export(export, rows, blobs, aliases, SNAP, parts=3)

    summary = build_plan(spark, str(export), str(plan), RETENTION, GRACE)

    live = {r[3] for r in rows if r[2] >= CUTOFF} | {a[1] for a in aliases if a[2] >= CUTOFF}
    expected = {
        "expired_rows": {(v, rid, ts) for v, rid, ts, _, _ in rows if ts < CUTOFF},
        "expired_aliases": {(d, ts) for d, _, ts in aliases if ts < CUTOFF},
        "garbage_blobs": {(s, n) for s, c, t, n in blobs if s not in live and max(c, t) < BLOB_CUTOFF},
    }
    for table, want in expected.items():
        assert read_plan(plan, table) == want, table
        assert summary["counts"][table] == len(want)
    assert 0 < len(expected["garbage_blobs"]) < 300 and 0 < len(expected["expired_rows"]) < 5_000
    assert summary["counts"]["garbage_bytes"] == sum(n for _, n in expected["garbage_blobs"])
    assert summary["counts"]["rows_kept"] == 5_000 - len(expected["expired_rows"])
    assert summary["counts"]["blobs_kept"] == 300 - len(expected["garbage_blobs"])


def test_empty_export_gives_an_empty_plan_with_schemas(spark: Any, tmp_path: Path) -> None:
    """An export with no rows, blobs or aliases gives zero counts and plan tables apply can still read."""
    export, plan = tmp_path / "export", tmp_path / "plan"
    write_export(export, [], [], [], SNAP)

    summary = build_plan(spark, str(export), str(plan), RETENTION, GRACE)

    assert set(summary["counts"].values()) == {0}
    for table in PLAN_COLUMNS:
        assert read_plan(plan, table) == set()


def test_incomplete_or_foreign_export_is_refused(spark: Any, tmp_path: Path) -> None:
    """A short table, another format or an unknown version stops the job and leaves no summary."""
    export, plan = tmp_path / "export", tmp_path / "plan"
    write_export(export, [("VIN1", "task_a_1", SNAP, sha(1), 1)], [(sha(1), SNAP, 0, 1)], [], SNAP)
    plan.mkdir()
    (plan / "summary.json").write_text("{}")  # a previous plan's
    manifest = json.loads((export / "manifest.json").read_text())
    (export / "manifest.json").write_text(json.dumps({**manifest, "counts": {**manifest["counts"], "rows": 2}}))
    with pytest.raises(ExportError, match="incomplete"):
        build_plan(spark, str(export), str(plan), RETENTION, GRACE)
    assert not (plan / "summary.json").exists()

    (export / "manifest.json").write_text(json.dumps({**manifest, "format": "something-else"}))
    with pytest.raises(ExportError, match="format"):
        build_plan(spark, str(export), str(plan), RETENTION, GRACE)
    (export / "manifest.json").write_text(json.dumps({**manifest, "format_version": 4}))  # a newer sdv-fanout's
    with pytest.raises(ExportError, match="version 4"):
        build_plan(spark, str(export), str(plan), RETENTION, GRACE)
    with pytest.raises(ValueError, match="grace"):
        build_plan(spark, str(export), str(plan), RETENTION, 59_000)


def test_cli_writes_the_plan_and_prints_the_summary(spark_env: dict[str, str], tmp_path: Path) -> None:
    """`python -m spark.gc_job` runs end to end in its own JVM and writes PLAN/summary.json."""
    export, plan = tmp_path / "export", tmp_path / "plan"
    rows = [("VIN1", "task_ota_1", SNAP - 8 * D, sha(1), 10), ("VIN1", "task_ota_2", SNAP - D, sha(2), 20)]
    blobs = [(sha(1), SNAP - 9 * D, SNAP - 8 * D, 10), (sha(2), SNAP - D, 0, 20)]
    write_export(export, rows, blobs, [("d-1", sha(2), SNAP - 8 * D)], SNAP)
    argv = ["--export", str(export), "--plan", str(plan), "--retention", "7d", "--grace", "1h", "--master", "local[1]"]

    out = subprocess.run(
        [sys.executable, "-m", "spark.gc_job", *argv],
        cwd=ROOT,
        env=spark_env,
        capture_output=True,
        text=True,
        timeout=240,
    )

    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((plan / "summary.json").read_text())
    assert json.loads(out.stdout) == summary
    assert summary["counts"] == {
        "expired_rows": 1,
        "expired_aliases": 1,
        "garbage_blobs": 1,
        "garbage_bytes": 10,
        "rows_kept": 1,
        "blobs_kept": 1,
    }
    assert read_plan(plan, "garbage_blobs") == {(sha(1), 10)}
