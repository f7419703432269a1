"""kill -9 in each lifecycle state of issue 13: nothing pending is lost, nothing is sent twice beyond QoS 1.

Real `sdv-fanout serve` subprocesses on one data dir, a real mosquitto, vehicles played by
testkit/emqx_sim.py. Each test SIGKILLs the server in one state (a cancel of every vehicle
half done, rows with an expires_at pending, a PUBACKed delivery awaiting its answer, a
random mix of all of them), reads the LMDB files as the crash left them, and restarts on
the same data dir. After every kill the stored counts equal a recount from rows and outcome
records, each vehicle's `backlogs` count equals its rows, and the by_request and deadlines
indexes name exactly the pending rows. Set KILL9_SEED to replay the random test.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from exhook_server._proto import admin_pb2
from exhook_server._proto import exhook_v3_pb2 as pb
from exhook_server.acks import rule_body
from exhook_server.config import Config
from storage.lmdb import keys, outcomes, queue
from storage.lmdb.batches import sha1_of
from storage.lmdb.outcomes import Outcome
from storage.lmdb.store import Store
from testkit.emqx_sim import FakeEmqx, Mosquitto, Vehicle
from testkit.harness import SubprocessServer, admin_call, poll
from tests.crash.test_kill9_outcomes import emqx_for
from tests.integration.test_status_topic import Platform

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("KILL9_SEED", "1313"))
#: GC off: it would collect outcome records, and the recount with them.
SERVER_ENV = {
    "SDV_FANOUT_GC_INTERVAL_S": "0",
    "SDV_FANOUT_WORKERS": "2",
    "SDV_FANOUT_PROGRESS_INTERVAL_S": "0.2",
    "SDV_FANOUT_EXPIRY_SWEEP_INTERVAL_S": "0.2",
}
#: A cancel of every vehicle of this many rows, max_rows_per_commit at a time, takes 30
#: transactions: a kill right after its hook answered lands in the middle.
CANCEL_FLEET = [f"LSVCANCEL{n:03d}" for n in range(120)]
CHUNK = 4


# -- plumbing -----------------------------------------------------------------------------------
@contextmanager
def serving(data_dir: Path, broker: Mosquitto, **settings: object) -> Iterator[SubprocessServer]:
    """`sdv-fanout serve` delivering through `broker` with these settings; SIGKILLed on exit."""
    env = {**SERVER_ENV, "SDV_FANOUT_MQTT_URL": broker.url}
    env.update({f"SDV_FANOUT_{name.upper()}": str(value) for name, value in settings.items()})
    srv = SubprocessServer(data_dir, env=env)
    try:
        yield srv
    finally:
        srv.kill()


@contextmanager
def listening(broker: Mosquitto) -> Iterator[Platform]:
    """The platform's status subscriber: it outlives the server processes."""
    platform = Platform(broker.port)
    try:
        yield platform
    finally:
        platform.close()


def online(emqx: FakeEmqx, vin: str, *, auto_ack: bool = True) -> Vehicle:
    v = emqx.vehicle(vin)
    v.auto_ack = auto_ack
    v.connect()
    v.subscribe()
    return v


def rids(v: Vehicle) -> list[str]:
    return [r.topic.rsplit("/", 1)[1] for r in v.received]


def answered(reply: pb.ValuedResponse | None) -> bool:
    """The hook's answer to a batch or cancel: STOP_AND_RETURN once it is on disk (or rejected:
    the batches here are valid, and the status topic would say so)."""
    return reply is not None and reply.type == pb.ValuedResponse.STOP_AND_RETURN


def cancel(emqx: FakeEmqx, request_id: str, ids: list[str] | None = None, **extra: Any) -> pb.ValuedResponse | None:
    doc: dict[str, Any] = {"request_id": request_id, **extra}
    if ids is not None:
        doc["ids"] = ids
    return emqx.publish("$SDV-FANOUT/cancel", json.dumps(doc).encode())


