"""The dispatch rules of one worker, driven command by command with in-memory seams."""

from __future__ import annotations

import asyncio
import pickle
import tracemalloc

import pytest

from exhook_server.backends.lmdb.pool import Dispatcher
from exhook_server.dispatch.commands import (
    Acknowledge,
    BrokerBack,
    BrokerLost,
    Connected,
    Down,
    EndReason,
    MaybeSend,
    NodeRestarted,
    Session,
    Sweep,
    Trigger,
)
from exhook_server.dispatch.worker import Worker
from tests.dispatch_fakes import ManualClock, MemoryRows, RecordingPublisher, sha1

S1 = Session("emqx@n1", "VIN1", "10.0.0.1", 40001)
S2 = Session("emqx@n1", "VIN1", "10.0.0.1", 40002)
OLD_EMQX = Session("emqx@n1", "VIN1", "10.0.0.1", 0)  # EMQX < 5.4: no peerport


class Rig:
    def __init__(self) -> None:
        self.rows = MemoryRows()
        self.pub = RecordingPublisher()
        self.clock = ManualClock()
        self.worker = Worker("w0", self.rows, self.pub, inflight_timeout_s=60, clock=self.clock)

    def do(self, *cmds: object) -> None:
        for cmd in cmds:
            self.worker.handle(cmd)  # type: ignore[arg-type]

    def ack_last(self, session: Session = S1) -> None:
        vin, rid, payload = self.pub.sent[-1]
        self.do(Acknowledge(vin, session, rid, sha1(payload)))

    @property
    def sent_rids(self) -> list[str]:
        return [rid for _, rid, _ in self.pub.sent]


@pytest.fixture
def rig() -> Rig:
    return Rig()


def test_new_batch_without_session_sends_nothing(rig: Rig) -> None:
    """An offline vehicle gets nothing, however many batches arrive."""
    rig.rows.add("VIN1", "task_a_1", b"x")
    rig.do(MaybeSend(Trigger.NEW_BATCH, "VIN1"))
    assert rig.pub.sent == []


def test_subscribe_sends_oldest_first_then_one_at_a_time(rig: Rig) -> None:
    """A subscription sends the oldest row; later triggers wait for its ack."""
    rig.rows.add("VIN1", "task_b_1", b"first")
    rig.rows.add("VIN1", "task_a_1", b"second")
    rig.do(
        MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S1),
        MaybeSend(Trigger.NEW_BATCH, "VIN1"),
        MaybeSend(Trigger.HEARTBEAT, "VIN1", S1),
    )
    assert rig.sent_rids == ["task_b_1"]
    rig.ack_last()
    assert rig.sent_rids == ["task_b_1", "task_a_1"]
    rig.ack_last()
    assert rig.rows.rows == {} and rig.worker.inflight == {}


def test_new_batch_reaches_online_vehicle(rig: Rig) -> None:
    """A batch for a vehicle that is already subscribed is sent at once."""
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S1))
    rig.rows.add("VIN1", "task_a_1", b"x")
    rig.do(MaybeSend(Trigger.NEW_BATCH, "VIN1"))
    assert rig.sent_rids == ["task_a_1"]


def test_heartbeat_repairs_missed_triggers(rig: Rig) -> None:
    """A heartbeat from a vehicle we knew nothing about (e.g. after our restart) sends its queue."""
    rig.rows.add("VIN1", "task_a_1", b"x")
    rig.do(MaybeSend(Trigger.HEARTBEAT, "VIN1", Session("emqx@n1", "VIN1", "10.0.0.1")))
    assert rig.sent_rids == ["task_a_1"]


def test_heartbeat_keeps_the_precise_session(rig: Rig) -> None:
    """A heartbeat (no peerport) does not overwrite the subscribe's identity of the same connection."""
    rig.do(
        MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S1),
        MaybeSend(Trigger.HEARTBEAT, "VIN1", Session("emqx@n1", "VIN1", "10.0.0.1")),
    )
    assert rig.worker.presence["VIN1"] == S1


