"""The demo platform's ears: what the server tells it on the status topic, and the checks on it.

The platform (demo/run.py) publishes batches through the broker; EMQX answers every publish the
same way, stored or not. What tells them apart is the status topic: `StatusFeed` is a real paho
MQTT 5 client that subscribes to `$SDV-FANOUT/status/#` at QoS 1 before the first batch, as a
platform would, and `StatusView` folds what it hears per request: receipts (`accepted`,
`accepted` with `duplicate: true`, `rejected`), the latest counts of each generation
(request_id, blob sha1) from `progress` and `completed`, the vehicles' answers (`response`) and
what a cancel stopped (`cancelled`).

At the end, `check_receipts`, `check_generations`, `check_responses`, `check_cancel` and
`check_expiry` hold that view against what the platform sent (`Sent`, `Cancel`) and what the
vehicles received, acknowledged and answered (`FleetFacts`).
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from exhook_server.config import Config
from testkit.emqx_sim import LOOPBACK

#: The server's default `status_topic_prefix` (the demo's server runs with the defaults).
STATUS_PREFIX = str(next(f.default for f in dataclasses.fields(Config) if f.name == "status_topic_prefix"))
STATUS_FILTER = STATUS_PREFIX + "/#"
#: Every outcome a generation's counts may show besides `pending`; each pair has exactly one.
OUTCOMES = ("delivered", "superseded", "cancelled", "expired", "failed", "responded")
#: A vehicle's PUBACK of a request this long before the publish of a newer version of it (or
#: later) may reach the server after that version replaced the row: the server then counts the
#: pair superseded, not delivered. Either count is right for such a pair.
ACK_RACE_S = 0.5
#: How long the subscriber waits for its CONNACK and SUBACK.
SUBSCRIBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Heard:
    """One status message: its topic, its JSON object and when it arrived (time.time())."""

    topic: str
    doc: dict[str, Any]
    at: float


class StatusFeed:
    """A platform's status subscriber: `$SDV-FANOUT/status/#` at QoS 1, every message in arrival order."""

    def __init__(self, port: int, clientid: str = "sdv-platform-status") -> None:
        self.port = port
        self.clientid = clientid
        self._queue: queue.Queue[Heard] = queue.Queue()
        self._connack: queue.Queue[ReasonCode] = queue.Queue()
        self._suback: queue.Queue[list[ReasonCode]] = queue.Queue()
        self.malformed: list[str] = []
        self._client: mqtt.Client | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Connect and subscribe; returns once the broker granted the subscription (raises if not)."""
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=self.clientid, protocol=mqtt.MQTTv5)
        client.username_pw_set("platform")
        client.on_connect = lambda _c, _u, _flags, rc, _props: self._connack.put(rc)
        client.on_subscribe = lambda _c, _u, _mid, codes, _props: self._suback.put(codes)
        client.on_message = self._on_message
        client.connect(LOOPBACK, self.port, keepalive=60)
        client.loop_start()
        self._client = client
        try:
            rc = self._connack.get(timeout=SUBSCRIBE_TIMEOUT_S)
        except queue.Empty:
            raise RuntimeError("the platform's status subscriber got no CONNACK") from None
        if rc.is_failure:
            raise RuntimeError(f"the broker refused the platform's status subscriber: {rc}")
        result, _ = client.subscribe(STATUS_FILTER, options=SubscribeOptions(qos=1))
        if result != MQTTErrorCode.MQTT_ERR_SUCCESS:
            raise RuntimeError(f"SUBSCRIBE {STATUS_FILTER} failed: {result}")
        try:
            codes = self._suback.get(timeout=SUBSCRIBE_TIMEOUT_S)
        except queue.Empty:
            raise RuntimeError(f"no SUBACK for {STATUS_FILTER}") from None
        if any(c.is_failure for c in codes):
            raise RuntimeError(
                f"the broker refused SUBSCRIBE {STATUS_FILTER} ({', '.join(str(c) for c in codes)}): "
                "its authorization must let the platform subscribe to the status topics"
            )

    def _on_message(self, _c: Any, _u: Any, message: mqtt.MQTTMessage) -> None:
        at = time.time()
        try:
            doc = json.loads(message.payload)
            if not isinstance(doc, dict) or "event" not in doc:
                raise ValueError("not an object with an event")
        except ValueError as exc:
            with self._lock:
                self.malformed.append(f"{message.topic}: {exc}: {bytes(message.payload)[:80]!r}")
            return
        self._queue.put(Heard(message.topic, doc, at))

    def take(self) -> list[Heard]:
        """Every message that arrived since the last call, in arrival order."""
        out: list[Heard] = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def stop(self) -> None:
        if self._client is not None:
            self._client.disconnect()
            self._client.loop_stop()
            self._client = None


@dataclass
class Generation:
    """One (request_id, sha1) as the platform hears of it."""

    request_id: str
    sha1: str
    counts: dict[str, int] = field(default_factory=dict)
    ts_ms: int = 0  # of the message `counts` came from
    progress: int = 0  # progress messages
    completed: int = 0  # completed messages
    completed_counts: dict[str, int] = field(default_factory=dict)
    completed_at: float | None = None
    changed_at: float = 0.0

    @property
    def done(self) -> bool:
        return self.completed > 0 and not self.counts.get("pending", 0)


@dataclass
class StatusView:
    """What the platform has heard, per request."""

    receipts: list[Heard] = field(default_factory=list)
    gens: dict[tuple[str, str], Generation] = field(default_factory=dict)
    responses: list[Heard] = field(default_factory=list)  # a vehicle's answer, relayed by the server
    cancels: list[Heard] = field(default_factory=list)  # what a cancel of the platform stopped
    events: Counter[str] = field(default_factory=Counter)
    other: list[Heard] = field(default_factory=list)  # events the demo does not expect

    def add(self, heard: Heard) -> None:
        doc = heard.doc
        event = str(doc.get("event"))
        self.events[event] += 1
        if event in ("accepted", "rejected"):
            self.receipts.append(heard)
        elif event == "response":
            self.responses.append(heard)
        elif event == "cancelled":
            self.cancels.append(heard)
        elif event in ("progress", "completed") and isinstance(doc.get("counts"), dict):
            key = (str(doc.get("request_id")), str(doc.get("sha1")))
            gen = self.gens.get(key)
            if gen is None:
                gen = self.gens[key] = Generation(*key)
            ts = int(doc.get("ts_ms") or 0)
            if ts >= gen.ts_ms:  # one process reports them, in order; keep the newest anyway
                gen.counts, gen.ts_ms, gen.changed_at = dict(doc["counts"]), ts, heard.at
            if event == "progress":
                gen.progress += 1
            else:
                gen.completed += 1
                gen.completed_counts = dict(doc["counts"])
                gen.completed_at = heard.at
        else:
            self.other.append(heard)

    def accepted(self, duplicate: bool = False) -> int:
        return sum(
            1 for h in self.receipts if h.doc.get("event") == "accepted" and bool(h.doc.get("duplicate")) == duplicate
        )

    def rejected(self) -> int:
        return sum(1 for h in self.receipts if h.doc.get("event") == "rejected")


@dataclass(frozen=True)
class Sent:
    """One publish of the platform: a batch (first send or a retry with its batch_id) or the bad one."""

    n: int  # batch number (the bad batch: 0)
    request_id: str
    sha1: str  # hex of the payload
    vins: tuple[str, ...]
    batch_id: str
    correlation_id: str
    retry: bool = False
    bad: bool = False
    at: float = 0.0  # time.time() before the publish
    answered: float = 0.0  # time.time() once the broker had taken it
    await_response: bool = False  # the vehicle's answer, not its PUBACK, ends each pair
    expires_at_ms: int | None = None  # the batch's `expires_at` (epoch ms)


@dataclass(frozen=True)
class Cancel:
    """The platform's `{"request_id", "correlation_id"}` on the cancel topic (every vehicle of it)."""

    request_id: str
    correlation_id: str
    at: float  # time.time() before the publish
    answered: float  # time.time() once the broker had taken it
    #: Vehicles of the request that were offline when the cancel went out: their rows were
    #: pending, so the cancel must have stopped at least one.
    offline: int = 0