def in_flight(srv: SubprocessServer, vin: str) -> admin_pb2.InFlight | None:
    """The vehicle's delivery in flight, as the server's Admin API tells it."""
    vehicle = admin_call(srv.admin_port, "GetVehicle", admin_pb2.GetVehicleRequest(vin=vin))
    return vehicle.in_flight if vehicle.HasField("in_flight") else None


# -- the store as a crash left it ---------------------------------------------------------------
@dataclass
class Snapshot:
    """What the LMDB files hold, and every broken promise of its bookkeeping."""

    rows: dict[tuple[str, str], keys.Row]
    ended: dict[tuple[str, str, bytes], Outcome]
    responses: dict[tuple[str, str, bytes], bytes]
    cancel_jobs: list[str]
    errors: list[str] = field(default_factory=list)

    def counts(self, request_id: str, data: bytes) -> dict[str, int]:
        """A generation's counts as a recount from rows and outcomes gives them, without zeros."""
        sha1 = sha1_of(data)
        got: Counter[str] = Counter()
        for row in self.rows.values():
            if (row.request_id, row.sha1) == (request_id, sha1):
                got["pending"] += 1
        for (_, rid, digest), outcome in self.ended.items():
            if (rid, digest) == (request_id, sha1):
                got[outcome.label] += 1
        got["total"] = sum(got.values())
        return dict(got)


def audit(data_dir: Path) -> Snapshot:
    """Read the store read-only; `errors` lists every count or index that disagrees with the rows."""
    with Store(data_dir, readonly=True) as store, store.read() as txn:
        t = store.tables
        stored_counts = {(g.request_id, g.sha1): g.counts for g in outcomes.all_generations(txn, t)}
        recounted = outcomes.recount(txn, t)
        rows = {(r.vin, r.request_id): r for r in (keys.decode_row(k, v) for k, v in txn.cursor(t.ids))}
        ended = {keys.split_outcome_key(k): Outcome(keys.decode_outcome(v)[3]) for k, v in txn.cursor(t.outcomes)}
        responses = {keys.split_outcome_key(k): keys.outcome_response(v) for k, v in txn.cursor(t.outcomes)}
        backlogs = {bytes(k).decode(): queue.decode_count(v) for k, v in txn.cursor(t.backlogs)}
        by_request = {bytes(k) for k in txn.cursor(t.by_request).iternext(keys=True, values=False)}
        deadlines = {bytes(k) for k in txn.cursor(t.deadlines).iternext(keys=True, values=False)}
        jobs = [bytes(k).decode() for k in txn.cursor(t.cancels).iternext(keys=True, values=False)]
    snap = Snapshot(rows, ended, responses, jobs)
    for gen in sorted(stored_counts.keys() | recounted.keys()):
        if stored_counts.get(gen) != recounted.get(gen):
            where = f"generation {gen[0]}/{gen[1].hex()[:12]}"
            snap.errors.append(f"{where}: stored {stored_counts.get(gen)}, recount {recounted.get(gen)}")
    per_vin = Counter(vin for vin, _ in rows)
    for vin in sorted(per_vin.keys() | backlogs.keys()):
        counted = per_vin[vin] if per_vin[vin] >= queue.COUNTED_FROM else 0  # only long queues are counted
        if backlogs.get(vin, 0) != counted:
            snap.errors.append(f"{vin}: backlogs says {backlogs.get(vin, 0)}, it has {per_vin[vin]} rows")
    want_index = {keys.request_index_key(vin, rid) for vin, rid in rows}
    if by_request != want_index:
        snap.errors.append(f"by_request: {len(by_request - want_index)} extra, {len(want_index - by_request)} missing")
    want_deadlines = {keys.deadline_key(r.expires_ms, r.vin, r.request_id) for r in rows.values() if r.expires_ms}
    if deadlines != want_deadlines:
        snap.errors.append(
            f"deadlines: {len(deadlines - want_deadlines)} extra, {len(want_deadlines - deadlines)} missing"
        )
    for vin, rid, sha1 in ended:
        row = rows.get((vin, rid))
        if row is not None and row.sha1 == sha1:
            snap.errors.append(f"{vin}/{rid}/{sha1.hex()[:12]} is pending and has an outcome record too")
    return snap


