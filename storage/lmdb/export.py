"""LMDB → Parquet export: one consistent snapshot of rows, blobs (metadata only), aliases,
outcome records (with the vehicles' answers), generation counts and campaign policies.

The Spark jobs in spark/ read exports, never the live store. One read transaction gives the
snapshot, so the generation counts and the rows and outcomes they count are of the same instant;
records stream out in record batches, so memory stays bounded however large the store.
A read transaction does not block the writer (LMDB is MVCC); it only delays page reuse while it
lasts, which streaming keeps short.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from storage import export_format
from storage.export_format import ALIASES_SCHEMA as ALIASES_SCHEMA
from storage.export_format import BLOBS_SCHEMA as BLOBS_SCHEMA
from storage.export_format import FORMAT as FORMAT
from storage.export_format import FORMAT_VERSION as FORMAT_VERSION
from storage.export_format import GENERATIONS_SCHEMA as GENERATIONS_SCHEMA
from storage.export_format import OUTCOMES_SCHEMA as OUTCOMES_SCHEMA
from storage.export_format import POLICIES_SCHEMA as POLICIES_SCHEMA
from storage.export_format import ROWS_SCHEMA as ROWS_SCHEMA
from storage.lmdb import keys, policies
from storage.lmdb.outcomes import Outcome
from storage.lmdb.store import Store, now_ms
from storage.lmdb.tables import SCHEMA_VERSION

Progress = Callable[[int], None]


def _write(path: Path, schema: pa.Schema, batches: Iterator[list[tuple[Any, ...]]], progress: Progress) -> int:
    """Write one table as part-00000.parquet, batch by batch; returns the row count."""
    path.mkdir(parents=True, exist_ok=True)
    n = 0
    with pq.ParquetWriter(path / "part-00000.parquet", schema, compression="zstd") as writer:
        for chunk in batches:
            columns = list(zip(*chunk, strict=True))
            writer.write_batch(
                pa.record_batch([pa.array(c, type=f.type) for c, f in zip(columns, schema, strict=True)], schema=schema)
            )
            n += len(chunk)
            progress(len(chunk))
    return n


def _batched(
    items: Iterator[tuple[Any, ...]], weight: Callable[[tuple[Any, ...]], int] | None = None
) -> Iterator[list[tuple[Any, ...]]]:
    """Chunks of `export_format.BATCH_ROWS` items, or fewer once their `weight` (bytes) reaches
    `export_format.BATCH_BYTES` (read at each call)."""
    chunk: list[tuple[Any, ...]] = []
    held = 0
    for item in items:
        chunk.append(item)
        if weight is not None:
            held += weight(item)
        if len(chunk) >= export_format.BATCH_ROWS or held >= export_format.BATCH_BYTES:
            yield chunk
            chunk = []
            held = 0
    if chunk:
        yield chunk


def _response_size(item: tuple[Any, ...]) -> int:
    return item[8] or 0  # response_bytes; null for every outcome but `responded`


def export(store: Store, out: str | os.PathLike[str], progress: Progress | None = None) -> dict[str, Any]:
    """Write OUT/{rows,blobs,aliases,outcomes,generations,policies}/part-00000.parquet, then OUT/manifest.json
    (last: an export without it is incomplete); returns the manifest."""
    out = Path(out)
    tick = progress or (lambda n: None)
    t = store.tables
    with store.read() as txn:
        snapshot = now_ms()

        def rows() -> Iterator[tuple[Any, ...]]:
            for k, v in txn.cursor(t.ids):
                r = keys.decode_row(k, v)
                yield (
                    r.vin,
                    r.request_id,
                    r.ts_ms,
                    r.sha1,
                    r.size,
                    r.expires_ms or None,
                    r.await_response,
                    r.high_priority,
                )

        def blobs() -> Iterator[tuple[Any, ...]]:
            for k, v in txn.cursor(t.data):
                touched = txn.get(k, db=t.touched)
                yield (
                    bytes(k),
                    keys.blob_ts(v),
                    keys.decode_u64(touched) if touched is not None else 0,
                    len(v) - keys.BLOB_HEAD_SIZE,
                )

        def aliases() -> Iterator[tuple[Any, ...]]:
            for k, v in txn.cursor(t.aliases):
                sha1, ts = keys.decode_alias(v)
                yield bytes(k).decode(), sha1, ts

        def ended() -> Iterator[tuple[Any, ...]]:
            for k, v in txn.cursor(t.outcomes):
                vin, request_id, sha1 = keys.split_outcome_key(k)
                ended_ms, stored_ms, attempts, code = keys.decode_outcome(v)
                outcome = Outcome(code)
                response = keys.outcome_response(v) if outcome is Outcome.RESPONDED else None
                yield (
                    vin,
                    request_id,
                    sha1.hex(),
                    outcome.label,
                    ended_ms,
                    stored_ms,
                    attempts,
                    response,
                    None if response is None else len(response),
                    keys.outcome_sent(v) or None,
                )

        def generations() -> Iterator[tuple[Any, ...]]:
            for k, v in txn.cursor(t.gens):
                request_id, sha1 = keys.split_gen_key(k)
                first_ms, last_ms, gen_counts = keys.decode_gen(v)
                yield request_id, sha1.hex(), first_ms, last_ms, *gen_counts

        def campaigns() -> Iterator[tuple[Any, ...]]:
            for p in policies.all_policies(txn, t):
                aborted = None if p.aborted is None else p.aborted.decode()
                yield p.request_id, p.doc.decode(), p.set_ms, aborted

        counts = {
            "rows": _write(out / "rows", ROWS_SCHEMA, _batched(rows()), tick),
            "blobs": _write(out / "blobs", BLOBS_SCHEMA, _batched(blobs()), tick),
            "aliases": _write(out / "aliases", ALIASES_SCHEMA, _batched(aliases()), tick),
            "outcomes": _write(out / "outcomes", OUTCOMES_SCHEMA, _batched(ended(), _response_size), tick),
            "generations": _write(out / "generations", GENERATIONS_SCHEMA, _batched(generations()), tick),
            "policies": _write(out / "policies", POLICIES_SCHEMA, _batched(campaigns()), tick),
        }
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        # Which store this is a snapshot of and that store's schema version (the PostgreSQL export
        # names its database's); the tables are the same from either store.
        "store": "lmdb",
        "schema_version": SCHEMA_VERSION,
        "snapshot_ms": snapshot,
        "counts": counts,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
