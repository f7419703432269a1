"""The demo platform's ears: what the server tells it on the status topic, and the checks on it.

The platform (demo/run.py) publishes batches through the broker; EMQX answers every publish the
same way, stored or not. What tells them apart is the status topic: `StatusFeed` is a real paho
MQTT 5 client that subscribes to `$SDV-FANOUT/status/#` at QoS 1 before the first batch, as a
platform would, and `StatusView` folds what it hears per request: receipts (`accepted`,
`accepted` with `duplicate: true`, `rejected`) and the latest counts of each generation
(request_id, blob sha1) from `progress` and `completed`.

At the end, `check_receipts` and `check_generations` hold that view against what the platform
sent (`Sent`) and what the vehicles acknowledged.
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
from tests.emqx_sim import LOOPBACK

#: The server's default `status_topic_prefix` (the demo's server runs with the defaults).
STATUS_PREFIX = str(next(f.default for f in dataclasses.fields(Config) if f.name == "status_topic_prefix"))
STATUS_FILTER = STATUS_PREFIX + "/#"
#: Outcomes nothing in the demo causes: every generation's counts must show none of them.
OTHER_OUTCOMES = ("cancelled", "expired", "failed")
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
    events: Counter[str] = field(default_factory=Counter)
    other: list[Heard] = field(default_factory=list)  # events the demo does not expect

    def add(self, heard: Heard) -> None:
        doc = heard.doc
        event = str(doc.get("event"))
        self.events[event] += 1
        if event in ("accepted", "rejected"):
            self.receipts.append(heard)
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


def check_generations(
    view: StatusView, sent: list[Sent], acks: dict[str, list[tuple[str, str, float]]], sha_short: int = 16
) -> Check:
    """Every generation the platform created reported `completed` once nothing was pending, with
    counts that match the vehicles: `total` = the VINs it was sent to, `delivered` = those that
    PUBACKed it before a newer version of the request replaced their row (a PUBACK within
    ACK_RACE_S of that may count either way), `superseded` = the rest, nothing else.

    `acks`: VIN -> (request_id, sha1 prefix of `sha_short` hex digits, time.time()) per PUBACK.
    """
    firsts = [s for s in sent if not s.retry and not s.bad]
    members: dict[tuple[str, str], list[str]] = {}
    current: dict[tuple[str, str], str] = {}  # (vin, request_id) -> sha1 of its row
    replaced: dict[tuple[str, str, str], tuple[float, float]] = {}  # (vin, rid, sha1) -> newer publish
    for s in sorted(firsts, key=lambda s: s.at):
        pairs = members.setdefault((s.request_id, s.sha1), [])
        for vin in s.vins:
            old = current.get((vin, s.request_id))
            if old == s.sha1:
                continue  # the same generation again: the same pair
            if old is not None:
                replaced[vin, s.request_id, old] = (s.at, s.answered)
            current[vin, s.request_id] = s.sha1
            pairs.append(vin)
    acked: dict[tuple[str, str, str], tuple[float, float]] = {}  # (vin, rid, sha prefix) -> first, last
    for vin, rows in acks.items():
        for rid, digest, t in rows:
            first, last = acked.get((vin, rid, digest), (t, t))
            acked[vin, rid, digest] = (min(first, t), max(last, t))

    problems: list[str] = []
    delivered = superseded = either = 0
    for (rid, sha1), vins in members.items():
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
        if not sure <= d <= sure + maybe:
            wrong.append(f"delivered {d}, vehicles PUBACKed {sure}" + (f"-{sure + maybe}" if maybe else ""))
        if c.get("pending") or d + c.get("superseded", 0) != len(vins) or any(c.get(k) for k in OTHER_OUTCOMES):
            wrong.append(f"counts {c}")
        if wrong:
            problems.append(f"{name}: " + "; ".join(wrong))
        delivered += max(d, 0)
        superseded += c.get("superseded", 0)
        either += maybe
    strays = [g for key, g in view.gens.items() if key not in members]
    problems += [f"status about a generation the platform never sent: {g.request_id} {g.sha1}" for g in strays[:3]]
    done = sum(1 for key in members if (g := view.gens.get(key)) is not None and g.completed)
    ok = not problems
    line = (
        f"{done} of {len(members)} generations reported completed, counts as the vehicles PUBACKed them: "
        f"{delivered:,} delivered, {superseded:,} superseded"
        + (" (a newer version replaced the row before the PUBACK)" if superseded else "")
        + f"; {view.events['progress']:,} progress messages"
    )
    if either:
        line += f"; {either} PUBACKs raced a newer version (either count is right)"
    return Check(ok, ("" if ok else "NO: ") + line, problems)
