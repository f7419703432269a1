"""kill -9 against the status loop (issue 12): generation counts stay exact, a retried batch_id is delivered once.

Real `sdv-fanout serve` subprocesses on one data dir, a real mosquitto, vehicles played by
testkit/emqx_sim.py that PUBACK what they get. After each SIGKILL the LMDB files are read
as the crash left them: the counts stored per generation must equal a recount from rows
and outcome records, and every batch whose hook call returned must still be accounted for.
Set KILL9_SEED to replay a seed.
"""

from __future__ import annotations

import os
import random
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from exhook_server._proto import exhook_v3_pb2 as pb
from storage.lmdb import keys, outcomes
from storage.lmdb.batches import sha1_of
from storage.lmdb.store import Store
from testkit.emqx_sim import FakeEmqx, Mosquitto
from testkit.harness import SubprocessServer, poll
from tests.integration.test_status_topic import Platform

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("KILL9_SEED", "1212"))
ROUNDS = 10
SENDERS = 3
KILL_AFTER_S = (0.15, 1.2)
FLEET = [f"LSVOUTCOME{n:07d}" for n in range(16)]
REQUEST_IDS = [f"task_{kind}_{n}" for kind in ("ota", "cfg") for n in range(4)]
#: GC off: it would collect outcome records and finished generations, and the recount with them.
SERVER_ENV = {"SDV_FANOUT_GC_INTERVAL_S": "0", "SDV_FANOUT_WORKERS": "2", "SDV_FANOUT_PROGRESS_INTERVAL_S": "0.2"}


@contextmanager
def serving(data_dir: Path, broker: Mosquitto, processes: int = 1) -> Iterator[SubprocessServer]:
    """`sdv-fanout serve` delivering through `broker`; SIGKILLed on exit, whatever happened."""
    env = {**SERVER_ENV, "SDV_FANOUT_MQTT_URL": broker.url, "SDV_FANOUT_PROCESSES": str(processes)}
    srv = SubprocessServer(data_dir, env=env)
    try:
        yield srv
    finally:
        srv.kill()


@contextmanager
def emqx_for(
    srv: SubprocessServer, broker: Mosquitto, *, strict: bool = True, delivery_clientid: str | None = None
) -> Iterator[FakeEmqx]:
    """The hook driver for `srv`, provider loaded; closed on exit. Harness errors fail the test,
    and so do failed hook calls unless not `strict` (calls a SIGKILL cut short)."""
    emqx = FakeEmqx(srv.port, broker.port, strict_rpc=strict, delivery_clientid=delivery_clientid)
    try:
        emqx.load()
        yield emqx
    finally:
        emqx.close(check=False)  # a failure of the body is the one to report
    emqx.check()


# -- counts equal a recount after random kill -9 -------------------------------------------------
@dataclass
class Sent:
    """One batch the platform sent; `acked` once its hook call returned STOP_AND_RETURN."""

    vins: tuple[str, ...]
    request_id: str
    data: str
    batch_id: str | None
    acked: bool = False

    @property
    def sha1(self) -> bytes:
        return sha1_of(self.data.encode())


@dataclass
class PlatformLedger:
    """What the platform sent across all rounds, shared by its sender threads."""

    batches: list[Sent] = field(default_factory=list)
    #: Batches with a batch_id whose call died with the server: re-sent first, as the retry recipe says.
    retry: list[Sent] = field(default_factory=list)
    kinds: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    serial: int = 0

    def next(self, rng: random.Random, rnd: int) -> Sent:
        with self.lock:
            self.serial += 1
            if self.retry:
                self.kinds["retry"] += 1
                return self.retry.pop()
            acked = [s for s in self.batches[-60:] if s.acked]
            batch_id = f"b-{self.serial}" if rng.random() < 0.5 else None
            pick = rng.random()
            if acked and pick < 0.3:  # the same generation again, to the same VINs
                old = rng.choice(acked)
                sent, kind = Sent(old.vins, old.request_id, old.data, batch_id), "repeat"
            elif acked and pick < 0.55:  # the same request id and VINs, new data
                old = rng.choice(acked)
                sent, kind = Sent(old.vins, old.request_id, f"fw r{rnd} #{self.serial}", batch_id), "replacement"
            else:
                vins = tuple(rng.sample(FLEET, rng.randint(1, 8)))
                sent, kind = Sent(vins, rng.choice(REQUEST_IDS), f"fw r{rnd} #{self.serial}", batch_id), "new"
            self.kinds[kind] += 1
            self.batches.append(sent)
            return sent

    def died_under(self, sent: Sent) -> None:
        if sent.batch_id is not None:
            with self.lock:
                self.retry.append(sent)


