"""A slice of a simulated fleet in its own process (paho's select() loop caps one process at
about 330 clients): connect and subscribe the given vehicles, then report what they received.

Protocol on stdout, one JSON object per line: {"ready": n} once every vehicle is subscribed, then
{"done": {vin: [topic, ...]}} when each vehicle got `expect` messages (or the deadline passed).
Used by the 1,000-vehicle end-to-end test and bench/e2e.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from testkit.emqx_sim import FakeEmqx


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--exhook-port", type=int, required=True)
    p.add_argument("--mqtt-port", type=int, required=True)
    p.add_argument("--delivery-clientid", required=True)
    p.add_argument("--vins", required=True, help="comma-separated")
    p.add_argument("--expect", type=int, required=True)
    p.add_argument("--deadline-s", type=float, default=300)
    args = p.parse_args()
    emqx = FakeEmqx(args.exhook_port, args.mqtt_port, delivery_clientid=args.delivery_clientid)
    emqx.load()
    vehicles = []
    try:
        for vin in args.vins.split(","):
            v = emqx.vehicle(vin)
            v.connect()
            v.subscribe()
            vehicles.append(v)
        print(json.dumps({"ready": len(vehicles)}), flush=True)
        deadline = time.monotonic() + args.deadline_s
        while time.monotonic() < deadline and any(len(v.received) < args.expect for v in vehicles):
            emqx.check()
            time.sleep(0.05)  # a progress poll with a deadline, not synchronisation
        result = {v.vin: [r.topic for r in v.received] for v in vehicles}
        stamps = [r.time for v in vehicles for r in v.received]
        print(json.dumps({"done": result, "first": min(stamps, default=0), "last": max(stamps, default=0)}), flush=True)
    finally:
        emqx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
