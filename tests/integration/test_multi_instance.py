"""Several `sdv-fanout serve` instances over one PostgreSQL (issue 14), next to a real mosquitto.

FakeEmqx spreads the hooks over the instances as EMQX's pool behind a Service would (a client's
hooks to the instance its pool connection landed on) or harsher (a random instance per call).
Vehicles hold each PUBACK back a little, so a second delivery sent while one is out shows up as a
PUBLISH received before the PUBACK of the one before. Without a crash nobody heartbeats, so every
delivery must be started by the hooks themselves; in the crash tests vehicles heartbeat every
second, as real ones do. One instance killed (-9) or stopped (SIGSTOP) mid-fan-out leaves the others
to finish; every row must end delivered, oldest first, in the database.

Two tests reproduce server bugs found here. A batch whose instance died right after storing it
waited for the vehicles' next heartbeat: fixed (the leader wakes online idle vehicles with work
every inflight_timeout_s). An instance stopped (SIGSTOP) inside a vehicle event kept that
vehicle's lock for as long as it was stopped: PostgreSQL ends such a transaction when it stalled
between statements (idle_in_transaction_session_timeout), the other instances end it when it
stalled inside one, between asyncpg's Parse and Bind (pgmode.end_stalled; no PostgreSQL 15 timeout
applies there: vehicles stayed short of their requests).

What "one in flight" means with a stopped instance: a request comes only after the vehicle acked
some copy of the one before (`overlaps`); another copy of that one may still be unacked, a re-send
after the in-flight timeout (the first copy's PUBACK was held past it by a hook call hung on the
stopped instance or by the stalled lock) or the stopped sender's own publish arriving late.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest

from exhook_server._proto import exhook_v3_pb2 as pb
from storage.lmdb.outcomes import Outcome
from storage.postgres.constants import LockClass
from testkit.emqx_sim import Acked, FakeEmqx, Mosquitto, Received, Vehicle
from testkit.exhook_pool import Routing
from testkit.harness import SubprocessServer, metric, poll, signal_all, stop
from testkit.pg_cluster import PgCluster

pytestmark = pytest.mark.slow

INSTANCES = 3
#: Each vehicle holds its PUBACK this long: the window in which a second delivery would show.
ACK_DELAY_S = 0.03
#: The in-flight timeout of the crash tests: what a dead instance had out is sent again after it.
INFLIGHT_TIMEOUT_S = 2.0
#: Vehicles of the crash tests.
CRASH_FLEET = 120
#: Deliveries carry this clientid prefix as `Message.from` (the server's default).
DELIVERY_CLIENTID = "sdv-fanout-multi"

_databases = itertools.count()


# ---------------------------------------------------------------------------------------------
# the rig: a database, a broker, instances, a fleet
# ---------------------------------------------------------------------------------------------


class Out(NamedTuple):
    """A delivery the database records as out: to whom, which request, since when, by whom."""

    vin: str
    request_id: str
    sent_ms: int
    sender: str


@dataclass
class Database:
    """One fresh database of the session's cluster, queried as the superuser through psql."""

    cluster: PgCluster
    name: str
    dsn: str

    def rows(self, sql: str) -> list[list[str]]:
        out = self.cluster.psql(sql, database=self.name)
        return [line.split("|") for line in out.splitlines() if line]

    def pending_rows(self) -> int:
        return int(self.rows("SELECT count(*) FROM rows")[0][0])

    def known_online(self, vins: Sequence[str]) -> int:
        """How many of `vins` have their presence recorded."""
        listed = ",".join(f"'{v}'" for v in vins)
        return int(self.rows(f"SELECT count(*) FROM presence WHERE vin IN ({listed})")[0][0])

    def out(self) -> list[Out]:
        """Every delivery recorded as out."""
        found = self.rows(
            "SELECT vin, request_id, sent_ms, coalesce(sender, '') FROM vin_state WHERE request_id IS NOT NULL"
        )
        return [Out(v, r, int(ms), s) for v, r, ms, s in found]

    def out_by(self, sender: str) -> list[Out]:
        return [o for o in self.out() if o.sender == sender]

    def outcomes(self) -> dict[tuple[str, str], int]:
        return {(v, r): int(c) for v, r, c in self.rows("SELECT vin, request_id, code FROM outcomes")}

    def settled(self) -> bool:
        """No row pending and no delivery out: everything ended."""
        return self.pending_rows() == 0 and not self.out()