@dataclass(frozen=True)
class FleetFacts:
    """What the vehicles did, per VIN, from their final reports. Payloads are named by the first
    16 hex digits of their sha1; times are time.time() in the fleet process."""

    received: dict[str, list[tuple[str, str, float]]]  # (request_id, sha16, time) per PUBLISH received
    acks: dict[str, list[tuple[str, str, float]]]  # (request_id, sha16, time just before the PUBACK)
    answers: dict[str, list[tuple[str, str, str, float]]]  # (request_id, sha16, body, time) per answer
    answering: frozenset[str] = frozenset()  # VINs that answer requests awaiting a response

    def answered(self, vin: str, request_id: str, sha16: str) -> bool:
        return any(a[0] == request_id and a[1] == sha16 for a in self.answers.get(vin, ()))

    def got(self, request_id: str, after: float = 0.0) -> list[str]:
        """VINs that received `request_id` (later than `after`)."""
        return [v for v, rx in self.received.items() if any(r[0] == request_id and r[2] > after for r in rx)]


@dataclass
class Check:
    ok: bool
    line: str
    problems: list[str]


def check_receipts(view: StatusView, sent: list[Sent], extra_deliveries: int) -> Check:
    """Every batch: exactly one non-duplicate `accepted` receipt, with its sha1, VIN count and
    correlation_id; every retry: one duplicate receipt and no extra delivery; the bad batch:
    one `rejected`; nothing else."""
    problems: list[str] = []
    by_corr: dict[str, list[Heard]] = defaultdict(list)
    for h in view.receipts:
        by_corr[str(h.doc.get("correlation_id"))].append(h)
    latency_ms: list[float] = []
    firsts = [s for s in sent if not s.retry and not s.bad]
    retries = [s for s in sent if s.retry]
    bad = [s for s in sent if s.bad]
    for s in firsts:
        mine = [h for h in view.receipts if h.doc.get("batch_id") == s.batch_id and not h.doc.get("duplicate")]
        accepted = [h for h in mine if h.doc.get("event") == "accepted"]
        if len(mine) != 1 or len(accepted) != 1:
            events = ", ".join(str(h.doc.get("event")) for h in mine) or "none"
            problems.append(f"batch {s.n} ({s.batch_id}): {len(accepted)} accepted receipts ({events}), want one")
            continue
        doc = accepted[0].doc
        want = {
            "request_id": s.request_id,
            "sha1": s.sha1,
            "vins": len(s.vins),
            "correlation_id": s.correlation_id,
            "refused": [],
        }
        wrong = {k: doc.get(k) for k, v in want.items() if doc.get(k) != v}
        if wrong:
            problems.append(f"batch {s.n} ({s.batch_id}): receipt says {wrong}, the platform sent {want}")
        latency_ms.append((accepted[0].at - s.at) * 1000)
    for s in retries:
        # The first receipt again: same request, blob and VIN count, this retry's correlation_id.
        want = {"event": "accepted", "batch_id": s.batch_id, "request_id": s.request_id, "sha1": s.sha1}
        want["vins"] = len(s.vins)
        got = by_corr[s.correlation_id]
        if len(got) != 1 or not got[0].doc.get("duplicate") or any(got[0].doc.get(k) != v for k, v in want.items()):
            problems.append(f"retry of batch {s.n}: {[h.doc for h in got]}, want one duplicate receipt like {want}")
    for s in bad:
        got = by_corr[s.correlation_id]
        if len(got) != 1 or got[0].doc.get("event") != "rejected" or got[0].doc.get("request_id") != s.request_id:
            problems.append(f"bad batch {s.request_id}: {[h.doc for h in got]}, want one rejected receipt")
        elif not got[0].doc.get("reason"):
            problems.append(f"bad batch {s.request_id}: rejected without a reason: {got[0].doc}")
    known = {s.correlation_id for s in sent}
    strays = [h for h in view.receipts if h.doc.get("correlation_id") not in known]
    problems += [f"receipt for nothing the platform sent: {h.topic} {h.doc}" for h in strays[:3]]
    if extra_deliveries:
        problems.append(f"{extra_deliveries} deliveries of a retried batch beyond the first (must be none)")

    latency_ms.sort()
    parts = [
        f"{len(firsts)} batches, one accepted receipt each (its sha1, VIN count and correlation_id)"
        + (
            f", {latency_ms[len(latency_ms) // 2]:.1f} ms median after the publish ({latency_ms[-1]:.1f} max)"
            if latency_ms
            else ""
        )
    ]
    if retries:
        parts.append(
            f"{len(retries)} re-sent with the same batch_id: accepted, duplicate: true, "
            "nothing stored or delivered again"
        )
    for s in bad:
        reasons = [h.doc.get("reason") for h in by_corr[s.correlation_id]]
        parts.append(f"{s.request_id}: rejected ({', '.join(map(str, reasons)) or 'no receipt'})")
    ok = not problems
    return Check(ok, ("" if ok else "NO: ") + "; ".join(parts), problems)