def audited(data_dir: Path) -> Snapshot:
    snap = audit(data_dir)
    assert not snap.errors, "\n".join(snap.errors[:20])
    return snap


# -- (a) a cancel of every vehicle, cut short ---------------------------------------------------
@dataclass
class CutShort:
    """What `cancel_cut_short` saw: the store after the kill and at the end, and the event."""

    request_id: str
    old: bytes
    crashed: Snapshot
    final: Snapshot
    event: dict[str, Any]
    replaced: list[str]


def cancel_cut_short(tmp_path: Path) -> CutShort:
    """Rows of one request for 120 vehicles, three of them holding it unacked; a cancel of every
    vehicle, answered; a new version of the request for the two VINs its walk reaches last; kill -9
    (the job half done). Restart: the job resumes while vehicles come online behind a barrier."""
    data_dir, rid, old, new = tmp_path / "lmdb", "task_ota_7", b"fw-7", b"fw-7-fixed"
    limits = {"max_ids_per_batch": CHUNK, "max_rows_per_commit": CHUNK}
    held_vins, later_vins = CANCEL_FLEET[:3], CANCEL_FLEET[3:9]
    replaced = sorted(CANCEL_FLEET)[-2:]  # the cancel walks VINs in order: these come last
    with Mosquitto(tmp_path) as broker, listening(broker) as platform:
        with serving(data_dir, broker, **limits) as first, emqx_for(first, broker, strict=False) as emqx:
            # Three vehicles get the request before the cancel and never PUBACK it: out when cancelled.
            held = [online(emqx, vin, auto_ack=False) for vin in held_vins]
            for part in range(0, len(CANCEL_FLEET), CHUNK):
                assert answered(emqx.publish_batch(CANCEL_FLEET[part : part + CHUNK], rid, old.decode()))
            for v in held:
                v.wait_for(1)
            assert answered(cancel(emqx, rid, correlation_id="stop-7"))
            reply = emqx.publish_batch(replaced, rid, new.decode())  # after the cancel: past its cut
            first.kill()
            assert answered(reply)
        assert [rids(v) for v in held] == [[rid]] * len(held), "nothing was sent after the cancel answered"
        crashed = audited(data_dir)
        assert crashed.cancel_jobs == [rid], "the kill came after the cancel's last chunk: nothing to resume"
        assert {crashed.rows[vin, rid].sha1 for vin in replaced} == {sha1_of(new)}

        with serving(data_dir, broker, **limits) as second, emqx_for(second, broker) as emqx:
            for part in (held_vins, later_vins[:CHUNK], later_vins[CHUNK:]):
                assert answered(emqx.publish_batch(part, "task_cfg_7", "cfg-7"))
            vehicles = [online(emqx, vin) for vin in held_vins + later_vins]
            fixed = [online(emqx, vin) for vin in replaced]
            [event] = platform.wait(event="cancelled", request_id=rid)
            assert second.logged("cancel_resumed")
            for v in vehicles + fixed:
                v.wait_for(1)
            # The cancelled rows are older than task_cfg_7: had any of them been visible, it came first.
            assert [rids(v) for v in vehicles] == [["task_cfg_7"]] * len(vehicles)
            assert [(r.topic.rsplit("/", 1)[1], r.payload) for v in fixed for r in v.received] == [(rid, new)] * 2
            poll(lambda: audit(data_dir).counts("task_cfg_7", b"cfg-7").get("delivered") == len(vehicles))
            poll(lambda: audit(data_dir).counts(rid, new) == {"total": 2, "delivered": 2})
            assert len(platform.events(event="cancelled", request_id=rid)) == 1
        final = audited(data_dir)
        assert [rids(v) for v in vehicles] == [["task_cfg_7"]] * len(vehicles), "nothing came after the barrier"
    return CutShort(rid, old, crashed, final, event, replaced)