@pytest.fixture
def db(pg_cluster: PgCluster) -> Database:
    name = f"multi_{os.getpid()}_{next(_databases)}"
    return Database(pg_cluster, name, pg_cluster.new_database(name))


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    with Mosquitto(tmp_path, verbose=False).start() as b:
        yield b


@contextmanager
def instances(
    tmp_path: Path, db: Database, broker: Mosquitto, n: int, *flags: str, processes: int = 1
) -> Iterator[list[SubprocessServer]]:
    """`n` instances (`processes` server processes each) on the database, started at once (each
    migrates under the advisory lock), their delivery clients connected; all stopped after."""

    def one(i: int) -> SubprocessServer:
        return SubprocessServer(
            tmp_path / f"instance{i}",
            "--store-url", db.dsn,
            "--mqtt-url", broker.url,
            "--processes", str(processes),
            "--store-pool-size", "6",
            "--shutdown-timeout-s", "5",  # a stalled instance's drain must not stretch the test
            *flags,
        )  # fmt: skip

    with ThreadPoolExecutor(n) as pool:
        started = [pool.submit(one, i) for i in range(n)]
    with contextlib.ExitStack() as stack:
        servers = [f.result() for f in started if f.exception() is None]
        for srv in servers:
            stack.callback(stop, srv)  # each one, whatever the others' stop raised
        for f in started:
            f.result()  # the first start that failed, raised
        poll(lambda: all(s.logged("mqtt_connected") for s in servers), timeout_s=30)
        yield servers


def delivery_clientid(srv: SubprocessServer) -> str:
    """The instance's MQTT delivery clientid (the `sender` of what it has out)."""
    return next(str(e["clientid"]) for e in srv.events() if e.get("event") == "mqtt_connected")


@contextmanager
def heartbeating(fleet: Sequence[Vehicle], interval_s: float = 1.0) -> Iterator[None]:
    """Every vehicle heartbeats every interval_s (`ecp/<vin>/online`), as real ones do, while the
    block runs: that is how a vehicle whose events died with an instance is found again."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(interval_s):
            for v in fleet:
                if done.is_set():
                    return
                if v.is_connected:
                    v.heartbeat()

    thread = threading.Thread(target=beat, name="heartbeats", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(30)


@dataclass
class Workload:
    """Requests for a fleet, each published as several batches (random senders, so random
    instances): what each vehicle must get, in store order."""

    vins: list[str]
    requests: int
    seed: int
    #: vin -> its request ids in the order they were stored
    expected: dict[str, list[str]] = field(default_factory=dict)

    def publish(self, emqx: FakeEmqx) -> None:
        rnd = random.Random(self.seed)
        self.expected = {vin: [] for vin in self.vins}
        for k in range(self.requests):
            rid = f"task_multi_{k:02d}"
            chosen = [v for v in self.vins if rnd.random() < 0.8]
            rnd.shuffle(chosen)
            chunks = [chosen[i : i + 40] for i in range(0, len(chosen), 40)]
            for chunk in chunks:
                # Batches of one request are stored one after another, so each VIN's rows keep
                # the request order whichever instance stores them.
                answer = emqx.publish_batch(
                    chunk, rid, f"{rid} payload".encode(), sender=f"platform-{rnd.randrange(1 << 30)}"
                )
                assert stored(answer), f"batch of {rid} not stored: {answer}"
                for vin in chunk:
                    self.expected[vin].append(rid)

    def total(self) -> int:
        return sum(map(len, self.expected.values()))


def stored(answer: pb.ValuedResponse | None) -> bool:
    return answer is not None and answer.message.headers.get("allow_publish") == "false"


def rid_of(topic: str) -> str:
    return topic.rsplit("/", 1)[1]


def firsts(v: Vehicle) -> list[str]:
    """The request ids the vehicle received, each at its first receipt, in receipt order."""
    seen: dict[str, None] = {}
    for r in sorted(v.received, key=lambda r: r.time):
        seen.setdefault(rid_of(r.topic), None)
    return list(seen)


def overlaps(vin: str, received: Sequence[Received], acks: Sequence[Acked]) -> list[str]:
    """PUBLISHes of one request received before the vehicle had PUBACKed any copy of a request it
    received earlier: two in flight.

    The server frees a vehicle's slot at the first PUBACK of its delivery that it handles, and
    without one it sends the same request again (after the in-flight timeout), never the next:
    so the next may come only after the vehicle acked some copy of the one before. It may come
    while another copy of that one is still unacked: a re-send whose first copy was acked late (a
    hook call hung on a stopped instance held that PUBACK past the in-flight timeout), or a
    stopped sender's publish that arrives when it continues. QoS 1 allows such duplicates."""
    first_ack: dict[str, float] = {}
    for a in acks:
        rid = rid_of(a.topic)
        first_ack[rid] = min(a.time, first_ack.get(rid, a.time))
    found = []
    before: dict[str, None] = {}  # requests received so far, in order
    for later in sorted(received, key=lambda r: r.time):
        rid = rid_of(later.topic)
        if rid in before:
            continue  # another copy of a request it got before: a duplicate, not a second delivery
        for earlier in before:
            if first_ack.get(earlier, float("inf")) > later.time:
                found.append(f"{vin}: {rid} received while {earlier} was unacked")
        before[rid] = None
    return found


