"""PostgreSQL failover under continuous ingest (issue 14 item 4): a primary with a synchronous standby,
two server instances on the multi-host store_url, batches sent to both without a break; the primary
is killed -9 mid-ingest and the standby promoted. The scenario runs once (a module fixture); each
test checks one promise of it: nothing acknowledged lost, failed batches stored once when retried,
instances back by themselves, no hook answered late, health NOT_SERVING only past the grace.

The last two tests reduce a bug this scenario found to its deterministic core (a backend's FATAL
message read by an idle pool connection, as each backend sends one when its postmaster is killed):
asyncpg then raises InternalClientError, which the store's error translation let through, so the
hook answered UNKNOWN instead of UNAVAILABLE and the store watcher could die. Fixed
(storage/postgres/errors.FAILURES); they keep it fixed."""

from __future__ import annotations

import asyncio
import struct
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import grpc
import pytest

from exhook_server.backends.postgres import pgmode
from storage.errors import StorageError
from storage.lmdb.store import now_ms
from storage.postgres import migrate
from storage.postgres.writes import PgWrites
from testkit.harness import poll
from testkit.pg_cluster import PgCluster, find_bindir
from testkit.pg_failover import (
    HOOK_SERVICE,
    PROCESS_SERVICE,
    Batch,
    Call,
    Driver,
    FailoverRig,
    HealthWatch,
    Stored,
    Timeline,
    acked,
    check_stored,
    events,
    fail_over,
    ingest_events,
    never_acked,
    wait_acked,
)

pytestmark = pytest.mark.slow

VINS = 200
#: Short, so a call that waits on the database shows quickly; ample for a 200-row commit.
INGEST_TIMEOUT_S = 2.0
#: What an answer may take past ingest_timeout_s: scheduling on 2 shared cores (a loaded machine,
#: tests beside this one), not waiting. Still well short of the client's deadline (CLIENT_DEADLINE_S,
#: 10 s), which a hung call would reach.
ANSWER_MARGIN_S = 5.0
#: Instance 0 has a grace far longer than this failover: its health must stay SERVING.
PATIENT, PATIENT_GRACE_S = 0, 30.0
#: Instance 1's grace is shorter than the outage this test holds: NOT_SERVING, then SERVING again.
QUICK, QUICK_GRACE_S = 1, 1.0
#: From the promote to a new batch acknowledged by each instance, and to SERVING again.
RECOVERY_BOUND_S = 15.0
#: Batches acknowledged by each instance before the kill, and after the promote before the end.
WARM, SETTLE = 20, 10


@dataclass
class Failover:
    """What one run of the scenario produced, for the tests to judge."""

    timeline: Timeline
    calls: list[Call]  #: the driver's, in answer order
    failed: list[Batch]  #: batches never acknowledged by the driver's calls
    retries: list[Call]  #: the failed batches sent again after the failover, then once more
    stored: dict[int, Stored]  #: the promoted database's view of every batch, by number
    stored_events: Counter[str]  #: batch_stored events per request_id, both instances
    duplicate_events: Counter[str]  #: batch_duplicate events per batch_id, both instances
    health: HealthWatch  #: stopped; its samples remain
    logs: list[dict[str, list[dict[str, object]]]]  #: per instance: the store watcher's events