def test_resume_repoints_inflight_without_resending(rig: Rig) -> None:
    """session.resumed moves the in-flight entry to the new connection; the broker redelivers it."""
    rig.rows.add("VIN1", "task_a_1", b"x")
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S1))
    rig.do(Down("VIN1", S1, EndReason.OFFLINE))  # persistent session: disconnected(normal)
    rig.do(
        MaybeSend(Trigger.SESSION_RESUMED, "VIN1", S2),
        Down("VIN1", S1, EndReason.TAKENOVER),
        Connected("VIN1", S2),
        MaybeSend(Trigger.HEARTBEAT, "VIN1", S2),
    )
    assert rig.sent_rids == ["task_a_1"]
    assert rig.worker.inflight["VIN1"].session == S2
    rig.ack_last(S2)
    assert rig.rows.rows == {}


def test_resume_with_nothing_in_flight_sends(rig: Rig) -> None:
    """A resumed session with an idle queue gets its oldest row."""
    rig.rows.add("VIN1", "task_a_1", b"x")
    rig.do(MaybeSend(Trigger.SESSION_RESUMED, "VIN1", S2))
    assert rig.sent_rids == ["task_a_1"]


def test_late_disconnect_of_old_connection_keeps_new_one(rig: Rig) -> None:
    """A reconnect seen before the old connection's disconnect: the late disconnect clears nothing."""
    rig.rows.add("VIN1", "task_a_1", b"x")
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S1), MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S2))
    assert rig.sent_rids == ["task_a_1", "task_a_1"]  # the old connection's delivery died with it
    rig.do(Down("VIN1", S1, EndReason.OFFLINE), Down("VIN1", S1, EndReason.TERMINATED))
    assert rig.worker.presence["VIN1"] == S2 and rig.worker.inflight["VIN1"].session == S2


def test_discard_clears_inflight_and_new_subscription_resends(rig: Rig) -> None:
    """A clean-start reconnect (old session discarded) sends the unacked request again."""
    rig.rows.add("VIN1", "task_a_1", b"x")
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", OLD_EMQX))
    rig.do(Down("VIN1", OLD_EMQX, EndReason.DISCARDED), Down("VIN1", OLD_EMQX, EndReason.DISCARDED))
    assert "VIN1" not in rig.worker.inflight and "VIN1" not in rig.worker.presence
    rig.do(Connected("VIN1", OLD_EMQX), MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", OLD_EMQX))
    assert rig.sent_rids == ["task_a_1", "task_a_1"]


def test_takeover_does_not_double_send(rig: Rig) -> None:
    """Resume plus takeover disconnect, even on EMQX < 5.4 (same identity), sends once."""
    rig.rows.add("VIN1", "task_a_1", b"x")
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", OLD_EMQX))
    rig.do(
        MaybeSend(Trigger.SESSION_RESUMED, "VIN1", OLD_EMQX),
        Down("VIN1", OLD_EMQX, EndReason.TAKENOVER),
        Connected("VIN1", OLD_EMQX),
        MaybeSend(Trigger.HEARTBEAT, "VIN1", OLD_EMQX),
    )
    assert rig.sent_rids == ["task_a_1"]
    assert rig.worker.presence["VIN1"] == OLD_EMQX


def test_offline_vehicle_is_not_sent_to(rig: Rig) -> None:
    """After a disconnect, new batches wait until the vehicle is back."""
    rig.do(
        MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S1),
        Down("VIN1", S1, EndReason.OFFLINE),
        Down("VIN1", S1, EndReason.TERMINATED),
    )
    rig.rows.add("VIN1", "task_a_1", b"x")
    rig.do(MaybeSend(Trigger.NEW_BATCH, "VIN1"))
    assert rig.pub.sent == []
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S2))
    assert rig.sent_rids == ["task_a_1"]


