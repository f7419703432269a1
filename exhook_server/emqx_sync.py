"""`sdv-fanout emqx sync|check`: make a running EMQX match this server's settings, or say where not;
the same at start (`sync_at_start`) and then at run time from the deployment's leader (`resync_loop`).

What this server needs from EMQX is computed from `Config` alone (no server running): its ExHook
entry, the hooks and topic filters `OnProviderLoaded` answers (`hooks.hook_specs`), and the ack rule
(`acks.rule_body`) exactly when acks take the rule (ack_topic_prefix, or vehicle_events = mqtt).
`plan` reads EMQX through its REST API and lists the differences; `apply` removes them, and writes
nothing when nothing differs. The ack rule goes in before the hook list loses `message.acked` and
out after it regains it, so acks always have a path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import re
import time
from collections.abc import Callable
from typing import Any

import structlog

from exhook_server import metrics
from exhook_server.acks import rule_body
from exhook_server.aio import in_daemon_thread
from exhook_server.config import Config
from exhook_server.emqx_api import EmqxApi, EmqxApiError, EmqxHttpError
from exhook_server.errors import ConfigError
from exhook_server.hooks import hook_specs

log = structlog.get_logger("sdv_fanout.emqx_sync")

#: The ack rule's id (and name) in EMQX; a rule of that name with another id is ours too.
RULE_ID = "sdv-fanout-acks"
#: EMQX versions from which the republish action honours direct_dispatch (5.1 fails with it).
_DIRECT_DISPATCH_FROM = (5, 8)
#: How long a reload may take to show the new hook list (EMQX loads during the PUT; margin).
_RELOAD_WAIT_S = 10.0
#: Pages of rules read at most (1,000 rules each) when looking for ours.
_MAX_RULE_PAGES = 20

#: The hook list EMQX holds for us: hook name -> its topic filters (empty: every topic).
HookSet = dict[str, frozenset[str]]


@dataclasses.dataclass(frozen=True, slots=True)
class Change:
    """One write `apply` makes: `kind` is exhook-create|exhook-update|exhook-reload|rule-create|
    rule-update|rule-delete; `detail` says what differs, for people."""

    kind: str
    detail: str
    body: dict[str, Any] | None = None
    rule_id: str = ""


@dataclasses.dataclass(slots=True)
class Plan:
    """What EMQX holds against what these settings want."""

    exhook_name: str
    changes: list[Change] = dataclasses.field(default_factory=list)
    #: Differences a sync cannot remove by itself (e.g. a node that has not connected to us yet).
    problems: list[str] = dataclasses.field(default_factory=list)
    #: Hints, not failures (e.g. EMQX authorizes what no ACL rule matches).
    warnings: list[str] = dataclasses.field(default_factory=list)

    @property
    def in_sync(self) -> bool:
        """Nothing to change and nothing wrong."""
        return not self.changes and not self.problems


# -- what these settings want ----------------------------------------------------------------


def wanted_hooks(cfg: Config) -> HookSet:
    """The hooks and topic filters our OnProviderLoaded answers for these settings."""
    return {name: frozenset(topics) for name, topics in hook_specs(cfg)}


def duration(seconds: float) -> str:
    """A duration as EMQX writes it: whole seconds as "2s", else milliseconds."""
    ms = round(seconds * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def duration_ms(text: Any) -> int | None:
    """EMQX's duration ("5s", "1m", "500ms", "1h30m") in milliseconds; None for false/absent."""
    if not isinstance(text, str | int) or isinstance(text, bool):
        return None
    if isinstance(text, int):
        return text
    parts = re.findall(r"(\d+)\s*(ms|s|m|h|d)", text.strip().lower())
    if not parts:
        return None
    return sum(int(n) * _UNITS_MS[unit] for n, unit in parts)