@pytest.fixture(scope="module")
def failover(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Failover]:
    """Run the scenario once: warm up, kill -9 the primary, hold the outage until both instances'
    watchers saw it (the quick one past its grace), promote, wait for both instances to
    acknowledge again, stop the driver, retry every failed batch twice, read the promoted database."""
    if find_bindir() is None:
        pytest.skip("no PostgreSQL binaries (initdb, pg_ctl) found: install postgresql-15 (scripts/bootstrap)")
    common = {"SDV_FANOUT_INGEST_TIMEOUT_S": str(INGEST_TIMEOUT_S)}
    envs = [
        {**common, "SDV_FANOUT_STORE_DOWN_GRACE_S": str(PATIENT_GRACE_S)},
        {**common, "SDV_FANOUT_STORE_DOWN_GRACE_S": str(QUICK_GRACE_S)},
    ]
    with FailoverRig(tmp_path_factory.mktemp("failover"), envs) as rig:
        health = HealthWatch(rig.ports).start()
        driver = Driver(rig.ports, per_instance=2, vins=VINS, pause_s=0.1).start()
        try:
            for instance in (PATIENT, QUICK):
                wait_acked(driver, WARM, started_after=0.0, instance=instance, timeout_s=60)
            patient = rig.servers[PATIENT]
            seen_before = len(events(patient, "store_unreachable"))

            def outage_seen(killed: float) -> None:
                # The outage lasts until the patient watcher has noticed it, the quick instance's
                # health was seen NOT_SERVING, and a batch has failed: each promise below is then
                # put to the test, whatever the machine's speed.
                poll(
                    lambda: (
                        len(events(patient, "store_unreachable")) > seen_before
                        and health.first(QUICK, "NOT_SERVING", after=killed)
                        and any(not c.ok and c.started >= killed for c in driver.calls())
                    ),
                    timeout_s=30,
                    interval_s=0.05,
                )

            timeline = fail_over(rig, outage_seen)
            for instance in (PATIENT, QUICK):
                wait_acked(driver, SETTLE, started_after=timeline.promoted, instance=instance, timeout_s=60)
            poll(lambda: health.first(QUICK, "SERVING", after=timeline.promote_started), timeout_s=30)
            driver.stop()
            calls = driver.calls()
            failed = never_acked(calls)
            retries = [driver.send(b, b.n % len(rig.ports)) for b in failed]
            retries += [driver.send(b, b.n % len(rig.ports)) for b in failed]
        finally:
            driver.stop()
            health.stop()
        assert rig.standby is not None
        stored = check_stored(rig.standby.dsn, sorted({c.batch for c in calls}, key=lambda b: b.n))
        rig.stop_servers()
        stored_events, duplicate_events = ingest_events(rig.servers)
        logs = [
            {name: events(s, name) for name in ("store_unreachable", "store_down", "store_reachable_again")}
            for s in rig.servers
        ]
        yield Failover(timeline, calls, failed, retries, stored, stored_events, duplicate_events, health, logs)


def test_no_acknowledged_batch_is_lost(failover: Failover) -> None:
    """Every batch whose hook answered OK, before or after the failover, is on the promoted standby:
    its receipt, a row per VIN with its payload, its generation counting each VIN once."""
    ok = {c.batch for c in failover.calls if c.ok}
    assert any(c.answered < failover.timeline.killed for c in failover.calls if c.ok)
    assert acked(failover.calls, started_after=failover.timeline.promoted), "nothing acknowledged after the promote"
    lost = sorted((b.n, failover.stored[b.n]) for b in ok if not failover.stored[b.n].whole(len(b.vins)))
    assert lost == [], f"{len(lost)} of {len(ok)} acknowledged batches lost or incomplete"


def test_failed_batches_retried_with_their_batch_id_are_stored_exactly_once(failover: Failover) -> None:
    """A batch answered with an error may or may not have landed; sent again with its batch_id after
    the failover it is acknowledged, stored whole once, and a second retry is a duplicate."""
    assert failover.failed, "no batch failed: the outage was not seen"
    bad = [c for c in failover.retries if not c.ok]
    assert bad == [], f"{len(bad)} retries not acknowledged"
    for b in failover.failed:
        assert failover.stored[b.n].whole(len(b.vins)), (b.batch_id, failover.stored[b.n])
        # Stored by at most one call (a first attempt that landed after its error answer logs
        # nothing: its retries are then duplicates), and the last retry always finds it stored.
        assert failover.stored_events[b.request_id] <= 1, b.batch_id
        assert failover.stored_events[b.request_id] + failover.duplicate_events[b.batch_id] == 2, b.batch_id


def test_instances_acknowledge_again_by_themselves_within_the_bound(failover: Failover) -> None:
    """Without a restart, each instance acknowledges a batch sent after the promote started within
    RECOVERY_BOUND_S of it."""
    t = failover.timeline
    for instance in (PATIENT, QUICK):
        [first, *_] = acked(failover.calls, started_after=t.promote_started, instance=instance)
        assert first.answered - t.promote_started <= RECOVERY_BOUND_S, (instance, first.answered - t.promote_started)


def test_no_hook_outlasts_ingest_timeout(failover: Failover) -> None:
    """No call hangs: each one, before, during and after the outage and the retries, is answered
    within ingest_timeout_s (plus scheduling margin), never by the client's deadline."""
    slowest = max(failover.calls + failover.retries, key=lambda c: c.seconds)
    assert slowest.seconds <= INGEST_TIMEOUT_S + ANSWER_MARGIN_S, slowest