def test_ack_of_replaced_row_keeps_new_row(rig: Rig) -> None:
    """A batch replacing the in-flight request: the old ack deletes nothing and the new payload is sent."""
    rig.rows.add("VIN1", "task_a_1", b"v1")
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S1))
    rig.rows.add("VIN1", "task_a_1", b"v2")  # replaced while in flight
    rig.do(MaybeSend(Trigger.NEW_BATCH, "VIN1"))
    assert [p for *_, p in rig.pub.sent] == [b"v1"]
    rig.ack_last()
    assert [p for *_, p in rig.pub.sent] == [b"v1", b"v2"]
    rig.ack_last()
    assert rig.rows.rows == {}


def test_duplicate_ack_changes_nothing(rig: Rig) -> None:
    """A second PUBACK for the same delivery neither deletes the next row nor sends twice."""
    rig.rows.add("VIN1", "task_a_1", b"x")
    rig.rows.add("VIN1", "task_a_2", b"y")
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S1))
    rig.ack_last()
    rig.do(Acknowledge("VIN1", S1, "task_a_1", sha1(b"x")))
    assert rig.sent_rids == ["task_a_1", "task_a_2"]
    assert ("VIN1", "task_a_2") in rig.rows.rows


def test_next_row_goes_before_the_ack_commits(rig: Rig) -> None:
    """An ack sends the next row at once, and the acked row is never sent again while its
    delete waits for its commit, however many triggers and timeouts come meanwhile."""
    rig.rows.defer_acks = True
    rig.rows.add("VIN1", "task_a_1", b"x")
    rig.rows.add("VIN1", "task_a_2", b"y")
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S1))
    rig.ack_last()
    assert rig.sent_rids == ["task_a_1", "task_a_2"]
    assert ("VIN1", "task_a_1") in rig.rows.rows  # not committed yet
    rig.do(Acknowledge("VIN1", S1, "task_a_1", sha1(b"x")))  # a duplicate PUBACK meanwhile
    rig.ack_last()
    rig.clock.now += 3600
    rig.do(MaybeSend(Trigger.HEARTBEAT, "VIN1", S1), MaybeSend(Trigger.NEW_BATCH, "VIN1"))
    assert rig.sent_rids == ["task_a_1", "task_a_2"]
    rig.rows.commit_acks()
    assert rig.rows.rows == {}


ATTACKER = Session("emqx@n1", "VIN2", "10.0.0.9", 40009)


def acks_ignored() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("sdv_fanout_acks_ignored_total", {"reason": "not_the_vehicle"}) or 0.0


def test_a_puback_from_another_client_ends_nothing(rig: Rig) -> None:
    """Another client that got the vehicle's delivery (a broker ACL letting it read the topic) and
    PUBACKs it ends nothing and frees no slot, counted; the vehicle's own PUBACK then ends it."""
    before = acks_ignored()
    rig.rows.add("VIN1", "task_a_1", b"x")
    rig.rows.add("VIN1", "task_a_2", b"y")
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S1))
    rig.ack_last(ATTACKER)
    assert acks_ignored() == before + 1
    assert rig.sent_rids == ["task_a_1"] and ("VIN1", "task_a_1") in rig.rows.rows
    assert rig.worker.inflight["VIN1"].request_id == "task_a_1"
    rig.do(Down("VIN1", S1, EndReason.OFFLINE))  # the delivery's own client still counts offline
    rig.do(Acknowledge("VIN1", ATTACKER, "task_a_1", sha1(b"x")))
    assert acks_ignored() == before + 2 and ("VIN1", "task_a_1") in rig.rows.rows
    rig.do(MaybeSend(Trigger.SESSION_RESUMED, "VIN1", S2))
    rig.do(Acknowledge("VIN1", S2, "task_a_1", sha1(b"x")))
    assert rig.sent_rids == ["task_a_1", "task_a_2"] and ("VIN1", "task_a_1") not in rig.rows.rows


