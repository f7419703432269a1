"""SIGTERM while batches stream in: every answered batch is on disk, and the exit is clean and bounded.

A clean SIGTERM also has to look clean: operators read a traceback or an error line in the log of
a shutdown as a crash.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import grpc
import pytest

from storage.lmdb.store import Store
from testkit.emqx_sim import FakeEmqx, Mosquitto
from testkit.harness import ExHookClient, SubprocessServer, poll


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


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2, 4])
def test_sigterm_of_a_busy_server_logs_no_traceback_and_no_error(tmp_path: Path, processes: int) -> None:
    """After forwarding hooks and delivering, a SIGTERM exits 0 with no traceback and no error-level line."""
    with Mosquitto(tmp_path, verbose=False).start() as broker:
        env = {
            "SDV_FANOUT_PROCESSES": str(processes),
            "SDV_FANOUT_MQTT_URL": broker.url,
            "SDV_FANOUT_ADMIN_LISTEN": "127.0.0.1:0",
        }
        srv = SubprocessServer(tmp_path / "lmdb", env=env)
        emqx: FakeEmqx | None = None
        try:
            poll(lambda: broker.log().count(" as sdv-fanout-") >= processes, timeout_s=15)
            emqx = FakeEmqx(srv.port, broker.port)
            emqx.load()
            # Vehicles hash to every process, so the hooks of one EMQX channel are forwarded.
            fleet = [emqx.vehicle(f"LSVTERM{n:010d}") for n in range(24)]
            for v in fleet:
                v.connect()
                v.subscribe()
            for n in range(2):
                emqx.publish_batch([v.vin for v in fleet], f"task_term_{n}", f"payload {n}")
            poll(lambda: all(len(v.received) >= 2 for v in fleet), timeout_s=30)
            code = srv.terminate()  # the vehicles stay connected, as they would in production
        finally:
            srv.kill()
            if emqx is not None:
                emqx.close(check=False)
    lines = srv.log().splitlines()
    assert code == 0
    not_json = [line for line in lines if not line.startswith("{")]
    assert not not_json, "lines that are not log events (a traceback?):\n" + "\n".join(not_json[:20])
    events = [json.loads(line) for line in lines]
    bad = [e for e in events if e.get("level") not in ("debug", "info", "warning") or "exception" in e]
    assert not bad, f"error-level events on a clean shutdown: {bad[:5]}"
    assert [e["event"] for e in events].count("server_stopped") == processes