def wanted_exhook(cfg: Config) -> dict[str, Any]:
    """The ExHook entry (`POST /exhooks` body) for these settings."""
    url = cfg.exhook_url
    ssl: dict[str, Any] = {"enable": url.startswith("https://")}
    if ssl["enable"]:
        ssl["verify"] = "verify_peer" if cfg.emqx_exhook_tls_ca_file else "verify_none"
        for key, value in (
            ("cacertfile", cfg.emqx_exhook_tls_ca_file),
            ("certfile", cfg.emqx_exhook_tls_cert_file),
            ("keyfile", cfg.emqx_exhook_tls_key_file),
            ("server_name_indication", cfg.emqx_exhook_tls_server_name),
        ):
            if value:
                ssl[key] = value
    return {
        "name": cfg.emqx_exhook_name,
        "enable": True,
        "url": url,
        "request_timeout": duration(cfg.emqx_exhook_request_timeout_s),
        "failed_action": cfg.emqx_exhook_failed_action,
        "pool_size": cfg.exhook_pool_size,
        "auto_reconnect": duration(cfg.emqx_exhook_auto_reconnect_s),
        "ssl": ssl,
    }


def wanted_rule(cfg: Config, versions: list[tuple[int, ...]]) -> dict[str, Any] | None:
    """The ack rule (`POST /rules` body with our id) when acks take the rule, else None."""
    if not cfg.rule_ack_topic_prefix:
        return None
    oldest = min(versions, default=_DIRECT_DISPATCH_FROM)
    return {"id": RULE_ID, **rule_body(cfg, direct_dispatch=oldest >= _DIRECT_DISPATCH_FROM)}


# -- comparing -------------------------------------------------------------------------------


def exhook_differences(want: dict[str, Any], have: dict[str, Any]) -> list[str]:
    """`field: held -> wanted` for each setting of the entry that differs."""
    out = []

    def differ(field: str, held: Any, wanted: Any) -> None:
        if held != wanted:
            out.append(f"{field}: {held!r} -> {wanted!r}")

    differ("enable", have.get("enable"), True)
    differ("url", str(have.get("url", "")).rstrip("/"), want["url"])
    for field in ("request_timeout", "auto_reconnect"):
        if duration_ms(have.get(field)) != duration_ms(want[field]):
            out.append(f"{field}: {have.get(field)!r} -> {want[field]!r}")
    differ("failed_action", have.get("failed_action"), want["failed_action"])
    differ("pool_size", have.get("pool_size"), want["pool_size"])
    held_ssl = have.get("ssl") or {}
    wanted_ssl = want["ssl"]
    differ("ssl.enable", bool(held_ssl.get("enable", False)), wanted_ssl["enable"])
    if wanted_ssl["enable"]:
        for key in ("verify", "cacertfile", "certfile", "keyfile", "server_name_indication"):
            differ(f"ssl.{key}", held_ssl.get(key) or "", wanted_ssl.get(key, ""))
    return out


def held_hooks(answer: Any) -> HookSet:
    """`GET /exhooks/<name>/hooks` as hook name -> topic filters."""
    out: HookSet = {}
    for hook in answer or []:
        params = hook.get("params") or {}
        out[str(hook.get("name"))] = frozenset(params.get("topics") or ())
    return out


def hook_differences(want: HookSet, have: HookSet) -> list[str]:
    """`+ hook [filters]` (wanted, not held), `- hook` (held, not wanted), `~ hook` (other filters)."""
    out = []
    for name in sorted(want.keys() | have.keys()):
        if name not in have:
            out.append(f"+ {name} {sorted(want[name])}")
        elif name not in want:
            out.append(f"- {name} {sorted(have[name])}")
        elif want[name] != have[name]:
            added, gone = sorted(want[name] - have[name]), sorted(have[name] - want[name])
            out.append(f"~ {name} topics +{added} -{gone}")
    return out


