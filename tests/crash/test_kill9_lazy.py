"""kill -9 with lazy row deletes (acked deliveries) still waiting: they are lost, nothing else is.

A lost delete only brings the acked row back, to be delivered once more (QoS 1 allows it);
durable ops, and the lazy ops that rode along with them, are on disk.
"""

from __future__ import annotations

import functools
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from storage.lmdb import batches
from storage.lmdb.store import Store
from storage.lmdb.writer import GroupCommitter
from testkit.harness import ROOT

CHILD = textwrap.dedent(
    """
    import functools, hashlib, sys, threading
    from storage.lmdb import batches
    from storage.lmdb.store import Store
    from storage.lmdb.writer import GroupCommitter

    store = Store(sys.argv[1])
    writer = GroupCommitter(store, lazy_delay_s=3600)  # lazy ops wait for company, never for time
    sha1 = hashlib.sha1(b"payload").digest()
    t = store.tables

    def delete(vin):
        return functools.partial(batches.delete_row_if, t=t, vin=vin, request_id="task_a_1", sha1=sha1)

    for i in range(100):  # acked: deletes parked
        writer.submit(delete(f"V{i}"), lazy=True)
    if sys.argv[2] == "with-durable":  # a batch commits: the parked deletes ride along
        writer.submit(
            functools.partial(batches.store_batch, t=t, vins=["NEW"], request_id="task_b_1", blob=b"x", now_ms=2)
        ).result(10)
    for i in range(100, 200):  # acked after that commit: parked again
        writer.submit(delete(f"V{i}"), lazy=True)
    print("parked", flush=True)
    threading.Event().wait()
    """
)


def run_and_kill(db: Path, mode: str) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", CHILD, str(db), mode], cwd=ROOT, stdout=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "parked"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)


def fill(db: Path) -> None:
    with Store(db) as store:
        writer = GroupCommitter(store)
        vins = [f"V{i}" for i in range(200)]
        writer.submit(
            functools.partial(
                batches.store_batch, t=store.tables, vins=vins, request_id="task_a_1", blob=b"payload", now_ms=1
            )
        ).result(10)
        writer.close()


def pending(db: Path) -> set[str]:
    with Store(db) as store:  # read-write open: the store is usable after the kill
        return {row.vin for vin in [f"V{i}" for i in range(200)] + ["NEW"] for row in store.pending(vin)}


def test_parked_deletes_are_lost_and_only_they(tmp_path: Path) -> None:
    db = tmp_path / "db"
    fill(db)
    run_and_kill(db, "lazy-only")
    assert pending(db) == {f"V{i}" for i in range(200)}, "every acked row is back, to be sent again"


def test_deletes_that_rode_with_a_batch_survive_the_kill(tmp_path: Path) -> None:
    db = tmp_path / "db"
    fill(db)
    run_and_kill(db, "with-durable")
    assert pending(db) == {f"V{i}" for i in range(100, 200)} | {"NEW"}
