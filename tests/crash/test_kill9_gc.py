"""kill -9 of `sdv-fanout gc run` at random moments never leaves a row without its blob."""

from __future__ import annotations

import functools
import os
import random
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from storage.lmdb import batches, keys
from storage.lmdb.store import Store, now_ms
from storage.lmdb.writer import GroupCommitter
from testkit.harness import BIN, poll

SEED = int(os.environ.get("KILL9_SEED", "4242"))
DAY = 86_400_000


def fill(path: Path) -> None:
    """60,000 rows (half past retention) over 2,000 blobs, some shared by old and new rows."""
    rng = random.Random(SEED)
    store = Store(path)
    writer = GroupCommitter(store)
    now = now_ms()
    for n in range(1200):
        old = n % 2 == 0
        blob = f"blob {rng.randrange(2000)}".encode() * 20
        writer.submit(
            functools.partial(
                batches.store_batch,
                t=store.tables,
                vins=[f"V{n}_{k}" for k in range(50)],
                request_id=f"task_a_{n % 9}",
                blob=blob,
                now_ms=now - (8 * DAY if old else DAY),
            )
        )
    writer.close()
    store.close()


def check(path: Path) -> tuple[int, int]:
    with Store(path, readonly=True) as store, store.read() as txn:
        rows = 0
        for k, v in txn.cursor(store.tables.ids):
            row = keys.decode_row(k, v)
            assert txn.get(row.sha1, db=store.tables.data) is not None, f"seed {SEED}: {row} lost its blob"
            rows += 1
        return rows, int(txn.stat(store.tables.data)["entries"])


def kill_mid_pass(tmp_path: Path, template: Path, args: list[str], env: dict[str, str] | None = None) -> None:
    """Ten rounds: run `sdv-fanout ARGS --data-dir COPY`, SIGKILL it mid-pass, check the copy;
    then a last run on the last copy must finish the job (half the rows are past retention)."""
    total, _ = check(template)
    rng = random.Random(SEED)
    progress: list[int] = []
    for round_ in range(10):
        # Each round kills a pass over a fresh copy, so every kill can land mid-pass.
        db = tmp_path / f"db{round_}"
        shutil.copytree(template, db)
        cmd = [str(BIN / "sdv-fanout"), *args, "--data-dir", str(db)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            with Store(db, readonly=True) as watch:
                # Wait until the pass has begun deleting, then kill a random moment later.
                poll(
                    lambda w=watch, p=proc: w.row_count() < total or p.poll() is not None,
                    timeout_s=30,
                    interval_s=0.001,
                )
            threading.Event().wait(rng.uniform(0, 0.08))  # the kill moment, not synchronisation
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        progress.append(check(db)[0])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert check(db)[0] == total // 2
    # Some kills landed mid-pass (rows between full and done), not only before or after it.
    assert any(total // 2 < p < total for p in progress), progress


@pytest.mark.slow
def test_kill9_during_gc_keeps_every_surviving_row_whole(tmp_path: Path) -> None:
    """Ten SIGKILLs mid-GC: the store opens, surviving rows keep their blobs; a last run finishes the job."""
    fill(tmp_path / "template")
    kill_mid_pass(tmp_path, tmp_path / "template", ["gc", "run"], {**os.environ, "SDV_FANOUT_GC_GRACE_S": "60"})


@pytest.mark.slow
def test_kill9_during_gc_apply_keeps_every_surviving_row_whole(tmp_path: Path) -> None:
    """Ten SIGKILLs mid-apply: surviving rows keep their blobs; re-running apply finishes the job."""
    from tests.plan_reference import reference_plan, write_plan

    fill(tmp_path / "template")
    export = [
        str(BIN / "sdv-fanout"),
        "export",
        "--data-dir",
        str(tmp_path / "template"),
        "--out",
        str(tmp_path / "out"),
    ]
    subprocess.run(export, check=True, timeout=120, capture_output=True)
    write_plan(tmp_path / "plan", reference_plan(tmp_path / "out", 7 * DAY, 60_000), 7 * DAY, 60_000)
    kill_mid_pass(tmp_path, tmp_path / "template", ["gc", "apply", str(tmp_path / "plan")])
