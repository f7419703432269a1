"""A GC plan of spark/gc_job.py applied to the LMDB store (`storage.plan.apply_plan_to`), each
delete one transaction of the group committer that re-checks its candidates (storage/lmdb/gc.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

from storage.lmdb import gc
from storage.lmdb.store import Store
from storage.model import ApplyReport
from storage.plan import apply_plan_to


class LmdbTarget:
    """The LMDB store's deletes, through its group committer's `submit`."""

    def __init__(self, store: Store, submit: gc.Submit) -> None:
        self._t, self._submit = store.tables, submit

    def delete_rows(self, planned: Sequence[tuple[str, str, int]]) -> tuple[int, int]:
        deleted, kept = self._submit(functools.partial(gc.delete_planned_rows, t=self._t, planned=planned)).result()
        return int(deleted), int(kept)

    def delete_aliases(self, planned: Sequence[tuple[str, int]]) -> int:
        return int(self._submit(functools.partial(gc.delete_planned_aliases, t=self._t, planned=planned)).result())

    def delete_blobs(self, sha1s: Sequence[bytes], cutoff_ms: int) -> tuple[int, int, int]:
        job = functools.partial(gc.delete_blobs, t=self._t, candidates=sha1s, cutoff_ms=cutoff_ms)
        d, f, k = self._submit(job).result()
        return int(d), int(f), int(k)


def apply_plan(
    store: Store, submit: gc.Submit, plan: Path, *, dry_run: bool = False, progress: Callable[[int], None] | None = None
) -> ApplyReport:
    """`apply_plan_to` the LMDB store."""
    return apply_plan_to(LmdbTarget(store, submit), plan, dry_run=dry_run, progress=progress)
