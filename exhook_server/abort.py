"""Automatic abort: a campaign policy's `abort` criteria, checked as the request's outcomes come in.

Each outcome of a request whose policy has criteria starts (or prolongs) a watch of it: its counts
are read from the store (`Reads.outcome_counts`; finished = every pair with an outcome) at once,
then every `settle_s` while outcomes keep coming and once more `settle_s` after the last (an LMDB
ack's end commits after it is told). A crossed criterion is recorded with the start of the
request's cancel of every vehicle (`Writes.abort`, one transaction, once per policy whichever
process or instance comes first); the one that recorded it emits `aborted` and walks the cancel.
Once the broker took the event, the record says so (`announced_ms`); one the process died before
is emitted by the leader (`announce`) from the record, at its start and on each refresh.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import orjson
import structlog

from exhook_server import metrics
from exhook_server.aio import cancel_all
from exhook_server.cancel import Cancels
from exhook_server.config import Config
from exhook_server.dispatch.gates import Gates
from exhook_server.policy import AbortCriterion
from exhook_server.status import StatusPublisher
from storage.errors import StorageError
from storage.model import COUNT_NAMES, Generation, Outcome, StoredPolicy, now_ms
from storage.port import Reads, Writes

log = structlog.get_logger("sdv_fanout.abort")

#: Seconds between two checks of a request whose outcomes keep coming, and from its last outcome
#: to its last check (at least twice ack_commit_delay_ms, how long an LMDB ack's end may wait for
#: its commit): short enough to abort well within a second of the crossing, and at most 5 reads
#: a second per watched request and process.
SETTLE_S = 0.2
#: An abort recorded this long ago whose event the broker has not taken yet is emitted by the
#: leader on its refresh (its recorder died first, or its broker was away that long: then the
#: platform hears it twice, never not at all). At the leader's start, every such one at once.
ANNOUNCE_GRACE_S = 10.0
#: How long a stop waits for the records of events the broker took (one short write each).
MARK_WAIT_S = 2.0


def abort_counts(gens: list[Generation], answers_failed: int) -> dict[str, int]:
    """A request's counts over its generations, with `finished` (pairs with an outcome) and
    `answer_failed` (answers whose status was failed or rejected): what criteria are judged on."""
    counts = {name: sum(g.counts[name] for g in gens) for name in COUNT_NAMES}
    counts["finished"] = sum(counts[o.label] for o in Outcome)
    counts["answer_failed"] = answers_failed
    return counts


class Aborts:
    """Watches the requests whose policy has abort criteria, and aborts those that cross one."""

    def __init__(
        self,
        cfg: Config,
        reads: Reads,
        writes: Writes,
        gates: Gates,
        cancels: Cancels,
        status: StatusPublisher | None = None,
        clock: Callable[[], int] = now_ms,
        settle_s: float | None = None,
    ) -> None:
        self._cfg = cfg
        self._reads = reads
        self._writes = writes
        self._gates = gates
        self._cancels = cancels
        self._status = status
        self._clock = clock
        self._settle_s = max(SETTLE_S, 2 * cfg.ack_commit_delay_ms / 1000) if settle_s is None else settle_s
        #: request id → the task watching it; the loop time its last outcome was told.
        self._watching: dict[str, asyncio.Task[None]] = {}
        self._told: dict[str, float] = {}
        #: (request id, abort record) of the `aborted` events emitted by this process: each once.
        self._emitted: set[tuple[str, bytes]] = set()
        #: The writes of `announced_ms` under way.
        self._marking: set[asyncio.Task[None]] = set()

    def outcome(self, vin: str, request_id: str, sha1: bytes, outcome: Outcome, attempts: int) -> None:
        """An outcome of `request_id` (an OutcomeListener): watch it if its policy has criteria."""
        policy = self._gates.policy(request_id)
        if policy is None or not policy.abort or self._gates.aborted(request_id):
            return
        self.watch(request_id)

    def watch(self, request_id: str) -> None:
        """Check `request_id` now and `settle_s` after (a policy with criteria was set: the counts
        so far may cross them already)."""
        loop = asyncio.get_running_loop()
        self._told[request_id] = loop.time()
        if request_id not in self._watching:
            self._watching[request_id] = loop.create_task(self._watch(request_id), name=f"abort-watch-{request_id}")

    async def _watch(self, request_id: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                started = loop.time()
                if await self.check(request_id):
                    return
                if started - self._told.get(request_id, started) >= self._settle_s:
                    return  # this check began settle_s after the last outcome: it saw every one
                await asyncio.sleep(self._settle_s)
        finally:
            self._watching.pop(request_id, None)
            self._told.pop(request_id, None)

    async def check(self, request_id: str) -> bool:
        """Judge `request_id`'s counts now; True when nothing is left to watch (no criteria, or aborted)."""
        policy = self._gates.policy(request_id)
        if policy is None or not policy.abort or self._gates.aborted(request_id):
            return True
        try:
            gens, answers_failed = await self._reads.outcome_counts(request_id)
            counts = abort_counts(gens, answers_failed)
            crossed = next((c for c in policy.abort if c.crossed(counts)), None)
            if crossed is None:
                return False
            await self._abort(request_id, crossed, counts)
        except StorageError as exc:  # the next outcome, or the next check, tries again
            log.error("abort_check_failed", request_id=request_id, reason=type(exc).__name__, detail=str(exc))
            return False
        return True

    async def _abort(self, request_id: str, criterion: AbortCriterion, counts: dict[str, int]) -> None:
        now = self._clock()
        shown: dict[str, Any] = {"criterion": criterion.as_doc(), "counts": counts}
        record = orjson.dumps({**shown, "at_ms": now})
        first = await self._writes.abort(request_id, record, now, self._cfg.cancel_rows)
        self._gates.mark_aborted(request_id)
        if first is None:
            log.info("campaign_abort_found", request_id=request_id)  # another process or instance won
            return
        metrics.ABORTS.inc()
        log.warning("campaign_aborted", request_id=request_id, cancelled=first.total, more=first.more, **shown)
        self._emit(request_id, record, shown)
        self._cancels.walk(first)

    def _emit(self, request_id: str, record: bytes, shown: dict[str, Any]) -> None:
        """The `aborted` event of the abort `record`; once the broker took it, the record says so."""
        if self._status is None:
            return
        self._emitted.add((request_id, record))
        self._status.emit("aborted", request_id, on_sent=lambda: self._sent(request_id, record), **shown)

    def _sent(self, request_id: str, record: bytes) -> None:
        task = asyncio.get_running_loop().create_task(self._mark(request_id, record), name=f"abort-sent-{request_id}")
        self._marking.add(task)
        task.add_done_callback(self._marking.discard)

    async def _mark(self, request_id: str, record: bytes) -> None:
        amended = orjson.dumps({**orjson.loads(record), "announced_ms": self._clock()})
        try:
            await self._writes.amend_abort(request_id, record, amended)
        except StorageError as exc:  # the leader's next start emits it once more
            log.error("abort_event_not_recorded", request_id=request_id, reason=type(exc).__name__, detail=str(exc))

    def announce_due(self, found: list[StoredPolicy], grace_ms: int | None) -> int:
        """Emit the `aborted` event of each abort in `found` whose record says the broker never
        took it, that this process has not emitted, and (unless `grace_ms` is None) that was
        recorded at least `grace_ms` ago. Returns how many."""
        now = self._clock()
        emitted = 0
        for stored in found:
            record = stored.aborted
            if record is None or (stored.request_id, record) in self._emitted:
                continue
            doc = orjson.loads(record)
            if "announced_ms" in doc or (grace_ms is not None and now - int(doc.get("at_ms", 0)) < grace_ms):
                continue
            log.warning("campaign_abort_announced_late", request_id=stored.request_id, at_ms=doc.get("at_ms"))
            self._emit(stored.request_id, record, {"criterion": doc.get("criterion"), "counts": doc.get("counts")})
            emitted += 1
        return emitted

    async def announce(self, refresh_s: float) -> None:
        """Forever (the leader's job): every `refresh_s`, the `aborted` events the broker never
        took (`announce_due`): at once at the start, then those older than ANNOUNCE_GRACE_S."""
        grace_ms: int | None = None
        while True:
            try:
                self.announce_due(await self._writes.policies(), grace_ms)
            except StorageError as exc:
                log.error("abort_events_not_checked", reason=type(exc).__name__, detail=str(exc))
            else:
                grace_ms = round(ANNOUNCE_GRACE_S * 1000)
            await asyncio.sleep(refresh_s)

    async def stop(self) -> None:
        """Stop watching (an abort already recorded finishes its cancel at the next start-up);
        the records of events the broker took are written first (for at most MARK_WAIT_S)."""
        if self._marking:
            await asyncio.wait(set(self._marking), timeout=MARK_WAIT_S)
        await cancel_all([*self._watching.values(), *self._marking])