def rule_differences(want: dict[str, Any], have: dict[str, Any]) -> list[str]:
    """What differs between the ack rule we want and one EMQX holds (EMQX adds defaults to the
    action's arguments; those it adds are not differences)."""
    out = []
    for field in ("sql", "enable", "description"):
        if have.get(field) != want[field]:
            out.append(f"{field}: {have.get(field)!r} -> {want[field]!r}")
    held = have.get("actions") or []
    (wanted_action,) = want["actions"]
    if len(held) != 1 or not isinstance(held[0], dict) or held[0].get("function") != wanted_action["function"]:
        out.append(f"actions: {held!r} -> {want['actions']!r}")
        return out
    held_args = held[0].get("args") or {}
    for key, value in wanted_action["args"].items():
        if held_args.get(key) != value:
            out.append(f"actions[0].args.{key}: {held_args.get(key)!r} -> {value!r}")
    if "direct_dispatch" not in wanted_action["args"] and held_args.get("direct_dispatch"):
        out.append("actions[0].args.direct_dispatch: True -> absent (EMQX before 5.8 fails every action with it)")
    return out


# -- reading EMQX ------------------------------------------------------------------------------


def node_versions(api: EmqxApi) -> list[tuple[int, ...]]:
    """Each node's EMQX version as numbers (`GET /nodes`)."""
    out = []
    for node in api.get("/nodes") or []:
        numbers = re.findall(r"\d+", str(node.get("version", "")))
        if numbers:
            out.append(tuple(int(n) for n in numbers[:3]))
    return out


def our_rules(api: EmqxApi) -> list[dict[str, Any]]:
    """Every rule with our id or our name (one made by hand with `POST /rules` has another id)."""
    found = []
    for page in range(1, _MAX_RULE_PAGES + 1):
        answer = api.get(f"/rules?page={page}&limit=1000")
        rows = answer.get("data", []) if isinstance(answer, dict) else list(answer or [])
        found += [r for r in rows if r.get("id") == RULE_ID or r.get("name") == RULE_ID]
        meta = answer.get("meta", {}) if isinstance(answer, dict) else {}
        if not meta.get("hasnext") or not rows:
            break
    return sorted(found, key=lambda r: (r.get("id") != RULE_ID, str(r.get("id"))))


def not_connected(entry: dict[str, Any]) -> list[str]:
    """`node: status` of each node whose ExHook client is not connected to us."""
    return [
        f"{s.get('node', '?')}: {s.get('status', '?')}"
        for s in entry.get("node_status") or []
        if s.get("status") != "connected"
    ]


def plan(cfg: Config, api: EmqxApi) -> Plan:
    """Read EMQX and list what differs from these settings (nothing is written)."""
    name = cfg.emqx_exhook_name
    out = Plan(name)
    versions = node_versions(api)
    want_rule = wanted_rule(cfg, versions)
    rules = our_rules(api)
    if want_rule is not None:
        if not rules:
            out.changes.append(Change("rule-create", f"rule {RULE_ID}: create ({want_rule['sql']})", want_rule))
        else:
            diff = rule_differences(want_rule, rules[0])
            if diff:
                rid = str(rules[0]["id"])
                out.changes.append(Change("rule-update", f"rule {rid}: " + "; ".join(diff), want_rule, rid))
    want = wanted_exhook(cfg)
    entry = api.get_or_none(f"/exhooks/{api.quote(name)}")
    if entry is None:
        out.changes.append(Change("exhook-create", f"exhook {name}: create (url {want['url']})", want))
    else:
        diff = exhook_differences(want, entry)
        if diff:
            out.changes.append(Change("exhook-update", f"exhook {name}: " + "; ".join(diff), want))
        elif (waiting := not_connected(entry)) or not entry.get("node_status"):
            # EMQX loads us (and reads the hook list) when it connects: nothing to reload.
            out.problems.append(
                f"exhook {name}: not connected to {want['url']} on {', '.join(waiting) or 'any node'}"
                " (EMQX loads the hook list when it connects)"
            )
        else:
            held = held_hooks(api.get(f"/exhooks/{api.quote(name)}/hooks"))
            hook_diff = hook_differences(wanted_hooks(cfg), held)
            if hook_diff:
                detail = f"exhook {name}: reload, EMQX holds another hook list: {'; '.join(hook_diff)}"
                out.changes.append(Change("exhook-reload", detail, want))
    if want_rule is None:
        for rule in rules:
            rid = str(rule["id"])
            out.changes.append(Change("rule-delete", f"rule {rid}: delete (ack_topic_prefix is empty)", rule_id=rid))
    out.warnings += authorization_warnings(api, events_over_mqtt=cfg.events_over_mqtt)
    return out