#: (vin, request_id, sha1) -> when a newer version of the request was published (`at`, `answered`).
Replaced = dict[tuple[str, str, str], tuple[float, float]]


def _members(sent: list[Sent]) -> tuple[dict[tuple[str, str], list[str]], Replaced]:
    """Each generation's VINs, and when a newer version of the request replaced a VIN's row
    ((vin, request_id, sha1) -> the newer publish's `at`, `answered`)."""
    members: dict[tuple[str, str], list[str]] = {}
    current: dict[tuple[str, str], str] = {}  # (vin, request_id) -> sha1 of its row
    replaced: Replaced = {}
    for s in sorted((s for s in sent if not s.retry and not s.bad), key=lambda s: s.at):
        pairs = members.setdefault((s.request_id, s.sha1), [])
        for vin in s.vins:
            old = current.get((vin, s.request_id))
            if old == s.sha1:
                continue  # the same generation again: the same pair
            if old is not None:
                replaced[vin, s.request_id, old] = (s.at, s.answered)
            current[vin, s.request_id] = s.sha1
            pairs.append(vin)
    return members, replaced


def check_generations(
    view: StatusView, sent: list[Sent], facts: FleetFacts, cancels: list[Cancel], sha_short: int = 16
) -> Check:
    """Every generation the platform created reported `completed` once nothing was pending, with
    counts that match the vehicles: `total` = the VINs it was sent to, every pair with exactly one
    outcome, and which one as the vehicles and the platform made it:

    * a plain request: `delivered` = the VINs that PUBACKed it before a newer version of the
      request replaced their row (a PUBACK within ACK_RACE_S of that may count either way),
      `superseded` = the rest;
    * `await_response`: `responded` = the VINs that answered it, `failed` = those that never did;
    * a cancelled request: `delivered` = the PUBACKs, `cancelled` = what the `cancelled` event
      said it stopped, less those of its `in_flight` rows whose PUBACK still came (the server
      amends their outcome to what happened);
    * an expiring request: whatever was never sent by `expires_at` counts `expired`.
    """
    firsts = {(s.request_id, s.sha1): s for s in sent if not s.retry and not s.bad}
    members, replaced = _members(sent)
    acked: dict[tuple[str, str, str], tuple[float, float]] = {}  # (vin, rid, sha prefix) -> first, last
    for vin, rows in facts.acks.items():
        for rid, digest, t in rows:
            first, last = acked.get((vin, rid, digest), (t, t))
            acked[vin, rid, digest] = (min(first, t), max(last, t))
    stopped = {c.request_id: _cancel_event(view, c) for c in cancels}

    problems: list[str] = []
    totals: Counter[str] = Counter()
    either = 0
    for (rid, sha1), vins in members.items():
        s = firsts[rid, sha1]
        sure = maybe = 0
        for vin in vins:
            times = acked.get((vin, rid, sha1[:sha_short]))
            if times is None:
                continue
            window = replaced.get((vin, rid, sha1))
            if window is None or times[1] < window[0] - ACK_RACE_S:
                sure += 1
            elif times[0] <= window[1]:
                maybe += 1
            # else every PUBACK came after the newer version was stored: superseded
        gen = view.gens.get((rid, sha1))
        name = f"{rid} ({sha1[:8]})"
        if gen is None or not gen.completed:
            problems.append(f"{name}: no completed (last counts: {gen.counts if gen else 'none'})")
            continue
        c = gen.completed_counts
        d = c.get("delivered", -1)
        wrong = []
        if c.get("total") != len(vins):
            wrong.append(f"total {c.get('total')}, sent to {len(vins)}")
        if c.get("pending") or sum(c.get(k, 0) for k in OUTCOMES) != len(vins):
            wrong.append(f"counts {c}: not one outcome for each of the {len(vins)} vehicles")
        allowed = {"delivered", "superseded"}
        if s.await_response:
            allowed = {"responded", "failed", "superseded"}
            answered = sum(facts.answered(vin, rid, sha1[:sha_short]) for vin in vins)
            if c.get("responded") != answered:
                wrong.append(f"responded {c.get('responded')}, vehicles answered {answered}")
        elif rid in stopped:
            allowed.add("cancelled")
            event = stopped[rid]
            if event is not None:
                said, in_flight = int(event.doc.get("cancelled") or 0), int(event.doc.get("in_flight") or 0)
                if not said - in_flight <= c.get("cancelled", -1) <= said:
                    wrong.append(
                        f"cancelled {c.get('cancelled')}, the cancelled event said {said} ({in_flight} in flight)"
                    )
            if not sure <= d <= sure + maybe:
                wrong.append(f"delivered {d}, vehicles PUBACKed {sure}")
        elif s.expires_at_ms is not None:
            allowed = {"delivered", "superseded", "expired"}
            if d != sure:
                wrong.append(f"delivered {d}, vehicles PUBACKed {sure}")
        elif not sure <= d <= sure + maybe:
            wrong.append(f"delivered {d}, vehicles PUBACKed {sure}" + (f"-{sure + maybe}" if maybe else ""))
        if any(c.get(k) for k in OUTCOMES if k not in allowed):
            wrong.append(f"counts {c}: only {', '.join(sorted(allowed))} expected")
        if wrong:
            problems.append(f"{name}: " + "; ".join(wrong))
        totals.update({k: max(c.get(k, 0), 0) for k in OUTCOMES})
        either += maybe
    strays = [g for key, g in view.gens.items() if key not in members]
    problems += [f"status about a generation the platform never sent: {g.request_id} {g.sha1}" for g in strays[:3]]
    done = sum(1 for key in members if (g := view.gens.get(key)) is not None and g.completed)
    ok = not problems
    line = (
        f"{done} of {len(members)} generations reported completed, counts as the vehicles PUBACKed them: "
        f"{totals['delivered']:,} delivered, {totals['superseded']:,} superseded"
        + (" (a newer version replaced the row before the PUBACK)" if totals["superseded"] else "")
    )
    if totals["responded"] or totals["failed"]:
        line += f"; as they answered: {totals['responded']:,} responded, {totals['failed']:,} failed"
    if totals["cancelled"] or totals["expired"]:
        line += (
            f"; as the platform cancelled and let expire: {totals['cancelled']:,} cancelled, "
            f"{totals['expired']:,} expired"
        )
    line += f"; {view.events['progress']:,} progress messages"
    if either:
        line += f"; {either} PUBACKs raced a newer version (either count is right)"
    return Check(ok, ("" if ok else "NO: ") + line, problems)


