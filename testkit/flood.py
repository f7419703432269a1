"""A flood of large batch calls against a server, and the memory it costs: shared by
tests/integration/test_flood.py and bench/flood.py.

`flood` plays several EMQX pool connections that each fire many OnMessagePublish calls at
once; `RssSampler` follows the resident memory of the server's processes meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from exhook_server._proto import exhook_v3_pb2 as pb
from testkit.plumbing import rss_bytes

_METHOD = "/emqx.exhook.v3.HookProvider/OnMessagePublish"
#: What a batch answered UNAVAILABLE because its commit ran past the deadline says (storage.port.durable_within).
COMMIT_TIMEOUT = "commit took longer than"


def status_kb(pid: int, field_name: str) -> int:
    """One `VmXxx:` line of /proc/<pid>/status in KiB (0 for a process that is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    for line in text.splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    return 0


def hwm_bytes(pids: list[int]) -> int:
    """Sum of each process's own peak RSS: at least the peak of the group as a whole."""
    return sum(status_kb(p, "VmHWM") for p in pids) << 10


class RssSampler:
    """Samples the summed RSS of some processes every few milliseconds in a thread."""

    def __init__(self, pids: list[int], interval_s: float = 0.02) -> None:
        self.pids = pids
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pids))
            self._stop.wait(self.interval_s)


def batch_request(request_id: str, vin: str, data: str) -> bytes:
    """A serialized OnMessagePublish request carrying one seed-format batch on `$SDV-FANOUT`."""
    payload = json.dumps({"ids": [vin], "request_id": request_id, "data": data}).encode()
    msg = pb.Message(
        node="emqx@127.0.0.1",
        id=os.urandom(16).hex().upper(),
        qos=1,
        topic="$SDV-FANOUT",
        payload=payload,
        timestamp=int(time.time() * 1000),
        headers={"username": "platform", "protocol": "mqtt", "peerhost": "127.0.0.1"},
    )
    setattr(msg, "from", "sdv-platform")
    return bytes(pb.MessagePublishRequest(message=msg).SerializeToString())


@dataclass
class FloodResult:
    """What the server answered: status code name → count, and the request ids stored."""

    codes: collections.Counter[str] = field(default_factory=collections.Counter)
    stored: list[tuple[str, str, bytes]] = field(default_factory=list)  # (vin, request_id, sha1 of data)
    #: Answered UNAVAILABLE for a commit past its deadline: the write may still land (storage/port.py).
    undecided: list[tuple[str, str, bytes]] = field(default_factory=list)
    details: dict[str, str] = field(default_factory=dict)  # one example per error code
    seconds: float = 0.0


async def _flood(port: int, channels: int, calls: int, payload_bytes: int, blobs: int, timeout_s: float) -> FloodResult:
    result = FloodResult()
    options = [
        ("grpc.max_receive_message_length", -1),
        ("grpc.max_send_message_length", -1),
        ("grpc.use_local_subchannel_pool", 1),  # one TCP connection per channel, like EMQX's pool
    ]
    chans = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(channels)]
    # A few distinct payloads (as the platform sends: many batches, few firmware images); each
    # call has its own request id so every stored row can be checked.
    # Like EMQX's long-lived pool connections, each has seen the server's HTTP/2 SETTINGS (its stream
    # limit) before the flood: a fresh connection's first burst would have its excess streams refused.
    for ch in chans:
        await ch.unary_unary("/emqx.exhook.v3.HookProvider/OnSessionTakenover")(b"", timeout=timeout_s)
    datas = [chr(ord("a") + i % 26) * (payload_bytes - 256) for i in range(blobs)]  # JSON around it: ~payload_bytes
    sha1s = [hashlib.sha1(d.encode()).digest() for d in datas]
    started = time.monotonic()

    async def one(ch: int, n: int) -> None:
        vin, rid, blob = f"VIN{ch:02d}{n:05d}", f"task_flood_{ch}_{n}", (ch * calls + n) % blobs
        stub = chans[ch].unary_unary(_METHOD)  # raw bytes both ways: no client-side copies to parse
        try:
            await stub(batch_request(rid, vin, datas[blob]), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            result.codes[exc.code().name] += 1
            result.details.setdefault(exc.code().name, exc.details() or "")
            if exc.code() is grpc.StatusCode.UNAVAILABLE and COMMIT_TIMEOUT in (exc.details() or ""):
                result.undecided.append((vin, rid, sha1s[blob]))
            return
        result.codes["OK"] += 1
        result.stored.append((vin, rid, sha1s[blob]))

    try:
        await asyncio.gather(*(one(ch, n) for ch in range(channels) for n in range(calls)))
    finally:
        for ch in chans:
            await ch.close()
    result.seconds = time.monotonic() - started
    return result


def flood(
    port: int,
    *,
    channels: int = 2,
    calls: int = 500,
    payload_bytes: int = 1 << 20,
    blobs: int = 8,
    timeout_s: float = 60.0,
) -> FloodResult:
    """`channels` connections x `calls` concurrent batch calls of about `payload_bytes` each."""
    return asyncio.run(_flood(port, channels, calls, payload_bytes, blobs, timeout_s))
