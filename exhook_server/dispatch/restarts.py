"""Which EMQX node restarts to act on: a node's start time (our clock minus the uptime EMQX reports
in OnProviderLoaded) newer than what this process knew — at first, newer than this process's own
start. A reload of the same incarnation (EMQX reloads a provider after a health check) is not a
restart; the slack absorbs the call's latency and the clocks' rounding."""

from __future__ import annotations

from collections.abc import Callable

from storage.model import now_ms

#: Start times this close to a known one are the same incarnation of the node.
SLACK_MS = 2_000


class NodeStarts:
    """The newest start time seen per EMQX node."""

    __slots__ = ("_baseline", "_known")

    def __init__(self, clock_ms: Callable[[], int] = now_ms) -> None:
        #: Sessions we hold were all made after this: a node started before it is not new to us.
        self._baseline = clock_ms()
        self._known: dict[str, int] = {}

    def restarted(self, node: str, started_ms: int) -> bool:
        """Record `node`'s start time; True when it is a restart we have not acted on."""
        last = self._known.get(node, self._baseline)
        if started_ms <= last + SLACK_MS:
            return False
        self._known[node] = started_ms
        return True