def test_a_cancel_of_every_vehicle_cut_short_by_kill9_resumes_and_none_of_its_rows_is_sent(tmp_path: Path) -> None:
    """Killed right after the cancel's hook answered (its job half done): the restart resumes
    it, none of the rows it took is ever sent, `cancelled` comes once, newer rows survive it."""
    run = cancel_cut_short(tmp_path)
    total = len(CANCEL_FLEET)
    done = run.crashed.counts(run.request_id, run.old).get("cancelled", 0)
    assert 0 < done < total, done
    assert run.final.cancel_jobs == []
    ended = run.final.counts(run.request_id, run.old)
    # The two rows replaced after the cancel end superseded today (see the strict test below).
    assert ended["total"] == total and ended["cancelled"] + ended.get("superseded", 0) == total, ended
    superseded = {
        vin
        for (vin, rid, digest), outcome in run.final.ended.items()
        if (rid, digest, outcome) == (run.request_id, sha1_of(run.old), Outcome.SUPERSEDED)
    }
    assert superseded <= set(run.replaced), superseded
    assert (run.event["cancelled"], run.event["in_flight"], run.event["correlation_id"]) == (
        ended["cancelled"],
        0,
        "stop-7",
    )


def test_rows_a_cancel_took_end_cancelled_even_when_a_newer_batch_replaces_them_before_its_walk(
    tmp_path: Path,
) -> None:
    """Every row stored before the cancel ends cancelled, also those a newer batch replaced
    after the cancel answered and before its (resumed) walk reached them."""
    run = cancel_cut_short(tmp_path)
    total = len(CANCEL_FLEET)
    assert run.final.counts(run.request_id, run.old) == {"total": total, "cancelled": total}
    assert run.event["cancelled"] == total


# -- (b) expiry across a kill -------------------------------------------------------------------
def test_rows_with_an_expires_at_pending_across_kill9_are_never_sent_once_past_and_end_expired(tmp_path: Path) -> None:
    """Rows stored with an expires_at a moment away, one already out to its vehicle: after a kill
    and a restart past that moment none is sent (again), all end expired; later ones still go."""
    data_dir = tmp_path / "lmdb"
    vins = ["LSVEXPIRE01", "LSVEXPIRE02", "LSVEXPIRE03"]
    with Mosquitto(tmp_path) as broker:
        with serving(data_dir, broker) as first, emqx_for(first, broker, strict=False) as emqx:
            out = online(emqx, vins[0], auto_ack=False)  # gets it before the kill, never PUBACKs it
            expires = int(time.time() * 1000) + 2000
            assert answered(emqx.publish_batch(vins, "task_unlock_5", "open", expires_at=expires))
            assert answered(emqx.publish_batch(vins, "task_cfg_5", "cfg-5"))
            assert answered(
                emqx.publish_batch(vins, "task_later_5", "later", expires_at=int(time.time() * 1000) + 60_000)
            )
            out.wait_for(1)
            first.kill()
        assert rids(out) == ["task_unlock_5"]
        crashed = audited(data_dir)
        assert crashed.counts("task_unlock_5", b"open") == {"total": 3, "pending": 3}, "nothing pending is lost"
        assert time.time() * 1000 < expires, "the kill came after the expiry: raise its delay"

        with serving(data_dir, broker) as second, emqx_for(second, broker) as emqx:
            poll(lambda: time.time() * 1000 > expires + 5, timeout_s=5)  # the wall clock passing it is the point
            vehicles = [online(emqx, vin) for vin in vins]
            for v in vehicles:
                v.wait_for(2)
            poll(lambda: audit(data_dir).counts("task_unlock_5", b"open") == {"total": 3, "expired": 3})
            poll(lambda: audit(data_dir).counts("task_later_5", b"later") == {"total": 3, "delivered": 3})
            assert [rids(v) for v in vehicles] == [["task_cfg_5", "task_later_5"]] * 3
        final = audited(data_dir)
        assert final.counts("task_cfg_5", b"cfg-5") == {"total": 3, "delivered": 3}
        assert not final.rows