def online_fleet(emqx: FakeEmqx, vins: Sequence[str], ack_delay_s: float = ACK_DELAY_S) -> list[Vehicle]:
    """Connect and subscribe every vehicle (16 at a time, as a fleet comes online); each holds
    its PUBACKs back `ack_delay_s`."""

    def up(vin: str) -> Vehicle:
        v = emqx.vehicle(vin)
        v.ack_delay_s = ack_delay_s
        v.connect()
        v.subscribe()
        return v

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(up, vins))


def all_received(fleet: Sequence[Vehicle], work: Workload) -> bool:
    return all(set(firsts(v)) >= set(work.expected[v.vin]) for v in fleet)


def wait_delivered(
    fleet: Sequence[Vehicle], work: Workload, db: Database, emqx: FakeEmqx, timeout_s: float = 60
) -> None:
    """Poll until every vehicle got every request and the database settled; on timeout, fail
    with what is missing and what the database holds for those vehicles."""
    try:
        poll(lambda: all_received(fleet, work), timeout_s=timeout_s, interval_s=0.05)
        poll(db.settled, timeout_s=30, interval_s=0.1)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{stuck_report(fleet, work, db, emqx)}") from None


def stuck_report(fleet: Sequence[Vehicle], work: Workload, db: Database, emqx: FakeEmqx) -> str:
    missing = [v for v in fleet if not set(firsts(v)) >= set(work.expected[v.vin])]
    lines = [
        f"{len(missing)} vehicles short; failovers {emqx.exhook.failovers}; "
        f"{len(emqx.rpc_errors)} failed rpcs {[h for h, _ in emqx.rpc_errors][:10]}; "
        f"rows pending {db.pending_rows()}; out {len(db.out())}"
    ]
    lines.append(
        "sessions (pid, state, xact age s, wait, query): "
        + str(
            db.rows(
                "SELECT pid, state, round(extract(epoch FROM now() - xact_start)::numeric, 1), "
                "coalesce(wait_event_type || ':' || wait_event, ''), translate(left(query, 60), E'\\n', ' ') "
                "FROM pg_stat_activity "
                f"WHERE datname = '{db.name}' AND state <> 'idle' AND pid <> pg_backend_pid()"
            )
        )
    )
    lines.append(
        "advisory locks (pid, granted, key): "
        + str(db.rows("SELECT pid, granted, classid || '/' || objid FROM pg_locks WHERE locktype = 'advisory'"))
    )
    for v in missing[:4]:
        q = f"'{v.vin}'"
        lines.append(
            f"{v.vin} connected={v.is_connected} got={firsts(v)} want={work.expected[v.vin]} "
            f"received={[(rid_of(r.topic), round(r.time % 1000, 3)) for r in v.received]} "
            f"acks={[(rid_of(a.topic), round(a.time % 1000, 3)) for a in v.pubacks]}\n"
            f"  rows={db.rows(f'SELECT request_id, ts_ms FROM rows WHERE vin = {q} ORDER BY ts_ms')}\n"
            f"  vin_state={db.rows(f'SELECT * FROM vin_state WHERE vin = {q}')}\n"
            f"  presence={db.rows(f'SELECT * FROM presence WHERE vin = {q}')}"
        )
    return "\n".join(lines)


def timeline(v: Vehicle) -> list[tuple[str, str, float]]:
    """What the vehicle received and PUBACKed ("got" or "ack", request id, time), in time order."""
    events = [("got", rid_of(r.topic), r.time) for r in v.received]
    events += [("ack", rid_of(a.topic), a.time) for a in v.pubacks]
    return [(what, rid, round(t % 1000, 3)) for what, rid, t in sorted(events, key=lambda e: e[2])]


