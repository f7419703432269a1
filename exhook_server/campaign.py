"""Setting and clearing campaign policies: validated, stored durably, then reported.

`Campaigns.apply` takes a checked policy message (`batch.PolicyDoc`), validates its fields
(exhook_server/policy.py: `bad_policy`), stores it through `Writes.set_policy` (durable when it
returns; `policies_full` past max_policies; a request aborted under its former policy is open
again), puts it in force in this process and, through `tell_others`, in the server's other
processes and (PostgreSQL) instances (so a batch published after the policy's answer is
governed whichever process delivers it), and only then emits the status event `policy` on the
request's status topic, echoing what is in force (`"cleared": true` instead once cleared).
The topic, the Admin API and the CLI all go through it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog

from exhook_server import metrics
from exhook_server.abort import Aborts
from exhook_server.batch import PolicyDoc
from exhook_server.config import Config
from exhook_server.dispatch.gates import Gates
from exhook_server.dispatch.pacing import Pacer
from exhook_server.errors import BatchRejected, Reason
from exhook_server.policy import Policy, parse_fields
from exhook_server.status import StatusPublisher
from storage.errors import PoliciesFull
from storage.model import now_ms
from storage.port import Writes

log = structlog.get_logger("sdv_fanout.campaign")


class Campaigns:
    """Applies policy messages to the store behind `writes`."""

    def __init__(self, cfg: Config, writes: Writes, clock: Callable[[], int] = now_ms) -> None:
        self._cfg = cfg
        self._writes = writes
        self._clock = clock
        #: This process's gates, told of every change at once (others reload within policy_refresh_s).
        self.gates: Gates | None = None
        #: This process's pacing, told the same way.
        self.pacer: Pacer | None = None
        #: This process's abort watch: a policy with criteria is judged at once.
        self.aborts: Aborts | None = None
        #: Puts a stored policy (request id, stored form, set_ms) in force in the server's other
        #: processes and instances before it returns (None: this process is alone).
        self.tell_others: Callable[[str, bytes | None, int], Awaitable[None]] | None = None

    def take(self, request_id: str, policy: Policy | None, set_ms: int) -> None:
        """Put `policy` (None: none) in force in this process's gates and pacing."""
        if self.gates is not None:
            self.gates.set(request_id, policy)
        if self.pacer is not None:
            self.pacer.set(request_id, policy, set_ms)

    def take_stored(self, request_id: str, doc: bytes | None, set_ms: int) -> None:
        """`take` for a policy another process of this server stored (its stored form)."""
        try:
            policy = None if doc is None else Policy.decode(doc)
        except Exception as exc:  # a sibling of another build: its policy follows at the next reload
            log.error("policy_unreadable", request_id=request_id, error=repr(exc))
            return
        self.take(request_id, policy, set_ms)

    async def apply(self, message: PolicyDoc, status: StatusPublisher | None = None) -> Policy | None:
        """Validate, store and report one policy message; the policy now in force (None: none).
        Raises BatchRejected (bad_policy, policies_full) before anything is written, or
        StorageError."""
        policy = parse_fields(message.fields)
        rid = message.request_id
        doc = None if policy is None else policy.encode()
        set_ms = self._clock()
        try:
            had = await self._writes.set_policy(rid, doc, set_ms, self._cfg.max_policies)
        except PoliciesFull as exc:
            raise BatchRejected(Reason.POLICIES_FULL, str(exc), request_id=rid) from None
        self.take(rid, policy, set_ms)
        if self.tell_others is not None:
            await self.tell_others(rid, doc, set_ms)
        if self.aborts is not None and policy is not None and policy.abort:
            self.aborts.watch(rid)
        shown = None if policy is None else policy.as_doc()
        metrics.POLICIES_SET.labels("cleared" if policy is None else "set").inc()
        log.info("policy_set", request_id=rid, policy=shown, replaced=had)
        if status is not None:
            status.emit(
                "policy",
                rid,
                policy=shown,
                cleared=True if policy is None else None,
                correlation_id=message.tags.correlation_id,
            )
        return policy