def test_hooks_that_fail_during_the_outage_answer_unavailable(failover: Failover) -> None:
    """Every call that was not acknowledged was answered UNAVAILABLE (EMQX's failed_action, the
    platform's retry)."""
    errors = [c for c in failover.calls + failover.retries if not c.ok]
    assert any(c.code == grpc.StatusCode.UNAVAILABLE for c in errors), "no call failed: the outage was not seen"
    others = Counter((c.code.name, c.detail) for c in errors if c.code != grpc.StatusCode.UNAVAILABLE)
    assert others == Counter(), others


def test_health_stays_serving_through_an_outage_shorter_than_the_grace(failover: Failover) -> None:
    """The instance whose store_down_grace_s outlasts the failover saw the database go away (its
    watcher logged it) and still never reported its hook service, "" or the process NOT_SERVING."""
    assert failover.logs[PATIENT]["store_unreachable"], "the watcher never saw the outage"
    assert failover.logs[PATIENT]["store_down"] == []
    for service in ("", HOOK_SERVICE, PROCESS_SERVICE):
        states = {s for _, s in failover.health.samples(PATIENT, service)}
        assert states == {"SERVING"}, (service, states)


def test_health_turns_not_serving_only_past_the_grace_and_back_after_the_promote(failover: Failover) -> None:
    """The instance with a 1 s grace reports its hook service and "" (readiness) NOT_SERVING no
    sooner than the grace after the kill, SERVING again within the bound of the promote; the
    process (liveness) stays SERVING throughout."""
    t = failover.timeline
    for service in (HOOK_SERVICE, ""):
        down = failover.health.first(QUICK, "NOT_SERVING", after=0.0, service=service)
        assert down is not None and down - t.killed >= QUICK_GRACE_S, (service, down, t.killed)
        up = failover.health.first(QUICK, "SERVING", after=down, service=service)
        assert up is not None and up - t.promote_started <= RECOVERY_BOUND_S, (service, up, t.promote_started)
    [store_down] = failover.logs[QUICK]["store_down"]
    assert float(store_down["for_s"]) >= QUICK_GRACE_S  # type: ignore[arg-type]
    assert failover.logs[QUICK]["store_reachable_again"]
    assert {s for _, s in failover.health.samples(QUICK, PROCESS_SERVICE)} == {"SERVING"}


# -- the bug the scenario found, reduced to its deterministic core --------------------------------


def _fatal_message() -> bytes:
    """The ErrorResponse each backend sends when its postmaster is killed, before it exits."""
    fields = (
        (b"S", "FATAL"),
        (b"V", "FATAL"),
        (b"C", "57P02"),
        (b"M", "terminating connection due to unexpected postmaster exit"),
    )
    body = b"".join(k + v.encode() + b"\0" for k, v in fields) + b"\0"
    return b"E" + struct.pack("!i", 4 + len(body)) + body


def _with_dying_connection(cluster: PgCluster, name: str, work: Callable[[Any], Awaitable[object]]) -> object:
    """`work(pool)` on a pool of one connection that, when next handed out, has read a backend's
    FATAL message while idle and not yet the connection's end (the window a kill -9 opens)."""

    async def go() -> object:
        armed: list[bool] = []

        async def setup(conn: Any) -> None:
            if armed:
                armed.clear()
                # The asyncio Protocol callback, called as the event loop calls it on data.
                conn._protocol.data_received(_fatal_message())

        pool = await asyncpg.create_pool(cluster.new_database(name), min_size=1, max_size=1, setup=setup)
        try:
            async with pool.acquire() as conn:
                await migrate.migrate(conn)
            armed.append(True)
            return await work(pool)
        finally:
            pool.terminate()

    return asyncio.run(go())


def test_a_connection_dying_under_a_write_fails_it_as_a_storage_error(pg_cluster: PgCluster) -> None:
    """A pool connection that read its backend's FATAL message fails the write with StorageError
    (the hook's UNAVAILABLE), not asyncpg's InternalClientError."""

    async def store(pool: Any) -> object:
        return await PgWrites(pool, INGEST_TIMEOUT_S).store_batch(["VIN1"], "task_ota_1", b"data", now_ms(), "b-1")

    with pytest.raises(StorageError):
        _with_dying_connection(pg_cluster, "failover_dying_write", store)


def test_a_connection_dying_under_the_probe_is_a_failed_probe(pg_cluster: PgCluster) -> None:
    """The store watcher's probe on such a connection reports the database unreachable (False)
    instead of raising, which would end the watcher and freeze the hook services' health."""
    assert _with_dying_connection(pg_cluster, "failover_dying_probe", pgmode.probe) is False