def check_delivered(fleet: Sequence[Vehicle], work: Workload, db: Database, *, duplicates: bool) -> None:
    """Every vehicle got every request once (or, with `duplicates`, at least once) in store order,
    never two at once, and the database ended each row delivered."""
    problems: list[str] = []
    for v in fleet:
        want = work.expected[v.vin]
        if firsts(v) != want:
            problems.append(f"{v.vin}: got {firsts(v)}, stored {want}")
        if not duplicates and len(v.received) != len(want):
            problems.append(f"{v.vin}: {len(v.received)} PUBLISHes for {len(want)} requests: {timeline(v)}")
        problems += overlaps(v.vin, list(v.received), list(v.pubacks))
    assert problems == [], "\n".join(problems[:20])
    assert db.pending_rows() == 0 and db.out() == []
    ended = db.outcomes()
    want_ended = {(vin, rid) for vin, rids in work.expected.items() for rid in rids}
    assert set(ended) == want_ended
    assert set(ended.values()) == {int(Outcome.DELIVERED)}


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


def test_the_overlap_check_sees_a_delivery_received_before_the_puback_of_the_one_before() -> None:
    """The one-in-flight check flags a PUBLISH of another request received before the previous
    PUBACK (or with none), and passes re-sends of the same request and PUBLISHes after the PUBACK
    of any copy of the request before (another copy may still be unacked: QoS 1 duplicates)."""
    topic = "agent/V/proxy/request/"
    a1, b2, a3 = (
        Received(topic + "a", b"", 1, 10.0),
        Received(topic + "b", b"", 2, 10.5),
        Received(topic + "a", b"", 3, 10.2),
    )
    assert overlaps("V", [a1, b2], [Acked(a1.topic, b"", 1, 10.4)]) == []
    assert overlaps("V", [a1, b2], [Acked(a1.topic, b"", 1, 10.6)]) == ["V: b received while a was unacked"]
    assert overlaps("V", [a1, b2], []) == ["V: b received while a was unacked"]
    assert overlaps("V", [a1, a3], []) == []
    # The first copy acked before b, the re-send after: b came after the PUBACK of a.
    assert overlaps("V", [a1, a3, b2], [Acked(a1.topic, b"", 1, 10.3), Acked(a3.topic, b"", 3, 10.6)]) == []
    # Only the re-send acked, after b: b came while a was owed.
    assert overlaps("V", [a1, a3, b2], [Acked(a3.topic, b"", 3, 10.6)]) == ["V: b received while a was unacked"]
    # A late copy of a after b (a stopped sender's publish) makes no overlap of its own.
    late_a = Received(topic + "a", b"", 4, 10.7)
    assert overlaps("V", [a1, b2, late_a], [Acked(a1.topic, b"", 1, 10.4), Acked(b2.topic, b"", 2, 10.8)]) == []


@pytest.mark.parametrize("routing", ["per_client", "random"])
def test_three_instances_deliver_everything_once_oldest_first_one_at_a_time(
    routing: Routing, tmp_path: Path, db: Database, broker: Mosquitto
) -> None:
    """Hooks spread over 3 instances (per client, or a random instance per call): every vehicle gets
    every request once, in store order, never two in flight; every row ends delivered."""
    work = Workload([f"LMULTI{n:011d}" for n in range(150)], requests=4, seed=14)
    with instances(tmp_path, db, broker, INSTANCES) as servers:
        emqx = FakeEmqx(
            [s.port for s in servers], broker.port, delivery_clientid=DELIVERY_CLIENTID, routing=routing, seed=14
        )
        with emqx:
            emqx.load()
            fleet = online_fleet(emqx, work.vins)
            # No heartbeats: every wake-up must come from the hooks themselves.
            work.publish(emqx)
            wait_delivered(fleet, work, db, emqx)
            check_delivered(fleet, work, db, duplicates=False)
            # Each instance took hooks and sent deliveries: the fan-out was shared.
            assert all(emqx.exhook.answered[s.port] > 0 for s in servers)
            assert all(metric(s, "sdv_fanout_deliveries_sent_total") > 0 for s in servers)
            assert emqx.exhook.failovers == []