def _sender(
    emqx: FakeEmqx,
    name: str,
    rng: random.Random,
    ledger: PlatformLedger,
    rnd: int,
    stop: threading.Event,
    problems: list[str],
) -> None:
    """Publish batches one after another until the server is gone."""
    try:
        while not stop.is_set():
            sent = ledger.next(rng, rnd)
            extra = {"batch_id": sent.batch_id} if sent.batch_id else {}
            reply = emqx.publish_batch(list(sent.vins), sent.request_id, sent.data, sender=name, **extra)
            if reply is None:  # the call failed: the server died under it, the batch is unknown
                ledger.died_under(sent)
                return
            if reply.type != pb.ValuedResponse.STOP_AND_RETURN:
                problems.append(f"{sent.request_id} answered {reply.type}, not STOP_AND_RETURN")
                return
            sent.acked = True
    except Exception as exc:  # surfaced by the test, never swallowed
        problems.append(f"{name} failed: {exc!r}")


def _audit(data_dir: Path, ledger: PlatformLedger) -> tuple[list[str], Counter[str]]:
    """Read the store as the crash left it: broken promises, and how many pairs are in each state."""
    errors: list[str] = []
    with Store(data_dir, readonly=True) as store, store.read() as txn:
        t = store.tables
        stored = {(g.request_id, g.sha1): g.counts for g in outcomes.all_generations(txn, t)}
        recounted = outcomes.recount(txn, t)
        rows = {(r.vin, r.request_id): r.sha1 for r in (keys.decode_row(k, v) for k, v in txn.cursor(t.ids))}
        ended = {keys.split_outcome_key(k): keys.decode_outcome(v)[3] for k, v in txn.cursor(t.outcomes)}
    for gen in sorted(stored.keys() | recounted.keys()):
        if stored.get(gen) != recounted.get(gen):
            errors.append(
                f"generation {gen[0]}/{gen[1].hex()[:12]}: stored {stored.get(gen)}, recount {recounted.get(gen)}"
            )
    for vin, rid, sha1 in ended:
        if rows.get((vin, rid)) == sha1:
            errors.append(f"{vin}/{rid}/{sha1.hex()[:12]} is pending and has an outcome record too")
    for sent in ledger.batches:
        if not sent.acked:
            continue
        for vin in sent.vins:
            if rows.get((vin, sent.request_id)) != sent.sha1 and (vin, sent.request_id, sent.sha1) not in ended:
                errors.append(
                    f"acknowledged {vin}/{sent.request_id}/{sent.sha1.hex()[:12]} (batch_id {sent.batch_id}) "
                    "is neither pending nor ended"
                )
    states = Counter({"pending": len(rows)})
    states.update(outcomes.Outcome(code).label for code in ended.values())
    return errors, states