def _cancel_event(view: StatusView, cancel: Cancel) -> Heard | None:
    """The `cancelled` event answering `cancel` (by its correlation_id), if one came."""
    return next((h for h in view.cancels if h.doc.get("correlation_id") == cancel.correlation_id), None)


def check_responses(view: StatusView, sent: list[Sent], facts: FleetFacts, timeout_s: float) -> Check:
    """Every answer a vehicle published was relayed once as a `response` event on its request's
    status topic, with the vehicle's VIN, the generation's sha1 and the answer itself as `payload`;
    every answering vehicle answered every request awaiting a response it received, the others none;
    nothing else was relayed."""
    awaited = {(s.request_id, s.sha1) for s in sent if s.await_response and not s.retry and not s.bad}
    if not awaited:
        return Check(True, "no request awaited an answer", [])
    problems: list[str] = []
    heard: Counter[tuple[str, str, str, str]] = Counter()
    for h in view.responses:
        d = h.doc
        if d.get("payload_encoding") or d.get("truncated"):
            problems.append(f"response {h.topic}: a short UTF-8 answer came {d}")
        heard[str(d.get("request_id")), str(d.get("vin")), str(d.get("sha1"))[:16], str(d.get("payload"))] += 1
    answers = 0
    for vin, rows in facts.answers.items():
        for rid, digest, body, _ in rows:
            answers += 1
            n = heard.pop((rid, vin, digest, body), 0)
            if n != 1:
                problems.append(f"{vin} answered {rid} with {body!r}: {n} response events, want one")
    problems += [f"response event for no answer: {k}" for k in list(heard)[:3]]
    members, _ = _members(sent)
    wanted = failed = 0
    for key in awaited:
        got = set(facts.got(key[0]))
        for vin in members[key]:
            if vin not in got:
                continue  # never delivered: the rows check says so
            should = vin in facts.answering
            wanted += should
            failed += not should
            if facts.answered(vin, key[0], key[1][:16]) != should:
                problems.append(f"{vin} ({'answers' if should else 'never answers'}) and {key[0]}: did the other")
    ok = not problems
    line = (
        f"{len(awaited)} requests awaited an answer (await_response: true): the {len(facts.answering)} vehicles "
        f"that answer sent {answers:,}, each relayed as a response event with its payload "
        f"({len(view.responses):,} heard); the others' {failed:,} ended failed, no answer within {timeout_s:g} s"
    )
    if answers != wanted:
        line += f" (answers expected: {wanted:,})"
    return Check(ok, ("" if ok else "NO: ") + line, problems)


