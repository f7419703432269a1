"""In-memory stand-ins for the dispatch seams (RowSource, Publisher) and a deterministic clock.

Used by the rule tests and the randomized simulation; the integration tests use
the real LMDB store and a real broker instead.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from storage.keys import Row


def sha1(payload: bytes) -> bytes:
    return hashlib.sha1(payload).digest()


@dataclass
class MemoryRows:
    """Pending rows per VIN, with the same ordering and conditional delete as the store."""

    rows: dict[tuple[str, str], tuple[int, bytes]] = field(default_factory=dict)
    clock: int = 0
    #: Acked rows whose delete is not committed yet (committed by `commit_acks`): hidden
    #: from `oldest` meanwhile, as StoreRows hides them.
    pending_acks: list[tuple[str, str, bytes]] = field(default_factory=list)
    defer_acks: bool = False

    def add(self, vin: str, request_id: str, payload: bytes) -> None:
        self.clock += 1
        self.rows[vin, request_id] = (self.clock, payload)

    def oldest(self, vin: str) -> tuple[Row, bytes] | None:
        hidden = {(v, rid, digest) for v, rid, digest in self.pending_acks}
        mine = [(ts, rid, p) for (v, rid), (ts, p) in self.rows.items() if v == vin and (v, rid, sha1(p)) not in hidden]
        if not mine:
            return None
        ts, rid, payload = min(mine)
        return Row(vin, rid, ts, sha1(payload), len(payload)), payload

    def ack(
        self, vin: str, request_id: str, digest: bytes, *, outcome: Any = None, attempts: int = 1, response: bytes = b""
    ) -> bool:
        current = self.rows.get((vin, request_id))
        if current is None or sha1(current[1]) != digest or (vin, request_id, digest) in self.pending_acks:
            return False
        self.pending_acks.append((vin, request_id, digest))
        if not self.defer_acks:
            self.commit_acks()
        return True

    def acking(self, vin: str, request_id: str, digest: bytes) -> bool:
        return (vin, request_id, digest) in self.pending_acks

    def commit_acks(self) -> None:
        acks, self.pending_acks = self.pending_acks, []
        for vin, rid, digest in acks:
            current = self.rows.get((vin, rid))
            if current is not None and sha1(current[1]) == digest:
                del self.rows[vin, rid]


@dataclass
class RecordingPublisher:
    """Records every publish; `up=False` plays a lost broker connection."""

    sent: list[tuple[str, str, bytes]] = field(default_factory=list)
    up: bool = True

    def publish(self, vin: str, request_id: str, payload: bytes, expires_ms: int = 0) -> bool:
        if not self.up:
            return False
        self.sent.append((vin, request_id, payload))
        return True


@dataclass
class ManualClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now