@contextmanager
def crash_rig(
    tmp_path: Path, db: Database, broker: Mosquitto, *, request_timeout_s: float = 5.0
) -> Iterator[tuple[list[SubprocessServer], FakeEmqx, Workload, list[Vehicle]]]:
    """3 instances with a short in-flight timeout; a fleet online and heartbeating (PUBACKs held
    0.2 s, so many deliveries are out at any moment), every batch stored: the fan-out under way."""
    work = Workload([f"LCRASH{n:011d}" for n in range(CRASH_FLEET)], requests=4, seed=9)
    flags = ("--inflight-timeout-s", str(INFLIGHT_TIMEOUT_S))
    with instances(tmp_path, db, broker, INSTANCES, *flags) as servers:
        # Calls that fail on the victim are the point here: recorded in rpc_errors, not raised.
        emqx = FakeEmqx(
            [s.port for s in servers],
            broker.port,
            delivery_clientid=DELIVERY_CLIENTID,
            seed=9,
            strict_rpc=False,
            request_timeout_s=request_timeout_s,
        )
        with emqx:
            emqx.load()
            fleet = online_fleet(emqx, work.vins, ack_delay_s=0.2)
            with heartbeating(fleet):
                work.publish(emqx)
                yield servers, emqx, work, fleet


def fanout_under_way(victim: SubprocessServer, db: Database, fleet: Sequence[Vehicle], work: Workload) -> str:
    """Wait until a fifth of the fan-out is done and the victim has deliveries out; its clientid."""
    clientid = delivery_clientid(victim)
    poll(lambda: sum(len(firsts(v)) for v in fleet) >= work.total() // 5, timeout_s=60, interval_s=0.02)
    poll(lambda: db.out_by(clientid), timeout_s=30, interval_s=0.02)
    return clientid


def check_resent_after_timeout(emqx: FakeEmqx, fleet: Sequence[Vehicle], out: Sequence[Out], struck_at: float) -> None:
    """What the victim had out reached its vehicle, and came again (from another instance) after
    the in-flight timeout, never before, when the victim's own copy did not come or its PUBACK
    died with the victim."""
    first_ack_answered: dict[tuple[str, str], bool] = {}
    for c in list(emqx.calls):
        if c.hook == "message.acked":
            key = (c.request.clientinfo.clientid, rid_of(c.request.message.topic))
            first_ack_answered.setdefault(key, c.response is not None)
    by_vin = {v.vin: v for v in fleet}
    for o in out:
        got = sorted(r.time for r in by_vin[o.vin].received if rid_of(r.topic) == o.request_id)
        assert got, f"{o} never reached its vehicle"
        due = o.sent_ms / 1000 + INFLIGHT_TIMEOUT_S - 0.05
        if got[0] > struck_at + 0.5:  # later than anything the victim itself had sent: a re-send
            assert got[0] >= due, f"{o} sent again too early: {got}"
        elif not first_ack_answered.get((o.vin, o.request_id), False):
            assert got[-1] >= due, f"{o}: its PUBACK was lost with the victim, never sent again: {got}"


def test_kill9_of_one_instance_mid_fanout_the_others_deliver_everything(
    tmp_path: Path, db: Database, broker: Mosquitto
) -> None:
    """kill -9 of one of 3 instances mid-fan-out: the other two deliver every row, oldest first, one
    at a time; what the dead one had out is sent again after the in-flight timeout (duplicates
    allowed, losses not)."""
    with crash_rig(tmp_path, db, broker) as (servers, emqx, work, fleet):
        victim = servers[0]
        clientid = fanout_under_way(victim, db, fleet, work)
        victim.proc.send_signal(signal.SIGKILL)
        struck_at = time.time()
        victim.kill()  # reaped
        out = db.out_by(clientid)
        wait_delivered(fleet, work, db, emqx)
        check_delivered(fleet, work, db, duplicates=True)
        check_resent_after_timeout(emqx, fleet, out, struck_at)
        assert victim.port in emqx.exhook.down and emqx.exhook.failovers


def test_kill9_mid_batch_keeps_every_committed_ack_and_sends_none_of_them_again(
    tmp_path: Path, db: Database, broker: Mosquitto
) -> None:
    """kill -9 of one of 3 instances while its vehicle events run in batches: every PUBACK whose
    save had committed stays recorded (its row stays ended `delivered`), and no vehicle gets such
    a row again (QoS 1 allows a second copy only of a message whose PUBACK was not recorded)."""
    with crash_rig(tmp_path, db, broker) as (servers, emqx, work, fleet):
        victim = servers[0]
        fanout_under_way(victim, db, fleet, work)
        delivered = f"SELECT vin, request_id FROM outcomes WHERE code = {int(Outcome.DELIVERED)}"
        poll(lambda: len(db.rows(delivered)) >= len(fleet) // 2, timeout_s=30, interval_s=0.02)
        victim.proc.send_signal(signal.SIGKILL)
        victim.kill()
        committed = {(vin, rid) for vin, rid in db.rows(delivered)}
        after = time.time() + 1.0  # a copy decided before the commit may still be on its way
        wait_delivered(fleet, work, db, emqx)
        check_delivered(fleet, work, db, duplicates=True)
        kept = {(vin, rid) for vin, rid in db.rows(delivered)}
        assert committed <= kept
        again = [(v.vin, rid_of(r.topic)) for v in fleet for r in v.received if r.time > after]
        assert not [pair for pair in again if pair in committed]


def tcp_ports(pids: Iterable[int]) -> set[int]:
    """The local TCP ports of the processes' sockets (from /proc: their database connections too)."""
    inodes: set[str] = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    ports = set()
    for pid in pids:
        for table in ("tcp", "tcp6"):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                cols = line.split()
                if cols[9] in inodes:
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def stop_mid_batch(victim: SubprocessServer, db: Database) -> tuple[list[list[str]], float]:
    """SIGSTOP the victim mid-fan-out, once its statements already sent have completed (a statement
    sent still completes, unless it waits for a lock). Returns (state, pid, objid) of the vehicle
    locks its stalled sessions still hold (none, unless a save was waiting for a row another
    session held: vehicle events take a vehicle's lock only inside their save statement) and when
    (time.time()) the SIGSTOP was sent: what it published before arrives around then."""
    ports = ",".join(map(str, tcp_ports({victim.proc.pid, *victim.pids})))
    held = (
        "SELECT a.state, l.pid, l.objid FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
        f"WHERE l.locktype = 'advisory' AND l.granted AND l.classid = {int(LockClass.VEHICLE)} "
        f"AND a.state <> 'idle' AND a.client_port IN ({ports})"
    )
    busy = (
        "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND wait_event_type IS DISTINCT FROM 'Lock' "
        f"AND client_port IN ({ports})"
    )
    stopped_at = time.time()
    signal_all(victim, signal.SIGSTOP)
    with contextlib.suppress(AssertionError):  # still busy after a second: it holds what it holds
        poll(lambda: db.rows(busy)[0][0] == "0", timeout_s=1, interval_s=0.01)
    return db.rows(held), stopped_at


def test_a_batch_whose_instance_dies_right_after_storing_it_reaches_online_vehicles_without_a_heartbeat(
    tmp_path: Path, db: Database, broker: Mosquitto
) -> None:
    """kill -9 of the instance that has just stored a batch (its answer is back, its dispatch has
    hardly begun): the surviving instances deliver the batch to every online vehicle."""
    vins = [f"LORPHN{n:011d}" for n in range(60)]
    flags = ("--inflight-timeout-s", str(INFLIGHT_TIMEOUT_S))
    with instances(tmp_path, db, broker, INSTANCES, *flags) as servers:
        victim = servers[0]
        emqx = FakeEmqx([s.port for s in servers], broker.port, delivery_clientid=DELIVERY_CLIENTID, strict_rpc=False)
        with emqx:
            emqx.load()
            fleet = online_fleet(emqx, vins)
            # Every vehicle known online before the kill: a subscribe the victim answered but had
            # not recorded yet would wait for the vehicle's next heartbeat, not what this tests.
            poll(lambda: db.known_online(vins) == len(vins), timeout_s=30, interval_s=0.05)
            # A platform client whose pool connection is on the victim.
            sender = next(
                f"platform-{i}" for i in itertools.count() if emqx.exhook.route(f"platform-{i}")[1] == victim.port
            )
            answer = emqx.publish_batch(vins, "task_orphan_1", b"orphan", sender=sender)
            victim.proc.send_signal(signal.SIGKILL)
            victim.kill()
            assert stored(answer)
            work = Workload(vins, requests=0, seed=0)
            work.expected = {vin: ["task_orphan_1"] for vin in vins}
            # What the victim had claimed goes again after the in-flight timeout; the rest when the
            # leader (another instance within seconds, if the victim led) wakes idle vehicles.
            wait_delivered(fleet, work, db, emqx, timeout_s=8 * INFLIGHT_TIMEOUT_S)
            check_delivered(fleet, work, db, duplicates=True)


@contextmanager
def row_locked(db: Database, table: str, vin: str) -> Iterator[None]:
    """Hold the vehicle's row of `table` FOR UPDATE in a transaction of our own while the block
    runs: a server transaction that writes it waits there, after everything it read before."""
    argv = [str(db.cluster.bindir / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1",
            "-p", str(db.cluster.port), "-U", "postgres", "-d", db.name]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    holder = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    assert holder.stdin is not None
    try:
        holder.stdin.write(f"BEGIN; SELECT 1 FROM {table} WHERE vin = '{vin}' FOR UPDATE;\n")
        holder.stdin.flush()
        holding = (
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'psql' AND state = 'idle in transaction'"
        )
        poll(lambda: db.rows(holding)[0][0] == "1", timeout_s=10)
        yield
        holder.stdin.write("COMMIT;\n")
    finally:
        holder.stdin.close()
        holder.wait(10)


def test_a_batch_stored_while_another_instance_handles_the_vehicles_puback_is_delivered_without_a_heartbeat(
    tmp_path: Path, db: Database, broker: Mosquitto
) -> None:
    """A batch stored (on one instance) while another instance is between reading a vehicle's
    queue and committing its PUBACK is delivered when that commit lands: no heartbeat needed (the
    lost wake-up between a batch's filter and a vehicle event, forced with a row lock)."""
    vin = "LWAKE000000000001"
    with instances(tmp_path, db, broker, INSTANCES) as servers:
        emqx = FakeEmqx([s.port for s in servers], broker.port, delivery_clientid=DELIVERY_CLIENTID)
        with emqx:
            emqx.load()
            [v] = online_fleet(emqx, [vin])
            v.auto_ack = False
            acking = emqx.exhook.route(vin)[1]
            sender = next(f"platform-{i}" for i in itertools.count() if emqx.exhook.route(f"platform-{i}")[1] != acking)
            storing = next(s for s in servers if s.port == emqx.exhook.route(sender)[1])
            assert stored(emqx.publish_batch([vin], "task_wake_1", b"one", sender=sender))
            v.wait_for(1)
            # The PUBACK's event reads the (now empty) queue, then waits to clear the slot.
            with row_locked(db, "vin_state", vin):
                assert v.ack_pending() == 1
                clearing = (
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND query LIKE '%sdv_vin_save%'"  # the event's save: it deletes the vin_state row
                )
                poll(lambda: db.rows(clearing)[0][0] == "1", timeout_s=10)
                filtered = metric(storing, "sdv_fanout_db_round_trips_total", 'purpose="batch_filter"')
                assert stored(emqx.publish_batch([vin], "task_wake_2", b"two", sender=sender))
                poll(
                    lambda: metric(storing, "sdv_fanout_db_round_trips_total", 'purpose="batch_filter"') > filtered,
                    timeout_s=10,
                )
                # Before the commit: task_wake_2 may come the moment the lock goes, and a PUBACK
                # held back then was never sent (the store never settled).
                v.auto_ack = True
            # Well within the leader's wake-idle pass (every inflight_timeout_s, 60 s here), which
            # would deliver it without the wake-up; on a loaded machine 4 s was not always enough.
            v.wait_for(2, timeout_s=20)
            poll(db.settled, timeout_s=30)
            assert [rid_of(r.topic) for r in v.received] == ["task_wake_1", "task_wake_2"]


def listeners_seen(srv: SubprocessServer) -> set[int]:
    """The other instances' policy listeners this instance learnt of (their backend pids)."""
    return {int(e["pid"]) for e in srv.events() if e.get("event") == "policy_listener_seen"}


def test_a_pause_stored_through_one_instance_holds_a_batch_stored_through_another_at_once(
    tmp_path: Path, db: Database, broker: Mosquitto
) -> None:
    """A pause stored through one instance is in force on every other before its publish is
    answered (their reload, policy_refresh_s, is an hour here: only the notice tells them): a batch
    published right after through another instance waits for the resume."""
    vin, rid = "LPAUSE00000000001", "task_paused_fleetwide"
    with instances(tmp_path, db, broker, INSTANCES, "--policy-refresh-s", "3600") as servers:
        emqx = FakeEmqx([s.port for s in servers], broker.port, delivery_clientid=DELIVERY_CLIENTID)
        with emqx:
            emqx.load()
            [v] = online_fleet(emqx, [vin])
            by_port = {s.port: s for s in servers}
            vehicles_at = emqx.exhook.route(vin)[1]
            senders = (f"platform-{i}" for i in itertools.count())
            setter = next(c for c in senders if emqx.exhook.route(c)[1] != vehicles_at)
            setting = emqx.exhook.route(setter)[1]
            batcher = next(c for c in senders if emqx.exhook.route(c)[1] not in (vehicles_at, setting))
            storing = by_port[emqx.exhook.route(batcher)[1]]
            # Each instance's listener knows the two others (what the storing one waits for).
            for srv in servers:
                poll(lambda srv=srv: len(listeners_seen(srv)) >= 2)  # type: ignore[misc]
            pause = json.dumps({"request_id": rid, "paused": True}).encode()
            assert stored(emqx.publish("$SDV-FANOUT/policy", pause, sender=setter))
            assert metric(by_port[setting], "sdv_fanout_policy_propagation_total", 'outcome="confirmed"') == 1
            assert all(metric(s, "sdv_fanout_campaigns_held") == 1 for s in servers)
            events = metric(storing, "sdv_fanout_db_round_trips_total", 'purpose="event"')
            assert stored(emqx.publish_batch([vin], rid, b"held", sender=batcher))
            # The storing instance offered the batch to the online vehicle (an event), and sent nothing.
            poll(lambda: metric(storing, "sdv_fanout_db_round_trips_total", 'purpose="event"') > events)
            assert metric(storing, "sdv_fanout_deliveries_sent_total") == 0, "delivered while paused"
            resumed_at = time.time()
            resume = json.dumps({"request_id": rid}).encode()
            assert stored(emqx.publish("$SDV-FANOUT/policy", resume, sender=setter))
            v.wait_for(1)
            assert v.received[0].time >= resumed_at
            poll(db.settled, timeout_s=30)


def test_two_processes_on_postgresql_both_serve_and_deliver_everything(
    tmp_path: Path, db: Database, broker: Mosquitto
) -> None:
    """`--processes 2` on PostgreSQL: hooks through the shared port reach both processes (no
    forwarding), and every vehicle gets every request once, in store order, one at a time."""
    work = Workload([f"LPROCS{n:011d}" for n in range(100)], requests=3, seed=2)
    with instances(tmp_path, db, broker, 1, "--log-level", "debug", processes=2) as [group]:
        assert len(group.pids) == 2
        # 16 connections over SO_REUSEPORT: all on one process has odds 2**-15.
        emqx = FakeEmqx(group.port, broker.port, delivery_clientid=DELIVERY_CLIENTID, pool_size=16)
        with emqx:
            emqx.load()
            fleet = online_fleet(emqx, work.vins)
            work.publish(emqx)
            wait_delivered(fleet, work, db, emqx)
            check_delivered(fleet, work, db, duplicates=False)
        # Both processes handled vehicles' hooks and sent their deliveries.
        sent_by = {e.get("process") for e in group.events() if e.get("event") == "delivery_sent"}
        assert sent_by == {0, 1}


# Last in the file: it leaves the most behind (a stopped instance, ended sessions).
def test_sigstop_of_one_instance_mid_fanout_the_others_deliver_everything(
    tmp_path: Path, db: Database, broker: Mosquitto
) -> None:
    """SIGSTOP of the leader of 3 instances mid-fan-out (its calls hang until EMQX's request
    timeout; a vehicle's lock it holds, if any, stays held until its session is ended): the
    other two deliver every row, oldest first, one at a time (re-sends after the in-flight timeout
    allowed), and one of them takes the lead; then it continues and stops."""
    with crash_rig(tmp_path, db, broker, request_timeout_s=2.0) as (servers, emqx, work, fleet):
        # The leader: its jobs (the idle vehicles' wake-up) must not stop with it.
        [victim] = poll(lambda: [s for s in servers if s.logged("leading")], timeout_s=10)
        others = [s for s in servers if s is not victim]
        clientid = fanout_under_way(victim, db, fleet, work)
        held, struck_at = stop_mid_batch(victim, db)
        out = db.out_by(clientid)
        try:
            # A stalled session's lock is freed after 5 s (pgmode.stall_bound_s), what the victim
            # had out is sent again after the in-flight timeout: about 8 s in all; 15 s of margin.
            wait_delivered(fleet, work, db, emqx, timeout_s=15)
            # Every stalled session was ended and its vehicle's lock freed: by PostgreSQL if it
            # stalled between statements (idle_in_transaction_session_timeout), by the other
            # instances if it stalled inside one (pgmode.end_stalled).
            if held:
                stalled = ",".join(pid for _, pid, _ in held)
                poll(lambda: not db.rows(f"SELECT pid FROM pg_stat_activity WHERE pid IN ({stalled})"), timeout_s=10)
            # Its silent leader connection was ended too (pgmode.end_stalled), and another leads.
            poll(lambda: any(s.logged("leading") for s in others), timeout_s=10)
            check_delivered(fleet, work, db, duplicates=True)
            check_resent_after_timeout(emqx, fleet, out, struck_at)
            assert victim.port in emqx.exhook.down
            assert {f.code for f in emqx.exhook.failovers} == {grpc.StatusCode.DEADLINE_EXCEEDED}
        finally:
            signal_all(victim, signal.SIGCONT)
        assert victim.terminate() == 0