def check_cancel(view: StatusView, cancel: Cancel, sent: list[Sent], facts: FleetFacts) -> Check:
    """The cancel got one `cancelled` event saying what it stopped (at least one pending row when
    some vehicles were offline); no vehicle received the request after that event arrived,
    except those `in_flight` at the cancel (a delivery on its way cannot be recalled)."""
    rid = cancel.request_id
    total = sum(len(s.vins) for s in sent if s.request_id == rid and not s.retry and not s.bad)
    mine = [h for h in view.cancels if h.doc.get("request_id") == rid]
    event = _cancel_event(view, cancel)
    problems: list[str] = []
    if len(mine) != 1 or event is None:
        problems.append(f"cancel of {rid}: {[h.doc for h in mine]}, want one cancelled event with its correlation_id")
        return Check(False, f"NO: {rid}: no cancelled event", problems)
    n, in_flight = int(event.doc.get("cancelled") or 0), int(event.doc.get("in_flight") or 0)
    if cancel.offline and n < 1:
        problems.append(f"cancel of {rid}: cancelled {n}, but {cancel.offline} of its vehicles were offline")
    late = facts.got(rid, after=event.at)
    if len(late) > in_flight:
        problems.append(f"{len(late)} vehicles received {rid} after its cancelled event ({in_flight} in flight)")
    got = len(facts.got(rid))
    during = len(facts.got(rid, after=cancel.at))  # on their way when the cancel came
    taken = len(facts.got(rid, after=cancel.answered))  # after the hook answered: the cancel was durable
    ok = not problems
    line = (
        f"{rid} ({total} vehicles, {cancel.offline} of them offline) cancelled "
        f"{cancel.at - min(s.at for s in sent if s.request_id == rid):.1f} s after its publish: "
        f"the cancelled event ({(event.at - cancel.at) * 1000:.0f} ms after the cancel) says {n} cancelled, "
        f"{in_flight} of them in flight; {got} vehicles got it, {during} while the cancel was on its way "
        f"({taken} after the server had taken it), {len(late)} after the event"
    )
    return Check(ok, ("" if ok else "NO: ") + line, problems)


