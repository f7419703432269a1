"""`inspect`'s view of a vehicle's queue (exhook_server/lanes.py) orders rows as LMDB's dispatch
does (`Store.queue_head`, keys.row_order): both by storage.model.delivery_order. Rows with equal
timestamps, non-ASCII request ids, a batch's high flag and a policy's high priority."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from exhook_server.lanes import in_delivery_order
from storage.lmdb import batches
from storage.lmdb.store import Store
from storage.lmdb.writer import GroupCommitter
from storage.model import FLAG_HIGH_PRIORITY, RowSpec, StoredPolicy

HIGH_BY_POLICY = {"task_é_2", "task_b_1"}


class PolicyReads:
    """The one read lanes.py makes: each request id's policy in force."""

    async def policy(self, request_id: str) -> StoredPolicy | None:
        if request_id in HIGH_BY_POLICY:
            return StoredPolicy(request_id, b'{"priority": "high"}', 0)
        return None


def test_inspect_lists_a_queue_in_the_order_dispatch_sends_it(tmp_path: Path) -> None:
    rng = random.Random(26)
    store = Store(tmp_path / "db")
    committer = GroupCommitter(store)
    try:
        ids = ["task_a_1", "task_b_1", "task_é_2", "task_z_1", "task_Z_1", "task_ä_3", "task_a_10", "task_a_2"]
        for n, rid in enumerate(ids * 2):  # the second round replaces each row (a new timestamp)
            spec = RowSpec(flags=FLAG_HIGH_PRIORITY) if rng.random() < 0.3 else RowSpec()
            ts = 1_000 + rng.choice([0, 0, 5, n])  # many equal timestamps: the request id decides
            op = lambda txn, t, rid=rid, ts=ts, spec=spec, n=n: batches.store_batch(  # noqa: E731
                txn, t, ["VIN1"], rid, b"x%d" % n, ts, spec=spec
            )
            committer.submit(lambda txn, op=op: op(txn, store.tables)).result()
        dispatch, _ = store.queue_head("VIN1", 100, None, HIGH_BY_POLICY)
        shuffled = list(dispatch)
        rng.shuffle(shuffled)
        shown = asyncio.run(in_delivery_order(PolicyReads(), shuffled))  # type: ignore[arg-type]
        assert [row for row, _ in shown] == dispatch
        assert {row.request_id for row, high in shown if high} >= HIGH_BY_POLICY
    finally:
        committer.close()
        store.close()