# -- (c) an answer awaited across a kill --------------------------------------------------------
@contextmanager
def driving(srv: SubprocessServer, broker: Mosquitto, events: str, *, strict: bool = True) -> Iterator[FakeEmqx]:
    """`emqx_for`; with vehicle events over MQTT, provisioned as `emqx sync` would (the ack rule, to
    this server's delivery client) once the server's events member and ack topic are subscribed."""
    if events == "hooks":
        with emqx_for(srv, broker, strict=strict) as emqx:
            yield emqx
        return
    cfg = Config(mqtt_url=broker.url, vehicle_events="mqtt")
    connected = poll(lambda: next((e for e in srv.events() if e.get("event") == "mqtt_connected"), None))
    clientid = connected["clientid"]
    poll(lambda: srv.logged("events_subscribed") and f" {cfg.rule_ack_topic_prefix}/{clientid}" in broker.log())
    with emqx_for(srv, broker, strict=strict, delivery_clientid=clientid) as emqx:
        emqx.add_rule(rule_body(cfg))
        assert emqx.hooks is not None and "message.acked" not in emqx.hooks, "the server took the MQTT mode"
        yield emqx


@pytest.mark.parametrize("events", ["hooks", "mqtt"])
def test_a_request_awaiting_its_answer_across_kill9_is_not_sent_again_and_the_answer_ends_it(
    tmp_path: Path, events: str
) -> None:
    """PUBACKed, its answer awaited and that state committed, the server killed: after the restart
    the request still holds the vehicle's slot without being sent again (the awaited state is on
    disk), and the vehicle's answer ends it `responded`; then the next request goes. With vehicle
    events as hook calls and over MQTT (the PUBACK through the ack rule, the answer through the
    restarted server's shared subscription)."""
    data_dir, vin = tmp_path / "lmdb", "LSVANSWER01"
    mode = {"vehicle_events": events}
    with Mosquitto(tmp_path) as broker, listening(broker) as platform:
        with serving(data_dir, broker, **mode) as first, driving(first, broker, events, strict=False) as emqx:
            v = online(emqx, vin)
            assert answered(emqx.publish_batch([vin], "task_diag_6", "diag-6", await_response=True))
            assert answered(emqx.publish_batch([vin], "task_cfg_6", "cfg-6"))
            v.wait_for(1)
            entry = poll(lambda: (e := in_flight(first, vin)) is not None and e.acked_age_ms > 0 and e)
            assert (entry.request_id, entry.await_response) == ("task_diag_6", True), "PUBACKed, the answer awaited"
            # The awaited state reaches the disk with the next commit window (ack_commit_delay_ms):
            # kill only once it is there, so the test does not race that window.
            with Store(data_dir, readonly=True) as store:
                poll(lambda: store.tried(vin, "task_diag_6", sha1_of(b"diag-6"), 1 << 62).acked_ms > 0)
            first.kill()
        assert rids(v) == ["task_diag_6"], "the PUBACK did not free the slot"
        crashed = audited(data_dir)
        assert crashed.counts("task_diag_6", b"diag-6") == {"total": 1, "pending": 1}

        with serving(data_dir, broker, **mode) as second, driving(second, broker, events) as emqx:
            again = online(emqx, vin)
            restored = poll(lambda: (e := in_flight(second, vin)) is not None and e.acked_age_ms > 0 and e)
            assert restored.request_id == "task_diag_6", "the awaited delivery holds the slot again"
            again.respond("task_diag_6", b'{"dtc": ["P0420"]}')
            [answer] = platform.wait(event="response", request_id="task_diag_6")
            assert (answer["vin"], answer["payload"]) == (vin, '{"dtc": ["P0420"]}')
            again.wait_for(1)
            poll(lambda: audit(data_dir).counts("task_cfg_6", b"cfg-6") == {"total": 1, "delivered": 1})
        assert rids(again) == ["task_cfg_6"], "not sent again, then the next one"
        final = audited(data_dir)
        assert final.counts("task_diag_6", b"diag-6") == {"total": 1, "responded": 1}
        assert final.responses[vin, "task_diag_6", sha1_of(b"diag-6")] == b'{"dtc": ["P0420"]}'