def authorization_warnings(api: EmqxApi, *, events_over_mqtt: bool = False) -> list[str]:
    """A hint when EMQX allows what no authorization rule matches (any client may publish batches,
    and with vehicle events over MQTT heartbeat or answer as any vehicle)."""
    try:
        settings = api.get("/authorization/settings") or {}
    except EmqxHttpError as exc:
        return [f"could not read /authorization/settings (HTTP {exc.status})"]
    if settings.get("no_match") == "allow":
        also = ", and heartbeat or answer as any vehicle (vehicle_events = mqtt)" if events_over_mqtt else ""
        return [
            f"EMQX authorization.no_match is allow: any client may publish batches{also} unless an ACL denies it"
            " (deploy/emqx/acl.conf and no_match = deny)"
        ]
    return []


# -- writing ---------------------------------------------------------------------------------


def apply(cfg: Config, api: EmqxApi, found: Plan, *, on_change: Callable[[Change], None] | None = None) -> list[str]:
    """Make each change of `found`; returns problems left afterwards (e.g. the server EMQX loaded
    answered another hook list: it runs other settings).

    The entry is created or updated in place (an update makes EMQX load the server again, so it
    gets the current hook list); it is reloaded alone when only the hook list EMQX holds differs
    (EMQX keeps the list it loaded until then: a restart of ours does not change it); the rule is
    created, updated or deleted.
    """
    name = api.quote(found.exhook_name)
    left: list[str] = []
    deletes = [c for c in found.changes if c.kind == "rule-delete"]
    for change in [c for c in found.changes if c.kind != "rule-delete"] + deletes:
        if change.kind == "rule-create":
            api.call("POST", "/rules", change.body)
        elif change.kind == "rule-update":
            assert change.body is not None
            body = {k: v for k, v in change.body.items() if k != "id"}
            api.call("PUT", f"/rules/{api.quote(change.rule_id)}", body)
        elif change.kind == "rule-delete":
            api.call("DELETE", f"/rules/{api.quote(change.rule_id)}")
        elif change.kind == "exhook-create":
            _create_exhook(api, change.body or {})
        else:  # exhook-update, exhook-reload: a PUT makes EMQX load the server again
            api.call("PUT", f"/exhooks/{name}", change.body)
            if change.kind == "exhook-reload":
                left += _confirm_reload(cfg, api, change.body or {})
        if on_change is not None:
            on_change(change)
    return left


def _create_exhook(api: EmqxApi, body: dict[str, Any]) -> None:
    try:
        api.call("POST", "/exhooks", body)
    except EmqxHttpError as exc:
        if exc.status != 400 or "exist" not in exc.body.lower():
            raise
        api.call("PUT", f"/exhooks/{api.quote(body['name'])}", body)  # created meanwhile