def check_expiry(view: StatusView, sent: list[Sent], facts: FleetFacts) -> Check:
    """A request whose vehicles were all offline until after its `expires_at` reached none of
    them and reported `completed` with every pair `expired`."""
    expiring = [s for s in sent if s.expires_at_ms is not None and not s.retry and not s.bad]
    problems: list[str] = []
    parts: list[str] = []
    for s in expiring:
        assert s.expires_at_ms is not None
        got = facts.got(s.request_id)
        if got:
            problems.append(f"{s.request_id} expired, yet {len(got)} vehicles got it ({', '.join(got[:3])})")
        gen = view.gens.get((s.request_id, s.sha1))
        c = gen.completed_counts if gen is not None and gen.completed else {}
        if c.get("expired") != len(s.vins) or c.get("delivered"):
            problems.append(f"{s.request_id}: completed counts {c or 'none'}, want all {len(s.vins)} expired")
        parts.append(
            f"{s.request_id} (expires_at {(s.expires_at_ms / 1000 - s.at):.1f} s after its publish, "
            f"{len(s.vins)} vehicles offline until later): {c.get('expired', 0)} expired, "
            f"{c.get('delivered', 0)} delivered; {len(got)} vehicles ever got it"
        )
    ok = not problems
    return Check(ok, ("" if ok else "NO: ") + ("; ".join(parts) or "no request expired"), problems)
