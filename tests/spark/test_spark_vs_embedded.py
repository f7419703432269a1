"""The Spark plan and the embedded GC agree exactly on the same snapshot of a real LMDB store."""

from __future__ import annotations

import functools
import json
import random
import shutil
from pathlib import Path
from typing import Any

from spark.gc_job import build_plan
from storage.lmdb import batches, gc, keys, parked
from storage.lmdb.export import export
from storage.lmdb.plan import apply_plan
from storage.lmdb.store import Store, now_ms
from storage.lmdb.writer import GroupCommitter

HOUR = 3_600_000
DAY = 24 * HOUR


def state(store: Store) -> tuple[set[tuple[str, str, int]], set[bytes]]:
    with store.read() as txn:
        rows = {
            (r.vin, r.request_id, r.ts_ms) for r in (keys.decode_row(k, v) for k, v in txn.cursor(store.tables.ids))
        }
        blobs = {bytes(k) for k in txn.cursor(store.tables.data).iternext(values=False)}
    return rows, blobs


def test_spark_plan_applied_equals_embedded_gc(spark: Any, tmp_path: Path) -> None:
    """Seeded random store: export → Spark plan → apply leaves exactly what one embedded GC pass leaves."""
    rng = random.Random(2024)
    now = now_ms()
    store = Store(tmp_path / "a")
    writer = GroupCommitter(store)
    for n in range(400):
        vins = [f"V{rng.randrange(150)}" for _ in range(rng.randint(1, 6))]
        blob = bytes([rng.randrange(60)]) * rng.randint(1, 50)
        at = now - rng.randrange(10 * DAY)
        writer.submit(
            functools.partial(
                batches.store_batch,
                t=store.tables,
                vins=vins,
                request_id=f"task_t{n % 5}_{n % 3}",
                blob=blob,
                now_ms=at,
            )
        ).result()
        if n % 40 == 0:
            writer.submit(
                functools.partial(
                    parked.store_data, t=store.tables, data_id=f"d{n}", blob=blob, now_ms=now - rng.randrange(10 * DAY)
                )
            ).result()
    writer.close()
    store.close()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    a, b = Store(tmp_path / "a"), Store(tmp_path / "b")
    wa, wb = GroupCommitter(a), GroupCommitter(b)
    export(a, tmp_path / "export")
    snapshot = json.loads((tmp_path / "export" / "manifest.json").read_text())["snapshot_ms"]
    summary = build_plan(spark, str(tmp_path / "export"), str(tmp_path / "plan"), 7 * DAY, HOUR)
    assert summary["counts"]["expired_rows"] > 0 and summary["counts"]["garbage_blobs"] > 0
    applied = apply_plan(a, wa.submit, tmp_path / "plan")
    embedded = gc.collect(b, wb.submit, now_ms=snapshot, retention_ms=7 * DAY, grace_ms=HOUR, early_ttl_ms=HOUR)
    assert (applied.rows_deleted, applied.blobs_deleted, applied.aliases_deleted) == (
        embedded.rows_expired,
        embedded.blobs_deleted,
        embedded.aliases_expired,
    )
    assert state(a) == state(b)
    for s, w in ((a, wa), (b, wb)):
        w.close()
        s.close()