def _confirm_reload(cfg: Config, api: EmqxApi, body: dict[str, Any]) -> list[str]:
    """After a reload PUT: the hook list EMQX now holds is ours (EMQX loads during the PUT; a
    node still reconnecting loads it when connected), else what differs is reported. Nothing
    else is tried: disabling and enabling the entry raced e5.9.1's own reload of a restarted
    server in our tests and crashed its ExHook manager."""
    name = api.quote(body["name"])
    want = wanted_hooks(cfg)
    deadline = time.monotonic() + _RELOAD_WAIT_S
    while True:
        entry = api.get(f"/exhooks/{name}")
        held = held_hooks(api.get(f"/exhooks/{name}/hooks"))
        if held == want:
            return []
        if (not not_connected(entry) and held) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return [
        f"exhook {body['name']}: after a reload EMQX holds {hook_differences(want, held) or 'no hooks'}:"
        f" the server at {body['url']} runs other settings than these"
    ]


# -- at start-up -------------------------------------------------------------------------------


def sync_at_start(cfg: Config) -> None:
    """`emqx sync` from a server that just started serving (emqx_sync_on_start): every change and
    every failure is logged; nothing is raised (EMQX keeps what it had, serving goes on)."""
    try:
        api = EmqxApi.from_config(cfg)
        found = plan(cfg, api)
        for warning in found.warnings:
            log.warning("emqx_sync_warning", detail=warning)
        left = apply(cfg, api, found, on_change=lambda c: log.info("emqx_sync_changed", kind=c.kind, detail=c.detail))
    except (EmqxApiError, ConfigError) as exc:
        log.error("emqx_sync_failed", detail=str(exc), hint="serving goes on; EMQX keeps the settings it had")
        return
    for problem in found.problems + left:
        log.warning("emqx_sync_problem", detail=problem)
    log.info("emqx_sync_done", changes=len(found.changes), api=api.base)


def resync(cfg: Config, known: set[str]) -> set[str]:
    """One run-time look (emqx_resync_s): what drifted is put back and logged (`emqx_drift_healed`,
    counted per kind); problems and warnings are logged when they differ from `known` (the last
    look's), which is returned updated. Nothing is raised: EMQX keeps what it has."""
    try:
        api = EmqxApi.from_config(cfg)
        found = plan(cfg, api)
        if found.changes:

            def healed(c: Change) -> None:
                metrics.EMQX_DRIFT_HEALED.labels(c.kind).inc()
                log.warning("emqx_drift_healed", kind=c.kind, detail=c.detail)

            left = apply(cfg, api, found, on_change=healed)
        else:
            left = []
    except (EmqxApiError, ConfigError) as exc:
        now = {f"failed: {exc}"}
        if now != known:
            log.error("emqx_resync_failed", detail=str(exc), hint="EMQX keeps what it has; tried again later")
        return now
    warnings = {f"warning: {w}" for w in found.warnings}
    now = set(found.problems + left) | warnings
    for line in sorted(now - known):
        if line in warnings:
            log.warning("emqx_sync_warning", detail=line.removeprefix("warning: "))
        else:
            log.warning("emqx_sync_problem", detail=line)
    return now


async def resync_loop(cfg: Config, every_s: float) -> None:
    """Forever: `resync` every `every_s` (its REST calls in a daemon thread: an API that never
    answers must not hold up our exit)."""
    known: set[str] = set()
    while True:
        await asyncio.sleep(every_s)
        known = await in_daemon_thread(functools.partial(resync, cfg, known))


def hook_list_differences(cfg: Config) -> list[str]:
    """What differs between the hook list EMQX holds for us and ours (`hook_differences` lines);
    EmqxApiError when EMQX cannot tell (unreachable, or not connected to us)."""
    api = EmqxApi.from_config(cfg)
    name = api.quote(cfg.emqx_exhook_name)
    entry = api.get_or_none(f"/exhooks/{name}")
    if entry is None:
        raise EmqxApiError(f"EMQX has no ExHook entry {cfg.emqx_exhook_name!r}: run `sdv-fanout emqx sync`")
    if waiting := not_connected(entry):
        raise EmqxApiError(f"ExHook {cfg.emqx_exhook_name!r} not connected on {', '.join(waiting)}")
    return hook_differences(wanted_hooks(cfg), held_hooks(api.get(f"/exhooks/{name}/hooks")))
