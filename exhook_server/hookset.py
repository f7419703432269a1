"""Noticing, at run time, that EMQX holds another hook list than this server asks for.

EMQX reads a server's hooks and topic filters once, when it loads it, and keeps them across our
restarts. A call for a hook we did not ask for, or on a topic outside our filters, is logged
(`hook_set_mismatch`, at most once a minute per hook) and counted. A missing hook sends no call: a
server not loaded within `hook_set_confirm_s` of its start compares EMQX's list through the REST API
when emqx_api_url is set (`emqx_sync`), else logs `hook_set_unconfirmed`. A group's processes share
the confirmation (`procs`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog

from exhook_server import metrics
from exhook_server.config import Config
from exhook_server.topics import filter_matches

log = structlog.get_logger("sdv_fanout.hookset")

#: At most one log line per hook this often (every call is counted).
LOG_EVERY_S = 60.0
_HINT = "EMQX holds an older hook list for this server: run `sdv-fanout emqx sync` (it reloads the ExHook)"


def hook_of(rpc: str) -> str:
    """The EMQX hook point an ExHook RPC stands for: OnSessionTakenover -> session.takenover."""
    words = re.findall(r"[A-Z][a-z]*", rpc.removeprefix("On"))
    return ".".join([words[0].lower(), "".join(words[1:]).lower()]) if len(words) > 1 else rpc


class HookSetWatch:
    """What the hook servicer reports about the calls EMQX makes; one per server process.

    `confirmed` is a one-byte buffer shared by the processes of a group (any writable buffer
    with one byte will do); `clock` is injectable for the rate limit.
    """

    def __init__(
        self,
        cfg: Config,
        wanted: Mapping[str, Sequence[str]],
        confirmed: Any,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cfg = cfg
        #: The hooks this server asks for, with their topic filters (none: every topic).
        self.wanted = {name: tuple(filters) for name, filters in wanted.items()}
        self._confirmed = confirmed
        self._clock = clock
        self._quiet_until: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}
        self._counters = {name: metrics.HOOK_SET_MISMATCH.labels(name) for name in wanted}
        metrics.HOOK_SET_CONFIRMED.set(1 if self.confirmed else 0)

    @property
    def confirmed(self) -> bool:
        """True once EMQX loaded a process of this group, or its hook list was found equal to ours."""
        return bool(self._confirmed[0])

    def confirm(self) -> None:
        """EMQX's hook list is ours (it just loaded us, or a check compared it)."""
        self._confirmed[0] = 1
        metrics.HOOK_SET_CONFIRMED.set(1)

    def mismatch(self, hook: str, *, every_time: bool = False, **fields: Any) -> None:
        """A sign that EMQX holds another list: counted always, logged once a minute per hook
        (`every_time`: logged whatever came before, for a one-off finding)."""
        counter = self._counters.get(hook) or metrics.HOOK_SET_MISMATCH.labels(hook)
        self._counters[hook] = counter
        counter.inc()
        now = self._clock()
        if now < self._quiet_until.get(hook, 0.0) and not every_time:
            self._unlogged[hook] = self._unlogged.get(hook, 0) + 1
            return
        log.warning(
            "hook_set_mismatch",
            hook=hook,
            not_logged_before=0 if every_time else self._unlogged.pop(hook, 0),
            hint=_HINT,
            **fields,
        )
        if not every_time:
            self._quiet_until[hook] = now + LOG_EVERY_S

    def unexpected_call(self, rpc: str) -> None:
        """EMQX called a hook this server did not ask for."""
        self.mismatch(hook_of(rpc), reason="not_registered")

    def unexpected_topic(self, rpc: str, topic: str) -> None:
        """A call on a topic this server has no use for: a mismatch unless one of the hook's
        filters matches it (EMQX calls only for topics that match a filter it holds)."""
        hook = hook_of(rpc)
        if not any(filter_matches(f, topic) for f in self.wanted.get(hook, ())):
            self.mismatch(hook, reason="topic_not_registered", topic=topic[:200])

    def deadline_passed(self, check: Callable[[], list[str]] | None, *, quiet: bool = False) -> bool:
        """`hook_set_confirm_s` after start: unless EMQX loaded us meanwhile, compare EMQX's list
        with `check` (the differences, one per hook, "+ name ..." / "- name ..." / "~ name ..."),
        or say it cannot be confirmed. False when the check could not answer (EMQX unreachable or
        not connected to us yet: worth asking again; `quiet` logs nothing then)."""
        if self.confirmed:
            return True
        if check is None:
            log.warning(
                "hook_set_unconfirmed",
                waited_s=self._cfg.hook_set_confirm_s,
                hint="EMQX did not load this server since it started and keeps the hook list it loaded"
                " before; if settings that change it changed (ack_topic_prefix, topics), run"
                " `sdv-fanout emqx sync`, or set emqx_api_url to have it checked",
            )
            return True
        try:
            differences = check()
        except Exception as exc:  # the API unreachable or refusing: a hint, not a failure
            if not quiet:
                log.warning("hook_set_unconfirmed", reason="emqx_check_failed", detail=str(exc)[:300])
            return False
        if not differences:
            self.confirm()
            log.info("hook_set_confirmed", source="emqx_api")
            return True
        for line in differences:
            self.mismatch(line.split()[1], every_time=True, reason="emqx_holds_other_list", difference=line)
        return True
