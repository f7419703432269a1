"""Which requests may not start a delivery now, and which go first: their campaign policies.

A request is held while its policy is `paused`, before its `start_at`, or outside all of its
`windows` (exhook_server/policy.py decides each); `high()` names those whose policy says priority
"high". `Gates` keeps the policies in force in memory (set at once by this process, refreshed from
the store by `run`, so every process and instance follows a change within `refresh_s`) and answers
`held()` from a set recomputed at most once per `recheck_ms`: the delivery path pays a set lookup.
When a request's gate opens, `on_open` is told, to offer its rows to their vehicles again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from exhook_server import metrics
from exhook_server.policy import Policy
from storage.errors import StorageError
from storage.model import StoredPolicy, now_ms

log = structlog.get_logger("sdv_fanout.gates")

#: How stale the held set may be: a window or start_at opens (or closes) within this.
RECHECK_MS = 1000

_NONE: frozenset[str] = frozenset()


class Gates:
    """The held request ids, from the policies in force."""

    def __init__(
        self,
        clock: Callable[[], int] = now_ms,
        on_open: Callable[[str], None] | None = None,
        recheck_ms: int = RECHECK_MS,
    ) -> None:
        self._clock = clock
        self.on_open = on_open
        self._recheck_ms = recheck_ms
        #: request id → its policy, only those that can hold (paused, start_at or windows).
        self._gated: dict[str, Policy] = {}
        #: The stored form each policy was last read from, with what it decoded to (None: unreadable),
        #: so a reload decodes (and logs) only the policies that changed since the last one.
        self._read: dict[str, tuple[bytes, Policy | None]] = {}
        self._held: frozenset[str] = _NONE
        self._checked_ms: int | None = None
        #: Told of every policy in force after each reload: (request id, policy, set_ms).
        self.on_reload: Callable[[list[tuple[str, Policy, int]]], None] | None = None
        #: request ids whose policy says priority "high" (a new set object on every change).
        self._high: frozenset[str] = _NONE
        #: Requests aborted under their policy in force (as last read, or aborted since here).
        self._aborted: set[str] = set()

    def set(self, request_id: str, policy: Policy | None) -> None:
        """The policy of `request_id` is now `policy` (None: none); a new policy re-opens an aborted request."""
        if policy is not None and (policy.paused or policy.start_at_ms or policy.windows):
            self._gated[request_id] = policy
        else:
            self._gated.pop(request_id, None)
        high = policy is not None and policy.priority == "high"
        if high != (request_id in self._high):
            self._high = self._high | {request_id} if high else self._high - {request_id}
        if policy is None:
            self._read.pop(request_id, None)
        else:
            self._read[request_id] = (policy.encode(), policy)
        self._aborted.discard(request_id)
        self._recheck()

    def policy(self, request_id: str) -> Policy | None:
        """The policy of `request_id` in force, as this process knows it."""
        found = self._read.get(request_id)
        return None if found is None else found[1]

    def aborted(self, request_id: str) -> bool:
        """Whether `request_id` stands aborted under its policy in force, as this process knows it."""
        return request_id in self._aborted

    def mark_aborted(self, request_id: str) -> None:
        """`request_id` was aborted (here or, as the store answered, elsewhere) until the next reload says."""
        self._aborted.add(request_id)

    def replace_all(self, found: list[StoredPolicy]) -> None:
        """Every policy in force, as the store has them."""
        gated = {}
        high = set()
        read: dict[str, tuple[bytes, Policy | None]] = {}
        for stored in found:
            before = self._read.get(stored.request_id)
            if before is not None and before[0] == stored.doc:
                policy = before[1]
            else:
                try:
                    policy = Policy.decode(stored.doc)
                except Exception as exc:  # a stored policy this build cannot read holds nothing
                    log.error("policy_unreadable", request_id=stored.request_id, error=repr(exc))
                    policy = None
            read[stored.request_id] = (stored.doc, policy)
            if policy is not None and (policy.paused or policy.start_at_ms or policy.windows):
                gated[stored.request_id] = policy
            if policy is not None and policy.priority == "high":
                high.add(stored.request_id)
        self._gated, self._read = gated, read
        if high != self._high:
            self._high = frozenset(high)
        self._aborted = {stored.request_id for stored in found if stored.aborted is not None}
        self._recheck()
        if self.on_reload is not None:
            self.on_reload([(s.request_id, p, s.set_ms) for s in found if (p := read[s.request_id][1]) is not None])

    def held(self) -> frozenset[str]:
        """The request ids whose rows may not start a delivery now."""
        if not self._gated:
            return _NONE
        checked = self._checked_ms
        if checked is None or self._clock() - checked >= self._recheck_ms:
            self._recheck()
        return self._held

    def high(self) -> frozenset[str]:
        """The request ids whose policy gives their rows high priority (the same object until
        the set changes, so a caller may keep what it derived from it)."""
        return self._high

    def _recheck(self) -> None:
        now = self._clock()
        held = frozenset(rid for rid, p in self._gated.items() if p.opens_at(now) != now) if self._gated else _NONE
        opened = self._held - held
        self._held, self._checked_ms = held, now
        metrics.CAMPAIGNS_HELD.set(len(held))
        for rid in sorted(opened):
            log.info("campaign_gate_open", request_id=rid)
            if self.on_open is not None:
                self.on_open(rid)

    async def run(self, load: Callable[[], Awaitable[list[StoredPolicy]]], refresh_s: float) -> None:
        """Forever: reload the policies every `refresh_s` (another process or instance may have
        set one) and re-check the gates; a failure is logged once until a load succeeds again (a
        store outage is one line, not one a second), and the last policies stay in force."""
        failing = False
        while True:
            try:
                found = await load()
            except StorageError as exc:
                if not failing:
                    log.error("policies_not_loaded", reason=type(exc).__name__, detail=str(exc))
                failing = True
            else:
                if failing:
                    log.info("policies_loaded_again", policies=len(found))
                failing = False
                self.replace_all(found)
            await asyncio.sleep(refresh_s)