def test_a_puback_from_another_client_does_not_start_the_answer_wait(rig: Rig) -> None:
    """A delivery awaiting the vehicle's answer: an outsider's PUBACK starts no response timeout."""
    rig.rows.add("VIN1", "task_d_1", b"q", await_response=True)
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S1))
    rig.ack_last(ATTACKER)
    assert rig.worker.inflight["VIN1"].acked_at is None
    rig.ack_last()
    assert rig.worker.inflight["VIN1"].acked_at is not None


def test_a_puback_for_a_vehicle_unknown_counts_only_from_its_own_clientid(rig: Rig) -> None:
    """Nothing known of the vehicle (its session redelivers after a restart of this server, before
    its presence was seen): a PUBACK counts from the client whose id is the VIN, no other."""
    before = acks_ignored()
    rig.rows.add("VIN1", "task_a_1", b"x")
    rig.do(Acknowledge("VIN1", ATTACKER, "task_a_1", sha1(b"x")))
    assert acks_ignored() == before + 1 and ("VIN1", "task_a_1") in rig.rows.rows
    rig.do(Acknowledge("VIN1", S1, "task_a_1", sha1(b"x")))
    assert rig.rows.rows == {}


def test_inflight_timeout_resends(rig: Rig) -> None:
    """An unacked delivery older than the timeout goes again on the next trigger, not before."""
    rig.rows.add("VIN1", "task_a_1", b"x")
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S1))
    rig.clock.now += 59
    rig.do(MaybeSend(Trigger.HEARTBEAT, "VIN1", S1))
    assert rig.sent_rids == ["task_a_1"]
    rig.clock.now += 2
    rig.do(MaybeSend(Trigger.HEARTBEAT, "VIN1", S1))
    assert rig.sent_rids == ["task_a_1", "task_a_1"]


def test_broker_loss_clears_inflight_and_reconnect_resends(rig: Rig) -> None:
    """Losing our MQTT link voids in-flight entries; getting it back resends to everyone online."""
    rig.rows.add("VIN1", "task_a_1", b"x")
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S1))
    rig.pub.up = False
    rig.do(BrokerLost())
    rig.rows.add("VIN1", "task_a_2", b"y")
    rig.do(MaybeSend(Trigger.NEW_BATCH, "VIN1"))
    assert rig.worker.inflight == {}
    rig.pub.up = True
    rig.do(BrokerBack())
    assert rig.sent_rids == ["task_a_1", "task_a_1"]


def test_a_restarted_node_sends_once_to_the_new_connection(rig: Rig) -> None:
    """EMQX restarts while a delivery is out: its reload (NodeRestarted) forgets the sessions on
    that node, so our link's return sends nothing to the dead one and the vehicle's new
    subscription gets the delivery once (without it: once from BrokerBack, which the vehicle
    already subscribed may receive, and again on its subscribe hook)."""
    other = Session("emqx@n2", "VIN2", "10.0.0.2", 40003)
    rig.rows.add("VIN1", "task_a_1", b"x")
    rig.rows.add("VIN2", "task_a_1", b"x")
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S1), MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN2", other))
    rig.pub.up = False
    rig.do(BrokerLost(), NodeRestarted("emqx@n1"))
    assert "VIN1" not in rig.worker.presence and rig.worker.presence["VIN2"] == other
    rig.pub.up = True
    rig.do(BrokerBack())
    assert [vin for vin, _, _ in rig.pub.sent] == ["VIN1", "VIN2", "VIN2"]  # n2's session is alive
    rig.do(Connected("VIN1", S2), MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S2))
    assert [vin for vin, _, _ in rig.pub.sent] == ["VIN1", "VIN2", "VIN2", "VIN1"]
    rig.ack_last(S2)
    assert ("VIN1", "task_a_1") not in rig.rows.rows


def test_a_restarted_node_keeps_a_delivery_awaiting_its_answer(rig: Rig) -> None:
    """A delivery PUBACKed and awaiting its answer is the vehicle's: a node restart leaves it."""
    rig.rows.add("VIN1", "task_q_1", b"x", await_response=True)
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S1))
    rig.ack_last()
    rig.do(NodeRestarted("emqx@n1"))
    assert rig.worker.inflight["VIN1"].acked_at is not None


