"""A late data message completes its parked triggers behind its answer, in bounded transactions."""

from __future__ import annotations

import json
from typing import Any

from testkit.harness import ExHookClient, poll


def test_late_data_completes_every_parked_row_in_chunks(make_server: Any) -> None:
    """Six parked triggers of 400 VINs, chunks of 1,000 rows: the data's own commit takes two,
    two more commits take the rest, and nothing stays parked."""
    srv = make_server(max_ids_per_batch=400, max_rows_per_commit=1000, early_sweep_interval_s=3600)
    client = ExHookClient(srv.port)
    try:
        for n in range(6):
            trigger = {"ids": [f"V{n}X{i:04d}" for i in range(400)], "request_id": f"task_ota_{n}", "data_id": "d1"}
            client.publish("$SDV-FANOUT/trigger", json.dumps(trigger).encode())
        assert srv.store.stats().early_triggers == 6
        committer = srv.server.committer
        before = committer.commits
        client.publish("$SDV-FANOUT/data/d1", b"firmware")
        poll(lambda: srv.store.stats().rows == 2400 and srv.store.stats().early_triggers == 0)
        assert committer.commits - before == 3
    finally:
        client.close()
