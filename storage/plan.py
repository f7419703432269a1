"""Apply a GC plan computed by spark/gc_job.py over an export, re-checking every candidate.

The plan lists candidates as of the export snapshot; inside each write transaction a row is deleted
only if it still has the planned timestamp, an alias only if not rewritten, and a blob only if not
created or referenced since `snapshot - grace`. Re-running is harmless: an interrupted apply simply
runs again. `apply_plan_to` walks a plan over a `PlanTarget`, one store's three deletes
(`storage.lmdb.plan.LmdbTarget`, `storage.postgres.plan.PgTarget`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import pyarrow.dataset as ds

from storage.errors import PlanError
from storage.model import BLOB_CHUNK, ROW_CHUNK, ApplyReport

PLAN_FORMAT = "sdv-fanout-gc-plan"
_CHUNK = {"expired_rows": ROW_CHUNK, "expired_aliases": ROW_CHUNK, "garbage_blobs": BLOB_CHUNK}


def read_summary(plan: Path) -> dict[str, Any]:
    try:
        summary: dict[str, Any] = json.loads((plan / "summary.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"{plan} is not a GC plan: no readable summary.json ({exc})") from exc
    if summary.get("format") != PLAN_FORMAT or summary.get("format_version") != 1:
        raise PlanError(f"{plan}: not an sdv-fanout GC plan (format {summary.get('format')!r})")
    return summary


def _chunks(plan: Path, table: str, columns: list[str]) -> Iterator[list[tuple[Any, ...]]]:
    path = plan / table
    if not path.exists():
        return
    for batch in ds.dataset(path, format="parquet").to_batches(columns=columns, batch_size=_CHUNK[table]):
        cols = [batch.column(c).to_pylist() for c in columns]
        yield list(zip(*cols, strict=True))


def count(plan: Path, table: str) -> int:
    path = plan / table
    return ds.dataset(path, format="parquet").count_rows() if path.exists() else 0


class PlanTarget(Protocol):
    """The deletes a plan needs, each one transaction of the store that re-checks its candidates."""

    def delete_rows(self, planned: Sequence[tuple[str, str, int]]) -> tuple[int, int]:
        """Rows (VIN, request id, ts) still at the planned ts end `expired`: (deleted, kept changed)."""
        ...

    def delete_aliases(self, planned: Sequence[tuple[str, int]]) -> int:
        """Aliases (data_id, ts) not rewritten since; how many went."""
        ...

    def delete_blobs(self, sha1s: Sequence[bytes], cutoff_ms: int) -> tuple[int, int, int]:
        """Blobs unused since `cutoff_ms`: (deleted, bytes freed, kept because used since)."""
        ...


def apply_plan_to(
    target: PlanTarget, plan: Path, *, dry_run: bool = False, progress: Callable[[int], None] | None = None
) -> ApplyReport:
    """Delete the plan's candidates that are still garbage; rows, then aliases, then blobs."""
    summary = read_summary(plan)
    blob_cutoff = int(summary["snapshot_ms"]) - int(summary["grace_ms"])
    tick = progress or (lambda n: None)
    report = ApplyReport(dry_run=dry_run)
    for chunk in _chunks(plan, "expired_rows", ["vin", "request_id", "ts_ms"]):
        if dry_run:
            report.rows_deleted += len(chunk)
        else:
            d, k = target.delete_rows(chunk)
            report.rows_deleted += d
            report.rows_kept_changed += k
        tick(len(chunk))
    for chunk in _chunks(plan, "expired_aliases", ["data_id", "ts_ms"]):
        report.aliases_deleted += len(chunk) if dry_run else target.delete_aliases(chunk)
        tick(len(chunk))
    for chunk in _chunks(plan, "garbage_blobs", ["sha1"]):
        sha1s = [c[0] for c in chunk]
        if dry_run:
            report.blobs_deleted += len(sha1s)
        else:
            d, f, k = target.delete_blobs(sha1s, blob_cutoff)
            report.blobs_deleted += d
            report.blob_bytes_freed += f
            report.blobs_kept_recent += k
        tick(len(chunk))
    return report


def plan_size(plan: Path) -> int:
    """Candidates of every kind in `plan` (for a progress bar)."""
    return sum(count(plan, t) for t in ("expired_rows", "expired_aliases", "garbage_blobs"))