def test_new_connection_of_client_drops_stale_presence(rig: Rig) -> None:
    """client.connected of a new connection means the older one is gone, even if its disconnect was missed."""
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S1), Connected("VIN1", S2))
    assert "VIN1" not in rig.worker.presence
    rig.rows.add("VIN1", "task_a_1", b"x")
    rig.do(MaybeSend(Trigger.NEW_BATCH, "VIN1"))
    assert rig.pub.sent == []


def test_sending_an_unacked_request_again_counts_as_resend(rig: Rig) -> None:
    """After a discard voids the in-flight entry, sending the same request again is a re-send."""
    from prometheus_client import REGISTRY

    def resent() -> float:
        return REGISTRY.get_sample_value("sdv_fanout_deliveries_resent_total") or 0.0

    before = resent()
    rig.rows.add("VIN1", "task_a_1", b"x")
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S1), Down("VIN1", S1, EndReason.DISCARDED))
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S2))
    assert resent() == before + 1
    rig.ack_last(S2)
    rig.rows.add("VIN1", "task_a_1", b"x")
    rig.do(MaybeSend(Trigger.NEW_BATCH, "VIN1"))
    assert resent() == before + 1  # a new row after the ack is a first send


def test_sweep_resends_timed_out_delivery_without_a_trigger(rig: Rig) -> None:
    """A lost PUBACK does not wait for the next heartbeat: the periodic sweep re-sends after the timeout."""
    rig.rows.add("VIN1", "task_a_1", b"x")
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S1))
    rig.do(Sweep())
    assert rig.sent_rids == ["task_a_1"]
    rig.clock.now += 61
    rig.do(Sweep())
    assert rig.sent_rids == ["task_a_1", "task_a_1"]
    rig.do(Down("VIN1", S1, EndReason.OFFLINE))
    rig.clock.now += 61
    rig.do(Sweep())
    assert rig.sent_rids == ["task_a_1", "task_a_1"]  # offline: nothing to send to


def test_timed_out_delivery_sent_again_counts_as_resend(rig: Rig) -> None:
    """A delivery re-sent after the in-flight timeout is a re-send; the next row after its ack is not."""
    from prometheus_client import REGISTRY

    def resent() -> float:
        return REGISTRY.get_sample_value("sdv_fanout_deliveries_resent_total") or 0.0

    before = resent()
    rig.rows.add("VIN1", "task_a_1", b"x")
    rig.rows.add("VIN1", "task_a_2", b"y")
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S1))
    rig.clock.now += 61
    rig.do(Sweep())
    assert rig.sent_rids == ["task_a_1", "task_a_1"] and resent() == before + 1
    rig.ack_last()
    assert rig.sent_rids == ["task_a_1", "task_a_1", "task_a_2"] and resent() == before + 1


# -- what is kept per online vehicle -----------------------------------------------


@pytest.mark.parametrize(
    ("host", "port"),
    [("10.0.0.1", 40001), ("10.0.0.1", 0), ("::ffff:10.0.0.1", 1883), ("fe80::1", 7), ("", 0), ("broker-lb", 70000)],
)
def test_session_gives_back_what_emqx_sent(host: str, port: int) -> None:
    """However compactly a session is kept, its fields, equality and pickled form are what EMQX sent."""
    s = Session("emqx@n1", "VIN1", host, port)
    assert (s.node, s.clientid, s.peerhost, s.peerport) == ("emqx@n1", "VIN1", host, port)
    assert s == Session("emqx@n1", "VIN1", host, port) and hash(s) == hash(Session("emqx@n1", "VIN1", host, port))
    assert s != Session("emqx@n1", "VIN1", host, port + 1) and s != Session("emqx@n2", "VIN1", host, port)
    assert pickle.loads(pickle.dumps(s)) == s
    assert s.same_connection(Session("emqx@n1", "VIN1", host, 0))
    assert not s.same_connection(Session("emqx@n1", "VIN1", "10.9.9.9", port))
    with pytest.raises(AttributeError):
        s.clientid = "VIN2"  # type: ignore[misc]


