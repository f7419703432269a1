"""Export to Parquet, then `gc apply` of a plan: the store may have moved on, nothing live is lost."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from storage.errors import PlanError
from storage.lmdb import gc, parked
from storage.lmdb.export import export
from storage.lmdb.plan import apply_plan
from storage.lmdb.store import SCHEMA_VERSION, Store, now_ms
from storage.lmdb.writer import GroupCommitter
from testkit.harness import BIN, put
from tests.plan_reference import read, reference_plan, write_plan

HOUR = 3_600_000
DAY = 24 * HOUR


def test_export_is_a_faithful_snapshot(env: tuple[Store, GroupCommitter], tmp_path: Path) -> None:
    """Rows, blob metadata and aliases come out as they are in LMDB, with a manifest."""
    store, writer = env
    now = now_ms()
    put(writer, store, ["V1", "V2"], "task_a_1", b"one", now - DAY)
    put(writer, store, ["V1"], "task_b_1", b"two", now)
    writer.submit(functools.partial(parked.store_data, t=store.tables, data_id="d9", blob=b"two", now_ms=now)).result()
    manifest = export(store, tmp_path / "out")
    assert manifest["counts"] == {"rows": 3, "blobs": 2, "aliases": 1, "outcomes": 0, "generations": 2, "policies": 0}
    assert manifest["snapshot_ms"] >= now and manifest["schema_version"] == SCHEMA_VERSION
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == manifest
    rows = {(r["vin"], r["request_id"]): r for r in read(tmp_path / "out", "rows")}
    assert rows["V1", "task_a_1"]["sha1"] == hashlib.sha1(b"one").digest()
    assert rows["V1", "task_a_1"]["ts_ms"] == now - DAY and rows["V1", "task_a_1"]["size"] == 3
    blobs = {b["sha1"]: b for b in read(tmp_path / "out", "blobs")}
    assert blobs[hashlib.sha1(b"two").digest()]["touched_ms"] == now
    assert read(tmp_path / "out", "aliases")[0]["data_id"] == "d9"


def test_empty_store_exports_empty_tables(env: tuple[Store, GroupCommitter], tmp_path: Path) -> None:
    """An empty store gives readable, empty Parquet tables."""
    store, _ = env
    assert export(store, tmp_path / "out")["counts"] == {
        "rows": 0,
        "blobs": 0,
        "aliases": 0,
        "outcomes": 0,
        "generations": 0,
        "policies": 0,
    }
    assert read(tmp_path / "out", "rows") == []


def test_apply_keeps_what_changed_after_the_export(env: tuple[Store, GroupCommitter], tmp_path: Path) -> None:
    """Export, then a batch reuses a garbage blob and replaces an expired row: apply deletes nothing live."""
    store, writer = env
    now = now_ms()
    put(writer, store, ["OLD1", "OLD2"], "task_a_1", b"garbage-to-be-reused", now - 8 * DAY)
    put(writer, store, ["OLD3"], "task_a_1", b"garbage", now - 8 * DAY)
    put(writer, store, ["NEW1"], "task_b_1", b"live", now - DAY)
    export(store, tmp_path / "out")
    plan = reference_plan(tmp_path / "out", 7 * DAY, HOUR)
    assert len(plan["expired_rows"]) == 3 and len(plan["garbage_blobs"]) == 2
    write_plan(tmp_path / "plan", plan, 7 * DAY, HOUR)
    # The store moves on: OLD2's row is replaced, and a new vehicle reuses the "garbage" blob.
    put(writer, store, ["OLD2", "FRESH"], "task_a_1", b"garbage-to-be-reused", now_ms())
    report = apply_plan(store, writer.submit, tmp_path / "plan")
    assert (report.rows_deleted, report.rows_kept_changed) == (2, 1)
    assert (report.blobs_deleted, report.blobs_kept_recent) == (1, 1)
    assert store.blob(hashlib.sha1(b"garbage-to-be-reused").digest()) is not None
    assert [r.vin for v in ("OLD2", "FRESH", "NEW1") for r in store.pending(v)] == ["OLD2", "FRESH", "NEW1"]
    again = apply_plan(store, writer.submit, tmp_path / "plan")
    assert (again.rows_deleted, again.blobs_deleted) == (0, 0)


def test_apply_agrees_with_embedded_gc(tmp_path: Path) -> None:
    """On the same data, export + plan + apply leaves the same store as an embedded GC pass."""
    import random

    def build(path: Path, now: int) -> Store:
        store = Store(path)
        w = GroupCommitter(store)
        rng = random.Random(11)
        for n in range(300):
            put(
                w,
                store,
                [f"V{rng.randrange(80)}" for _ in range(rng.randint(1, 5))],
                f"task_t{n % 6}_{n % 4}",
                bytes([rng.randrange(40)]) * 30,
                now - rng.randrange(9 * DAY),
            )
        w.close()
        return store

    now = now_ms()
    a, b = build(tmp_path / "a", now), build(tmp_path / "b", now)
    wa, wb = GroupCommitter(a), GroupCommitter(b)
    export(a, tmp_path / "out")
    snapshot = json.loads((tmp_path / "out" / "manifest.json").read_text())["snapshot_ms"]
    write_plan(tmp_path / "plan", reference_plan(tmp_path / "out", 7 * DAY, HOUR), 7 * DAY, HOUR)
    apply_plan(a, wa.submit, tmp_path / "plan")
    gc.collect(b, wb.submit, now_ms=snapshot, retention_ms=7 * DAY, grace_ms=HOUR, early_ttl_ms=HOUR)
    # Pages used may differ: the two record their outcomes at different times.
    assert dataclasses.replace(a.stats(), map_used_bytes=0) == dataclasses.replace(b.stats(), map_used_bytes=0)
    assert {r for v in range(80) for r in a.pending(f"V{v}")} == {r for v in range(80) for r in b.pending(f"V{v}")}
    for s, w in ((a, wa), (b, wb)):
        w.close()
        s.close()


def test_not_a_plan_is_refused(env: tuple[Store, GroupCommitter], tmp_path: Path) -> None:
    """A directory without a plan summary is a clear error, not a silent no-op."""
    store, writer = env
    with pytest.raises(PlanError, match=r"summary\.json"):
        apply_plan(store, writer.submit, tmp_path)


def test_cli_export_and_apply(tmp_path: Path) -> None:
    """`sdv-fanout export` and `sdv-fanout gc apply` work from the command line."""
    store = Store(tmp_path / "db")
    w = GroupCommitter(store)
    put(w, store, ["V1"], "task_a_1", b"old", now_ms() - 8 * DAY)
    w.close()
    store.close()
    sdv = str(BIN / "sdv-fanout")
    out = subprocess.run(
        [sdv, "export", "--data-dir", str(tmp_path / "db"), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["counts"]["rows"] == 1
    write_plan(tmp_path / "plan", reference_plan(tmp_path / "out", 7 * DAY, HOUR), 7 * DAY, HOUR)
    done = subprocess.run(
        [sdv, "gc", "apply", str(tmp_path / "plan"), "--data-dir", str(tmp_path / "db"), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rows_deleted"] == 1
    bad = subprocess.run(
        [sdv, "gc", "apply", str(tmp_path), "--data-dir", str(tmp_path / "db")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "plan" in bad.stderr