# -- (d) a random mix, killed at random moments -------------------------------------------------
ROUNDS = 3
MIX_FLEET = [f"LSVMIX{n:04d}" for n in range(24)]
MIX_REQUESTS = [f"task_{kind}_{n}" for kind in ("ota", "diag") for n in range(3)]
MIX_SETTINGS = {"max_pending_per_vehicle": 3, "max_ids_per_batch": 6, "max_rows_per_commit": 6}


@dataclass
class MixLedger:
    """Batches whose hook answered (stored), by batch_id; what the platform heard back."""

    stored: dict[str, tuple[tuple[str, ...], str, bytes]] = field(default_factory=dict)
    kinds: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _platform_loop(
    emqx: FakeEmqx, rng: random.Random, ledger: MixLedger, rnd: int, stop: threading.Event, problems: list[str]
) -> None:
    """Batches (some expiring soon, some awaiting answers, some refused at the bound) and cancels."""
    serial = 0
    try:
        while not stop.is_set():
            serial += 1
            rid = rng.choice(MIX_REQUESTS)
            if rng.random() < 0.12:
                ids = None if rng.random() < 0.5 else rng.sample(MIX_FLEET, 3)
                kind = "cancel_all" if ids is None else "cancel_some"
                reply = cancel(emqx, rid, ids)
            else:
                vins = tuple(rng.sample(MIX_FLEET, rng.randint(1, 6)))
                data = f"r{rnd}-{serial}-{rng.randrange(3)}".encode()
                extra: dict[str, Any] = {"batch_id": f"b{rnd}-{serial}"}
                if rng.random() < 0.3:
                    extra["expires_at"] = int(time.time() * 1000) + rng.randint(50, 1500)
                if rid.startswith("task_diag"):
                    extra["await_response"] = True
                kind = "batch"
                reply = emqx.publish_batch(list(vins), rid, data.decode(), **extra)
                if answered(reply):
                    with ledger.lock:
                        ledger.stored[extra["batch_id"]] = (vins, rid, data)
            if reply is None:
                return  # the server died under the call
            if not answered(reply):
                problems.append(f"{kind} of {rid} answered {reply.type}")
                return
            with ledger.lock:
                ledger.kinds[kind] += 1
    except Exception as exc:  # surfaced by the test, never swallowed
        problems.append(f"platform failed: {exc!r}")


def _answer_loop(vehicles: list[Vehicle], stop: threading.Event, problems: list[str]) -> None:
    """Vehicles answer every diag request they received, once per copy."""
    answered = Counter[tuple[str, int]]()
    try:
        while not stop.is_set():
            for v in vehicles:
                for i, got in enumerate(list(v.received)):
                    rid = got.topic.rsplit("/", 1)[1]
                    if rid.startswith("task_diag") and not answered[v.vin, i]:
                        answered[v.vin, i] = 1
                        v.respond(rid, b"ok:" + got.payload)
            stop.wait(0.01)  # a polling period, not a synchronisation
    except Exception:
        # A respond cut short by the kill (the vehicle's lane was closed): not a finding.
        if not stop.is_set():
            problems.append("answer loop failed before the kill")


