"""The platform's side of the status topic for the benches: a helper process whose paho client is
subscribed QoS 1 to `<prefix>/#` and counts the status messages, in its own process so that its work
never holds the measuring process's GIL. `StatusListener` starts it and asks for the counts: all
events, events per mode (request ids `task_<mode>_...`), and the summed counts of the `completed`
generations per mode.

    python -m testkit.status_listener --port P [--name N] [--prefix $SDV-FANOUT/status]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from testkit.plumbing import Child

STATUS_PREFIX = "$SDV-FANOUT/status"  # status_topic_prefix's default


class StatusListener:
    """The helper process, asked over JSON lines; `stop()` ends it."""

    def __init__(self, port: int, name: str, log_dir: Path, timeout_s: float = 15.0) -> None:
        argv = [sys.executable, "-m", "testkit.status_listener", "--port", str(port), "--name", name]
        self.child = Child(f"platform-{name}", argv, log_dir / f"platform-{name}.log")
        try:
            self.child.recv(timeout_s)  # {"ready": true}: subscribed
        except BaseException:
            self.child.stop()
            raise

    def counts(self) -> dict[str, Any]:
        """{"counts": by event, "events": by mode and event, "completed": summed counts by mode,
        "completed_gens": completed generations by mode, "idle_s": since the last message}."""
        self.child.send({"cmd": "counts"})
        return self.child.recv(10)

    def snapshot(self) -> Counter[str]:
        return Counter(self.counts()["counts"])

    def settle(self, quiet_s: float = 0.5, timeout_s: float = 10.0) -> dict[str, Any]:
        """The counts once nothing arrived for `quiet_s` (at most `timeout_s` of waiting)."""
        deadline = time.monotonic() + timeout_s
        answer = self.counts()
        while answer["idle_s"] < quiet_s and time.monotonic() < deadline:
            time.sleep(0.1)
            answer = self.counts()
        return answer

    def settled_counts(self, quiet_s: float = 0.5, timeout_s: float = 10.0) -> Counter[str]:
        return Counter(self.settle(quiet_s, timeout_s)["counts"])

    def wait_for(self, event: str, n: int, timeout_s: float) -> int:
        """Wait (bounded) until `n` messages of `event` arrived; how many did."""
        deadline = time.monotonic() + timeout_s
        while (got := self.snapshot()[event]) < n and time.monotonic() < deadline:
            time.sleep(0.2)
        return got

    def wait_completed(self, gens: dict[str, int], timeout_s: float) -> dict[str, Any]:
        """Wait (bounded) until every mode has `gens[mode]` completed generations."""
        deadline = time.monotonic() + timeout_s
        answer = self.counts()
        while time.monotonic() < deadline and any(answer["completed_gens"].get(m, 0) < n for m, n in gens.items()):
            time.sleep(0.2)
            answer = self.counts()
        return answer

    def stop(self) -> None:
        self.child.stop()


def since(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """What grew from one count to the next (the status messages of one measurement), by name."""
    return {k: after[k] - before.get(k, 0) for k in sorted(after) if after[k] - before.get(k, 0)}


def mode_of(request_id: str) -> str:
    """The mode of a bench's request id `task_<mode>_<tag>_<k>`."""
    parts = request_id.split("_")
    return parts[1] if len(parts) > 2 and parts[0] == "task" else "?"


class Tally:
    """What the listener has seen; every method runs under the caller's lock."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.events: dict[str, Counter[str]] = {}
        self.completed: dict[tuple[str, str], dict[str, int]] = {}  # (request_id, sha1) -> counts

    def record(self, doc: dict[str, Any]) -> None:
        event, rid = doc.get("event", "?"), str(doc.get("request_id", ""))
        self.counts[event] += 1
        self.events.setdefault(mode_of(rid), Counter())[event] += 1
        if event == "completed":
            self.completed[rid, str(doc.get("sha1"))] = dict(doc.get("counts") or {})

    def answer(self) -> dict[str, Any]:
        sums: dict[str, Counter[str]] = {}
        gens: Counter[str] = Counter()
        for (rid, _), counts in self.completed.items():
            sums.setdefault(mode_of(rid), Counter()).update(counts)
            gens[mode_of(rid)] += 1
        return {
            "counts": dict(self.counts),
            "events": {m: dict(c) for m, c in self.events.items()},
            "completed": {m: dict(c) for m, c in sums.items()},
            "completed_gens": dict(gens),
        }


def main() -> int:
    """Subscribe, print {"ready": true}, then answer each {"cmd": "counts"} line on stdin until
    another line or EOF."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True, help="the broker's MQTT port on 127.0.0.1")
    p.add_argument("--name", default="platform", help="part of the clientid")
    p.add_argument("--prefix", default=STATUS_PREFIX, help="status_topic_prefix")
    args = p.parse_args()
    tally, lock, subscribed = Tally(), threading.Lock(), threading.Event()
    last = [time.monotonic()]

    def message(_client: Any, _userdata: Any, msg: Any) -> None:
        doc = json.loads(msg.payload)
        with lock:
            tally.record(doc)
            last[0] = time.monotonic()

    clientid = f"bench-platform-{args.name}-{os.getpid()}"
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=clientid, protocol=mqtt.MQTTv5)
    client.on_connect = lambda c, *_: c.subscribe(f"{args.prefix}/#", qos=1)
    client.on_subscribe = lambda *_: subscribed.set()
    client.on_message = message
    client.connect("127.0.0.1", args.port)
    client.loop_start()
    try:
        if not subscribed.wait(10):
            print("no SUBACK within 10 s", file=sys.stderr)
            return 1
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            if json.loads(line).get("cmd") != "counts":
                break
            with lock:
                reply = {**tally.answer(), "idle_s": time.monotonic() - last[0]}
            print(json.dumps(reply), flush=True)
    finally:
        client.disconnect()
        client.loop_stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