def test_counts_equal_a_recount_from_rows_and_outcomes_after_random_kill9(tmp_path: Path) -> None:
    """After each SIGKILL mid-ingest and mid-delivery, stored counts equal a recount; no acked pair is lost."""
    rng = random.Random(SEED)
    data_dir = tmp_path / "lmdb"
    ledger = PlatformLedger()
    with Mosquitto(tmp_path) as broker:
        for rnd in range(ROUNDS):
            where = f"seed {SEED}, round {rnd}"
            problems: list[str] = []
            stop = threading.Event()
            threads: list[threading.Thread] = []
            # One server process, then a group of two sharing the port and the LMDB environment.
            with serving(data_dir, broker, processes=1 + rnd % 2) as srv, emqx_for(srv, broker, strict=False) as emqx:
                try:
                    for vin in rng.sample(FLEET, len(FLEET) // 2):  # the others stay offline: their rows wait
                        v = emqx.vehicle(vin)
                        v.connect()
                        v.subscribe()
                    threads = [
                        threading.Thread(
                            target=_sender,
                            args=(
                                emqx,
                                f"platform-{i}",
                                random.Random(rng.getrandbits(64)),
                                ledger,
                                rnd,
                                stop,
                                problems,
                            ),
                            name=f"platform-{rnd}-{i}",
                            daemon=True,
                        )
                        for i in range(SENDERS)
                    ]
                    for th in threads:
                        th.start()
                    threading.Event().wait(rng.uniform(*KILL_AFTER_S))  # the moment of the crash, not a sync point
                    assert srv.proc.poll() is None, f"{where}: server died by itself:\n{srv.log()}"
                finally:
                    srv.kill()
                    stop.set()
                    for th in threads:
                        th.join(30)
            assert not any(th.is_alive() for th in threads), f"{where}: a platform thread hangs"
            assert not problems, f"{where}: {problems}"
            errors, states = _audit(data_dir, ledger)
            assert not errors, f"{where}: " + "\n".join(errors[:20])

    acked = sum(s.acked for s in ledger.batches)
    print(
        f"\nkill9 outcomes: seed {SEED}, {ROUNDS} rounds, {acked}/{len(ledger.batches)} batches acknowledged, "
        f"{dict(ledger.kinds)}, pairs at the end {dict(states)}"
    )
    # Not vacuous: rows were delivered and superseded across the kills, and repeats were acknowledged.
    assert states["delivered"] > 0 and states["superseded"] > 0 and states["pending"] > 0, states
    assert acked >= ROUNDS * 5 and ledger.kinds["repeat"] > 0, (acked, ledger.kinds)


# -- a kill -9 between commit and receipt, then a retry ------------------------------------------
def test_a_kill9_between_commit_and_receipt_then_a_retry_delivers_once(tmp_path: Path) -> None:
    """Stored, its receipt lost to a SIGKILL, retried: the retry's receipt says duplicate, one delivery."""
    data_dir = tmp_path / "lmdb"
    vin, rid, data, batch_id = FLEET[0], "task_ota_1", "fw-1", "b-kill9-1"
    sha1 = sha1_of(data.encode())
    with Mosquitto(tmp_path) as broker:
        with serving(data_dir, broker) as first:
            poll(lambda: first.logged("mqtt_connected"))
            broker.stop()  # the receipt can only wait in the server's queue now
            poll(lambda: first.logged("mqtt_disconnected"))
            with emqx_for(first, broker) as emqx:
                reply = emqx.publish_batch([vin], rid, data, batch_id=batch_id)
            assert reply is not None and reply.type == pb.ValuedResponse.STOP_AND_RETURN, "the batch was stored"
        # serving() has SIGKILLed it with the receipt unpublished; the row is on disk.
        with Store(data_dir, readonly=True) as store, store.read() as txn:
            assert [r.sha1 for r in store.pending(vin)] == [sha1]
            assert txn.get(batch_id.encode(), db=store.tables.batches) is not None

        broker.start()
        platform = Platform(broker.port)
        try:
            with (
                serving(data_dir, broker) as second,
                Store(data_dir, readonly=True) as store,
                emqx_for(second, broker) as emqx,
            ):
                poll(lambda: second.logged("mqtt_connected"))
                vehicle = emqx.vehicle(vin)
                vehicle.connect()
                vehicle.subscribe()
                [got] = vehicle.wait_for(1)
                assert (got.topic, got.payload) == (f"agent/{vin}/proxy/request/{rid}", data.encode())
                # Retry only once the ack's delete is on disk: a retry that stored a row now would be a second delivery.
                poll(lambda: store.pending(vin) == [])
                reply = emqx.publish_batch([vin], rid, data, batch_id=batch_id)
                assert reply is not None and reply.type == pb.ValuedResponse.STOP_AND_RETURN
                # A later request to the same vehicle is the barrier: deliveries go oldest first,
                # so a second copy of the first would arrive before it (and its receipt after the retry's).
                emqx.publish_batch([vin], "task_cfg_9", "after")
                vehicle.wait_for(2)
                assert [r.topic.rsplit("/", 1)[1] for r in vehicle.received] == [rid, "task_cfg_9"]
                platform.wait(event="accepted", request_id="task_cfg_9")
                receipts = platform.events(event="accepted", request_id=rid)
                assert [r.get("duplicate") for r in receipts] == [True], f"one receipt, the retry's: {receipts}"
                assert receipts[0]["batch_id"] == batch_id
                assert (receipts[0]["sha1"], receipts[0]["vins"], receipts[0]["refused"]) == (sha1.hex(), 1, [])
                with store.read() as txn:
                    gen = outcomes.generation(txn, store.tables, rid, sha1)
                assert gen is not None and (gen.counts["total"], gen.counts["delivered"], gen.pending) == (1, 1, 0)
        finally:
            platform.close()