def test_random_batches_cancels_expiries_and_answers_killed_at_random_keep_counts_and_backlogs_exact(
    tmp_path: Path,
) -> None:
    """Random kill -9 amid batches (expiring, awaiting answers, refused at the backlog bound),
    cancels and answers: counts equal a recount, backlogs equal rows, no stored pair is lost."""
    rng = random.Random(SEED)
    data_dir = tmp_path / "lmdb"
    ledger = MixLedger()
    with Mosquitto(tmp_path) as broker, listening(broker) as platform:
        for rnd in range(ROUNDS):
            where = f"seed {SEED}, round {rnd}"
            problems: list[str] = []
            stop = threading.Event()
            threads: list[threading.Thread] = []
            with (
                serving(data_dir, broker, **MIX_SETTINGS) as srv,
                emqx_for(srv, broker, strict=False) as emqx,
            ):
                try:
                    vehicles = [online(emqx, vin) for vin in rng.sample(MIX_FLEET, len(MIX_FLEET) // 3)]
                    threads = [
                        threading.Thread(
                            target=_platform_loop,
                            args=(emqx, random.Random(rng.getrandbits(64)), ledger, rnd, stop, problems),
                            daemon=True,
                        ),
                        threading.Thread(target=_answer_loop, args=(vehicles, stop, problems), daemon=True),
                    ]
                    for th in threads:
                        th.start()
                    threading.Event().wait(rng.uniform(0.4, 0.9))  # the moment of the crash, not a sync point
                    assert srv.proc.poll() is None, f"{where}: server died by itself:\n{srv.log()}"
                finally:
                    srv.kill()
                    stop.set()
                    for th in threads:
                        th.join(30)
            assert not any(th.is_alive() for th in threads), f"{where}: a test thread hangs"
            assert not problems, f"{where}: {problems}"
            snap = audit(data_dir)
            assert not snap.errors, f"{where}: " + "\n".join(snap.errors[:20])
            refused = {
                (r["vin"], e["batch_id"]) for e in platform.events(event="accepted") for r in e.get("refused", [])
            }
            for batch_id, (vins, rid, data) in ledger.stored.items():
                for vin in vins:
                    row = snap.rows.get((vin, rid))
                    if (row is not None and row.sha1 == sha1_of(data)) or (vin, rid, sha1_of(data)) in snap.ended:
                        continue
                    # Refused at the bound says the receipt; a receipt the kill lost leaves it unknown.
                    receipts = platform.events(event="accepted", batch_id=batch_id)
                    assert (vin, batch_id) in refused or not receipts, (
                        f"{where}: stored {vin}/{rid}/{data!r} ({batch_id}) is neither pending, ended nor refused"
                    )

        # A last start: cancels cut short finish, rows past their expiry end expired.
        with serving(data_dir, broker, **MIX_SETTINGS) as srv:
            poll(lambda: not audit(data_dir).cancel_jobs, timeout_s=15)
            now = int(time.time() * 1000)
            poll(lambda: not any(0 < r.expires_ms <= now for r in audit(data_dir).rows.values()), timeout_s=15)
        final = audited(data_dir)
        at_bound = sum(len(e.get("refused", [])) for e in platform.events(event="accepted"))
    states = Counter(o.label for o in final.ended.values())
    print(
        f"\nkill9 lifecycle: seed {SEED}, {dict(ledger.kinds)}, {at_bound} rows refused at the bound, "
        f"pairs at the end {dict(states)}"
    )
    # Not vacuous: every way to end took part, across the kills, and vehicles reached the bound.
    assert ledger.kinds["cancel_all"] and ledger.kinds["cancel_some"] and at_bound, (ledger.kinds, at_bound)
    assert {"delivered", "cancelled", "expired", "responded"} <= states.keys(), states
