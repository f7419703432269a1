"""SIGTERM while batches stream in: every answered batch is on disk, and the exit is clean and bounded."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import grpc
import pytest

from storage.store import Store
from tests.harness import ExHookClient, SubprocessServer, poll


@pytest.mark.slow
def test_sigterm_drain_loses_no_answered_batch(tmp_path: Path) -> None:
    """Under a stream of batches from 6 clients, SIGTERM exits 0 within the bound and keeps every answered batch."""
    srv = SubprocessServer(tmp_path / "lmdb")
    answered: list[tuple[str, str]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client(k: int) -> None:
        c = ExHookClient(srv.port)
        rng = random.Random(k)
        n = 0
        while not stop.is_set() and n < 5000:
            vin, rid = f"V{k}_{n}", f"task_s_{rng.randrange(5)}"
            try:
                c.batch([vin], rid, f"payload {k} {n}")
            except grpc.RpcError:
                break  # the server stopped taking calls: this one was not answered
            with lock:
                answered.append((vin, rid))
            n += 1
        c.close()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for th in threads:
        th.start()
    try:
        poll(lambda: len(answered) > 200, timeout_s=30)
        started = time.monotonic()
        code = srv.terminate(timeout_s=30)
        took = time.monotonic() - started
    finally:
        stop.set()
        for th in threads:
            th.join(30)
        srv.kill()
    assert code == 0 and took < 20
    events = [e["event"] for e in srv.events()]
    assert "shutdown_requested" in events and "server_stopped" in events
    with Store(tmp_path / "lmdb", readonly=True) as store:
        missing = [(v, r) for v, r in answered if [x.request_id for x in store.pending(v)] != [r]]
    assert not missing, f"{len(missing)} answered batches lost, e.g. {missing[:3]}"