def test_presence_shares_the_vin_string_with_its_session(rig: Rig) -> None:
    """A vehicle whose clientid is its VIN has that string stored once: key and session hold one object."""
    vin = "".join(["VIN", "1"])  # an equal string, not the same object, as protobuf parsing makes
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", Session("emqx@n1", vin, "10.0.0.1", 40001)))
    key = next(iter(rig.worker.presence))
    assert rig.worker.presence[key] == S1 and rig.worker.presence[key].clientid is key


def test_client_named_after_its_vin_needs_no_client_entry() -> None:
    """clientid = VIN keeps no client map entry, yet its disconnect reaches the VIN; a VIN-named
    client standing for another VIN too stands for both."""
    d = Dispatcher(MemoryRows(), RecordingPublisher(), workers=2, inflight_timeout_s=60, vin_from_clientid=str.isalnum)
    d.subscribed(S1, "VIN1")
    d.heartbeat(Session("emqx@n1", "GW-7", "10.0.0.9"), "VIN7")
    assert d._clients == {"GW-7": {"VIN7"}}
    assert set(d.vins_of("VIN1")) == {"VIN1"} and set(d.vins_of("GW-7")) == {"VIN7"}
    d.heartbeat(S1, "VIN9")
    assert set(d.vins_of("VIN1")) == {"VIN1", "VIN9"}


def test_presence_costs_under_250_bytes_per_online_vin() -> None:
    """Presence of 5,000 vehicles (clientid = VIN, fresh strings as from protobuf) stays under 250 B each."""
    n = 5_000
    topics = [f"agent/LSV{i:014d}/proxy/request/+".encode() for i in range(n)]

    async def fill() -> int:
        d = Dispatcher(
            MemoryRows(), RecordingPublisher(), workers=2, inflight_timeout_s=60, vin_from_clientid=str.isalnum
        )
        d.start()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            for i, topic in enumerate(topics):
                vin = topic.decode().split("/")[1]
                clientid = topic[6:23].decode()  # equal to the VIN, another object
                d.subscribed(Session(b"emqx@n1".decode(), clientid, f"10.0.{i >> 8 & 255}.{i & 255}", 40000), vin)
                if i % 500 == 0:
                    await asyncio.sleep(0)
            while d.backlog():
                await asyncio.sleep(0)
            used = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
        assert sum(len(w.presence) for w in d.workers.values()) == n
        await d.stop()
        return used

    per_vin = asyncio.run(fill()) / n
    assert per_vin < 250, per_vin


def test_a_cancel_counts_what_is_out_including_a_pubacked_delivery_not_yet_deleted(rig: Rig) -> None:
    """mark_cancelled: the delivery in flight is out; so is one PUBACKed whose delete has not
    committed (its delete will amend the cancelled outcome to delivered); a row never sent is not."""
    rig.rows.defer_acks = True
    rig.rows.add("VIN1", "task_a_1", b"a")
    rig.rows.add("VIN1", "task_b_1", b"b")
    rig.do(MaybeSend(Trigger.SESSION_SUBSCRIBED, "VIN1", S1))
    assert rig.worker.mark_cancelled("VIN1", "task_a_1", sha1(b"a"))
    assert rig.worker.inflight["VIN1"].cancelled
    rig.ack_last()  # task_a_1 acked (delete pending); task_b_1 now in flight
    assert rig.worker.mark_cancelled("VIN1", "task_a_1", sha1(b"a"))
    assert rig.worker.mark_cancelled("VIN1", "task_b_1", sha1(b"b"))
    assert not rig.worker.mark_cancelled("VIN1", "task_b_1", sha1(b"other"))
    rig.rows.commit_acks()
    assert not rig.worker.mark_cancelled("VIN1", "task_a_1", sha1(b"a"))
