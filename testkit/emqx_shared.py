"""Real EMQX brokers shared by the test files of one pytest process: one per (version, settings),
booted on first use, killed by `close()`.

A file must leave its broker as it found it (ExHook entries unregistered before their server
stops, rules and API keys deleted, authorization restored). `SharedBrokers.get` makes sure of it
before each hand-out: leftover client sessions (vehicles', a server's catch-up session) are
discarded, then the broker's configuration must equal the one it booted with (and, on e5.9.1,
no ExHook entry may have come and gone: `KEEPS_DELETED_EXHOOKS`); a broker that fails, or no
longer runs, is killed and a fresh one booted in its place (logged: `shared_emqx_rebooted`).
"""

from __future__ import annotations

import contextlib
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from testkit.emqx_real import EmqxApiError, EmqxBroker, EmqxError, started_emqx
from testkit.harness import poll

log = structlog.get_logger("sdv_fanout.testkit.emqx_shared")

#: What a file may change through the REST API and must put back; compared as EMQX returns it.
CONFIG_PATHS = (
    "/exhooks",
    "/rules",
    "/api_key",
    "/banned",
    "/authorization/sources",
    "/authorization/settings",
)
#: Versions whose ExHook manager can keep a deleted entry in its ordering: the next entry added
#: then crashes it (`config_not_found` for the deleted entry's `order`), though `GET /exhooks`
#: lists nothing. Seen on e5.9.1 after one file's entry was deleted and another's added later.
KEEPS_DELETED_EXHOOKS = frozenset({"5.9.1"})
#: How long leftover client sessions may take to go before the broker counts as dirty.
DISCARD_TIMEOUT_S = 10.0


class SharedBrokers:
    """Brokers by (version, env), each booted under `workdir` by `started_emqx(version, workdir, env=env)`."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._brokers: dict[tuple[str, tuple[tuple[str, str], ...]], EmqxBroker] = {}
        #: Each broker's configuration (CONFIG_PATHS) once booted, by node name.
        self._booted: dict[str, dict[str, Any]] = {}

    def get(self, version: str, env: Mapping[str, str] | None = None) -> EmqxBroker:
        """A running broker of `version` with `env`, in the state it booted in (but for its uptime)."""
        key = (version, tuple(sorted((env or {}).items())))
        broker = self._brokers.get(key)
        if broker is not None:
            why = self.unclean(broker)
            if why is None:
                return broker
            log.warning("shared_emqx_rebooted", version=version, node=broker.node_name, reason=why)
            del self._brokers[key], self._booted[broker.node_name]
            broker.kill()
        broker = started_emqx(version, self.workdir, env=dict(env or {}))
        self._brokers[key] = broker
        self._booted[broker.node_name] = _config(broker)
        return broker

    def unclean(self, broker: EmqxBroker) -> str | None:
        """Why a broker of ours cannot be handed out as it is, or None; client sessions left over
        are discarded on the way."""
        if not broker.running:
            return "not running"
        try:
            _discard_clients(broker)
            now = _config(broker)
        except (EmqxError, OSError, AssertionError) as exc:
            return f"{type(exc).__name__}: {exc}"
        changed = [path for path in CONFIG_PATHS if now[path] != self._booted[broker.node_name][path]]
        if changed:
            return f"changed since boot: {', '.join(changed)}"
        if broker.version in KEEPS_DELETED_EXHOOKS and _exhooks_written(broker):
            return f"ExHook entries changed since boot on EMQX {broker.version}"
        return None

    def close(self) -> None:
        """Kill every broker (a throwaway broker needs no graceful stop); `get` boots anew after."""
        brokers, self._brokers, self._booted = self._brokers, {}, {}
        for broker in brokers.values():
            broker.kill()

    def __enter__(self) -> SharedBrokers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def unregister_exhook(broker: EmqxBroker, name: str) -> None:
    """`broker.unregister_exhook(name)`, as a file leaves a shared broker. On KEEPS_DELETED_EXHOOKS
    versions the delete can crash the ExHook manager itself (after the entry's server restarted):
    such a broker is rebooted before the next hand-out anyway, so that is logged, not raised."""
    try:
        broker.unregister_exhook(name)
    except EmqxApiError as exc:
        if broker.version not in KEEPS_DELETED_EXHOOKS:
            raise
        log.warning("shared_emqx_unregister_failed", version=broker.version, exhook=name, status=exc.status)


def _config(broker: EmqxBroker) -> dict[str, Any]:
    return {path: broker.api("GET", path) for path in CONFIG_PATHS}


def _discard_clients(broker: EmqxBroker) -> None:
    """Kick every client and discard its session (a persistent session would queue later files'
    messages, and a catch-up session would take their batches); wait until none is left."""

    def none_left() -> bool:
        page = broker.api("GET", "/clients?limit=1000")["data"]
        for client in page:
            with contextlib.suppress(EmqxApiError):  # gone meanwhile
                broker.api("DELETE", f"/clients/{urllib.parse.quote(str(client['clientid']), safe='')}")
        return not page

    poll(none_left, timeout_s=DISCARD_TIMEOUT_S, interval_s=0.1)


def _exhooks_written(broker: EmqxBroker) -> bool:
    """Whether an ExHook entry was added since boot: EMQX then keeps `exhook` in the node's
    cluster.hocon, even once every entry is deleted."""
    try:
        hocon = (broker.data_dir / "configs" / "cluster.hocon").read_text()
    except FileNotFoundError:
        return False
    return any(line.startswith("exhook") for line in hocon.splitlines())
