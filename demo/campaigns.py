"""The demo's campaign-control act, after the main scenario, on vehicles of its own: a campaign
paced by `max_per_minute`; one aborted by its `abort` criterion when its vehicles answer
`{"status": "failed"}` (the rest cancelled, a later batch refused); one held outside its window
until the platform opens one; a `"priority": "high"` recall overtaking an update queued before it
on offline vehicles. Each is checked by its own assertion on what the vehicles received and what
the status topic said; `Act.run` prints a line per campaign and PASS or FAIL (its exit code).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from demo.brokers import BATCH_TOPIC, Broker, batch_payload
from demo.platform import Heard

POLICY_TOPIC = "$SDV-FANOUT/policy"  # the server's default policy_topic
VIN_FORMAT = "SDVCAMP{:010d}"
PACED_VEHICLES, ABORT_VEHICLES, WINDOW_VEHICLES, RECALL_VEHICLES = 20, 20, 6, 6
PACED_PER_MINUTE = 600
#: Starts the paced campaign may make ahead of its rate, besides what its bucket accrued between
#: the policy and the batch: the bucket's first token and a lease (0.1 s of the rate) per process.
PACED_SLACK = 3
PACED = "task_campaign_paced_1"
ABORTED = "task_campaign_abort_1"
WINDOWED = "task_campaign_window_1"
UPDATE = "task_campaign_update_1"
RECALL = "task_campaign_recall_1"
ABORT_POLICY = {"max_in_flight": 2, "abort": [{"outcome": "answer_failed", "ratio": 0.5, "min_finished": 4}]}
#: The demo server's policy_refresh_s: a policy stored by one server process is in force in the
#: others after their next reload, so the act waits twice this before the campaigns' batches.
POLICY_REFRESH_S = 0.25
#: How long the windowed campaign is shown held before the platform opens its window.
HOLD_S = 1.5
DEADLINE_S = 30.0


class Host(Protocol):
    """What the act needs of the demo (demo.run.Demo)."""

    fleet: list[Any]

    def start_fleet(
        self, specs: list[dict[str, Any]], broker: Broker, clientid: str, await_response: list[str]
    ) -> None: ...

    def scrape_metrics(self) -> dict[str, float]: ...

    def say(self, text: str) -> None: ...


@dataclass
class Act:
    host: Host
    broker: Broker
    clientid: str
    take: Callable[[], list[Heard]]
    heard: list[Heard] = field(default_factory=list)
    marks: dict[str, float] = field(default_factory=dict)  # what happened when (time.time())

    def policy(self, request_id: str, fields: dict[str, Any]) -> None:
        self.broker.publish(POLICY_TOPIC, json.dumps({"request_id": request_id, **fields}).encode())

    def batch(self, vins: list[str], request_id: str, data: str, batch_id: str, **fields: Any) -> None:
        self.broker.publish(BATCH_TOPIC, batch_payload(vins, request_id, data, batch_id=batch_id, **fields))

    def events(self, request_id: str, event: str) -> list[dict[str, Any]]:
        self.heard += self.take()
        return [h.doc for h in self.heard if h.doc.get("request_id") == request_id and h.doc.get("event") == event]

    def wait(self, what: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if what():
                return True
            time.sleep(0.05)
        return what()

    def held_gauge(self) -> float:
        found = [v for k, v in self.host.scrape_metrics().items() if k.startswith("sdv_fanout_campaigns_held")]
        return max(found, default=0.0)

    def run(self, response_timeout_s: float) -> int:
        vins = [VIN_FORMAT.format(n) for n in range(1, 1 + PACED_VEHICLES + ABORT_VEHICLES + WINDOW_VEHICLES)]
        paced, rest = vins[:PACED_VEHICLES], vins[PACED_VEHICLES:]
        failing, windowed = rest[:ABORT_VEHICLES], rest[ABORT_VEHICLES:]
        recall = [VIN_FORMAT.format(len(vins) + 1 + n) for n in range(RECALL_VEHICLES)]
        specs = [_spec(v, "online") for v in paced + windowed] + [_spec(v, "late") for v in recall]
        specs += [{**_spec(v, "online"), "answers": True, "status": "failed"} for v in failing]
        print()
        print("Campaign control: four campaigns on vehicles of their own")
        self.host.say("campaigns: starting their vehicles")
        before = len(self.host.fleet)
        self.host.start_fleet(specs, self.broker, self.clientid, [ABORTED])
        procs = self.host.fleet[before:]

        self.marks["policies"] = time.time()
        self.policy(PACED, {"max_per_minute": PACED_PER_MINUTE})
        self.policy(ABORTED, ABORT_POLICY)
        closed_minute = (time.gmtime().tm_min + 30) % 60
        self.policy(WINDOWED, {"windows": [{"cron": f"{closed_minute} * * * *", "duration_s": 60, "tz": "UTC"}]})
        # No process tells when it reloaded; a batch stored before would go out ungoverned there.
        time.sleep(2 * POLICY_REFRESH_S)
        self.marks["paced"] = time.time()
        self.batch(paced, PACED, "config profile eco", "batch-campaign-paced")
        self.batch(failing, ABORTED, "battery_health", "batch-campaign-abort", await_response=True)
        self.batch(windowed, WINDOWED, "map update", "batch-campaign-window")
        self.batch(recall, UPDATE, "firmware 5.0.0 (1 GB, say)", "batch-campaign-update")
        self.batch(recall, RECALL, "safety recall: airbag ECU", "batch-campaign-recall", priority="high")
        self.host.say(
            f"campaigns: {PACED} to {len(paced)} at max_per_minute {PACED_PER_MINUTE}; {ABORTED} to {len(failing)} "
            f"that answer failed, {json.dumps(ABORT_POLICY)}; {WINDOWED} to {len(windowed)}, window at minute "
            f"{closed_minute} (UTC); {UPDATE} then {RECALL} (priority high) to {len(recall)} offline vehicles"
        )
        for fp in procs:
            mine = [v for v in recall if v in fp.vins]
            if mine:
                fp.send({"cmd": "online", "vins": mine})
        self.wait(lambda: self.held_gauge() >= 1, HOLD_S)
        held_before_open = self.held_gauge()
        time.sleep(max(0.0, self.marks["paced"] + HOLD_S - time.time()))  # shown held this long at least
        self.marks["open"] = time.time()
        self.policy(WINDOWED, {"windows": [{"cron": "* * * * *", "duration_s": 60, "tz": "UTC"}]})
        self.host.say(f"platform sets a window open now for {WINDOWED} ({held_before_open:g} campaign(s) held)")

        def aborted_and_cut() -> bool:
            return bool(self.events(ABORTED, "aborted")) and bool(self.events(ABORTED, "cancelled"))

        done = self.wait(aborted_and_cut, DEADLINE_S)
        if done:
            self.batch(failing[:2], ABORTED, "battery_health", "batch-campaign-abort-again", await_response=True)
        cut = self.events(ABORTED, "cancelled")[:1] or [{}]
        # Every vehicle has what it gets: the rows the abort did not cancel, and those it caught in flight.
        due = len(paced) + len(windowed) + 2 * len(recall)
        due += len(failing) - int(cut[0].get("cancelled") or 0) + int(cut[0].get("in_flight") or 0)

        def received(key: str) -> int:
            return sum(int(fp.progress.get(key, 0)) for fp in procs)

        settled = self.wait(
            lambda: (
                received("received") >= due
                and not received("unacked")
                and (not done or bool(self.events(ABORTED, "rejected")))
            ),
            DEADLINE_S,
        )
        self.host.say("campaigns ended" if settled else "campaigns: deadline")
        for fp in procs:
            fp.send({"cmd": "stop"})
        rx: dict[str, list[tuple[str, str, float]]] = {}
        for fp in procs:
            fp.got_final.wait(30)
            for vin, f in ((fp.final or {}).get("vehicles") or {}).items():
                rx[vin] = [(rid, digest, t) for rid, digest, t in f["rx"]]
        checks = [
            self.check_paced(paced, rx),
            self.check_aborted(failing, rx, done, response_timeout_s),
            self.check_windowed(windowed, rx, held_before_open),
            self.check_recall(recall, rx),
        ]
        ok = settled and all(c for c in checks)
        if not settled:
            print(f"FAIL: the campaigns did not all end within {DEADLINE_S:g} s")
        if ok:
            print(
                "PASS: campaign control: paced at its rate, aborted at its criterion and refused after, "
                "held until its window opened, the high-priority recall overtook the queued update"
            )
        return 0 if ok else 1

    def check_paced(self, vins: list[str], rx: dict[str, list[tuple[str, str, float]]]) -> bool:
        firsts = sorted(next((t for rid, _, t in rx.get(v, []) if rid == PACED), float("inf")) for v in vins)
        got = [t for t in firsts if t != float("inf")]
        per_s = PACED_PER_MINUTE / 60
        ahead = PACED_SLACK + per_s * (self.marks["paced"] - self.marks["policies"])
        too_soon = [k for k, t in enumerate(got) if t - got[0] < (k - ahead) / per_s]
        span = got[-1] - got[0] if len(got) > 1 else 0.0
        achieved = (len(got) - 1) / span if span else float("inf")
        print(
            f"  {PACED:<24} {len(got)}/{len(vins)} delivered over {span:.2f} s: {achieved:.1f}/s; the policy "
            f"(max_per_minute {PACED_PER_MINUTE}) allows {per_s:g}/s after at most {ahead:.0f} at once"
        )
        if len(got) != len(vins) or too_soon:
            print(f"FAIL: {PACED}: {len(got)} of {len(vins)} delivered, {len(too_soon)} started ahead of the rate")
            return False
        return True

    def check_aborted(
        self, vins: list[str], rx: dict[str, list[tuple[str, str, float]]], done: bool, response_timeout_s: float
    ) -> bool:
        aborted = self.events(ABORTED, "aborted")
        cut = [c for c in self.events(ABORTED, "cancelled") if c.get("reason") == "aborted"]
        refused = [r for r in self.events(ABORTED, "rejected") if r.get("reason") == "aborted"]
        sent = sum(1 for v in vins if any(rid == ABORTED for rid, _, _ in rx.get(v, [])))
        cancelled = int(cut[0].get("cancelled") or 0) if cut else 0
        doc = aborted[0] if aborted else {}
        print(
            f"  {ABORTED:<24} aborted: {json.dumps(doc.get('criterion'))} crossed at {json.dumps(doc.get('counts'))}; "
            f"{sent}/{len(vins)} vehicles got it, {cancelled} rows cancelled (reason aborted), a later batch "
            + ("refused (aborted)" if refused else "not refused")
        )
        if not (done and aborted and cut and cancelled > 0 and sent < len(vins) and refused):
            print(f"FAIL: {ABORTED}: want an aborted event, rows cancelled with reason aborted, the next batch refused")
            return False
        return True

    def check_windowed(self, vins: list[str], rx: dict[str, list[tuple[str, str, float]]], held: float) -> bool:
        times = [t for v in vins for rid, _, t in rx.get(v, []) if rid == WINDOWED]
        early = [t for t in times if t < self.marks["open"]]
        waited = self.marks["open"] - self.marks["paced"]
        took = max(times, default=self.marks["open"]) - self.marks["open"]
        print(
            f"  {WINDOWED:<24} held {waited:.1f} s outside its window (sdv_fanout_campaigns_held {held:g}), "
            f"then {len(times)}/{len(vins)} delivered within {took:.1f} s of the window opening"
        )
        if early or len(times) != len(vins) or held < 1:
            print(f"FAIL: {WINDOWED}: {len(early)} sent before its window, {len(times)} of {len(vins)} after it")
            return False
        return True

    def check_recall(self, vins: list[str], rx: dict[str, list[tuple[str, str, float]]]) -> bool:
        orders = [[rid for rid, _, _ in rx.get(v, []) if rid in (UPDATE, RECALL)] for v in vins]
        first = sum(1 for o in orders if o[:1] == [RECALL])
        print(f"  {RECALL:<24} stored after {UPDATE}, priority high: {first}/{len(vins)} vehicles got the recall first")
        if first != len(vins) or any(o != [RECALL, UPDATE] for o in orders):
            print(f"FAIL: {RECALL}: want every vehicle to get the recall, then the update: {orders}")
            return False
        return True


def _spec(vin: str, role: str) -> dict[str, Any]:
    """A demo.fleet vehicle that PUBACKs after 10 ms, heartbeats every 4 s and does not answer."""
    return {
        "vin": vin,
        "role": role,
        "ack_ms": 10,
        "hb_s": 4.0,
        "hb_phase_s": 1.0,
        "back_s": 1.0,
        "answers": False,
        "answer_ms": 30,
        "dtc": [],
    }
