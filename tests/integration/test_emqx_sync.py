"""`sdv-fanout emqx sync|check` and the run-time hook-set checks against real EMQX 5.1.6, 5.8.9, 5.9.1.

The three brokers (shared with the other real-EMQX files: `emqx_brokers`) get an API key made
through the REST API, and are left as found at the module's end; each test runs `sdv-fanout serve`
processes on loopback and the CLI in-process. A fresh broker gets the ExHook entry and the ack rule
from one sync; a server restarted with another ack_topic_prefix finds EMQX still calling the hooks
of the old list (it logs and counts it) until a sync reloads the entry; a second sync writes
nothing, which the server's OnProviderLoaded count and the client's list of writes both show.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exhook_server import cli, emqx_sync
from exhook_server.config import Config
from exhook_server.emqx_api import EmqxApi
from testkit.emqx_real import EmqxBroker, available_versions, where_looked
from testkit.emqx_shared import SharedBrokers, unregister_exhook
from testkit.emqx_sim import free_port
from testkit.harness import SubprocessServer, poll
from testkit.vehicle import Fleet
from tests.certs import make_pki

pytestmark = pytest.mark.slow
if not available_versions():
    pytest.skip(f"no real EMQX release: {where_looked()}", allow_module_level=True)

VERSIONS = ["5.1.6", "5.8.9", "5.9.1"]
ACK_PREFIX = "$SDV-FANOUT/acked"
#: Versions seen loading a restarted ExHook server again on their own, mostly within auto_reconnect
#: (e5.9.1, not every time); 5.1.6 and 5.8.9 reconnect and keep the list they loaded.
RELOADS_BY_ITSELF = {"5.9.1"}
#: The one ExHook entry of the module (per broker): the first test finds the broker without it.
EXHOOK = "sdv-fanout"
#: The name of the module's EMQX API key on each broker.
API_KEY = "sdv-fanout-sync"
#: Tests that restart the server under a loaded entry: not on e5.9.1, whose ExHook manager
#: crashed in its reload timer for a restarted server (`config_not_found` for the entry's
#: `order`: no hooks at all until the node restarts) in 3 of 6 runs here; 5.1.6 and 5.8.9 keep
#: the old list, which is what these tests are about.
RESTARTING = [
    pytest.param(v, marks=pytest.mark.skip(reason="e5.9.1 ExHook manager crash")) if v == "5.9.1" else v
    for v in VERSIONS
]


class Rig:
    """A broker with an API key, and the settings (as flags) of a server on a fixed loopback port."""

    def __init__(self, broker: EmqxBroker, workdir: Path) -> None:
        self.broker = broker
        self.workdir = workdir
        self.key, self.secret = broker.create_api_key(API_KEY)
        #: The port of the servers EMQX's one ExHook entry points at.
        self._port = free_port()
        self.servers: list[SubprocessServer] = []
        self.api_url = f"http://127.0.0.1:{broker.api_port}"

    def port(self, name: str) -> int:
        """The loopback port of the entry's server."""
        return self._port

    def flags(self, name: str, ack_prefix: str) -> list[str]:
        """The settings `emqx sync|check` and the server share."""
        return [
            "--emqx-api-url",
            self.api_url,
            "--emqx-api-key",
            self.key,
            "--emqx-api-secret",
            self.secret,
            "--emqx-exhook-name",
            name,
            "--emqx-exhook-url",
            f"http://127.0.0.1:{self.port(name)}",
            "--ack-topic-prefix",
            ack_prefix,
            # EMQX's reload timer after a dropped connection: at 60 s it does not fire within a
            # test (on e5.9.1, firing while the server was restarting crashed the ExHook manager).
            "--emqx-exhook-auto-reconnect-s",
            "60",
            # These tests are about the hook list ack_topic_prefix gives in the pure-hook mode.
            "--vehicle-events",
            "hooks",
        ]

    def cfg(self, name: str, ack_prefix: str) -> Config:
        return Config(
            emqx_exhook_auto_reconnect_s=60,
            emqx_api_url=self.api_url,
            emqx_api_key=self.key,
            emqx_api_secret=self.secret,
            emqx_exhook_name=name,
            emqx_exhook_url=f"http://127.0.0.1:{self.port(name)}",
            ack_topic_prefix=ack_prefix,
            vehicle_events="hooks",
        )

    def serve(self, name: str, ack_prefix: str, *extra: str) -> SubprocessServer:
        """`sdv-fanout serve` on the rig's port (no delivery: the hooks are what matters here)."""
        self.stop_servers()
        srv = SubprocessServer(
            self.workdir / f"lmdb-{len(self.servers)}",
            *self.flags(name, ack_prefix),
            "--listen",
            f"127.0.0.1:{self.port(name)}",
            "--processes",
            "1",
            *extra,
        )
        self.servers.append(srv)
        return srv

    def stop_servers(self) -> None:
        for srv in self.servers:
            if srv.proc.poll() is None:
                assert srv.terminate() == 0, srv.log()[-3000:]

    def api(self) -> EmqxApi:
        return EmqxApi(self.api_url, self.key, self.secret)

    def hooks(self, name: str) -> dict[str, frozenset[str]]:
        return emqx_sync.held_hooks(self.broker.exhook_hooks(name))

    def rules(self) -> list[str]:
        return [r["id"] for r in self.broker.api("GET", "/rules")["data"] if r.get("name") == emqx_sync.RULE_ID]

    def cleanup(self, name: str) -> None:
        """Delete the rule and leave a server answering on the entry's port. The tests share one
        ExHook entry (EXHOOK), never deleted or disabled, and its server is never away for long:
        on e5.9.1 EMQX's reload timer for a loaded server that stayed unreachable past
        auto_reconnect crashed its ExHook manager (`config_not_found` for the entry's `order`),
        and so did updates after an entry was disabled or deleted, leaving no hooks at all."""
        for rid in self.rules():
            self.broker.api("DELETE", f"/rules/{rid}")
        self.serve(name, "")

    def leave(self) -> None:
        """Leave the broker as found: the entry goes while the server `cleanup` left still
        answers, then the rule, the servers and the API key."""
        try:
            if self.broker.running:
                unregister_exhook(self.broker, EXHOOK)
                for rid in self.rules():
                    self.broker.api("DELETE", f"/rules/{rid}")
        finally:
            for srv in self.servers:
                srv.kill()
        if self.broker.running:
            self.broker.api("DELETE", f"/api_key/{API_KEY}")


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """`sdv-fanout <argv>` in-process: exit code and what it printed."""
    capsys.readouterr()
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def metric(srv: SubprocessServer, name: str, **labels: str) -> float:
    """A sample of the server's /metrics (0 when absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def loads(srv: SubprocessServer) -> float:
    """How often EMQX loaded this server (OnProviderLoaded calls answered)."""
    return metric(srv, "sdv_fanout_hook_calls_total", hook="OnProviderLoaded", outcome="ok")


def connected_and_loaded(rig: Rig, name: str, want: dict[str, frozenset[str]]) -> bool:
    return rig.broker.exhook_status(name) == ["connected"] and rig.hooks(name) == want


@pytest.fixture(scope="module")
def brokers(tmp_path_factory: pytest.TempPathFactory, emqx_brokers: SharedBrokers) -> Iterator[dict[str, Rig]]:
    """Every available version (shared: `emqx_brokers`), left as found at the end (`Rig.leave`)."""
    workdir = tmp_path_factory.mktemp("emqx-sync")
    rigs: dict[str, Rig] = {}
    try:
        for version in VERSIONS:
            if version in available_versions():
                rigs[version] = Rig(emqx_brokers.get(version), workdir / version.replace(".", "_"))
        yield rigs
    finally:
        for r in rigs.values():
            r.leave()


@pytest.fixture(params=VERSIONS)
def rig(request: pytest.FixtureRequest, brokers: dict[str, Rig]) -> Iterator[Rig]:
    if request.param not in brokers:
        pytest.skip(f"no EMQX {request.param}: {where_looked()}")
    r = brokers[request.param]
    r.workdir.mkdir(parents=True, exist_ok=True)
    yield r


def test_fresh_broker_gets_entry_and_rule_then_a_second_sync_changes_nothing(
    rig: Rig, capsys: pytest.CaptureFixture[str]
) -> None:
    name = EXHOOK
    srv = rig.serve(name, ACK_PREFIX)
    try:
        code, out = run_cli(capsys, "emqx", "check", *rig.flags(name, ACK_PREFIX))
        assert code == 1 and f"exhook {name}: create" in out and "rule sdv-fanout-acks: create" in out, out
        # --dry-run prints the same and writes nothing.
        code, out = run_cli(capsys, "emqx", "sync", "--dry-run", *rig.flags(name, ACK_PREFIX))
        assert code == 0 and "2 change(s) to make, none made" in out, out
        assert name not in [e["name"] for e in rig.broker.api("GET", "/exhooks")]
        assert rig.rules() == []
        assert "authorization.no_match is allow" in out  # the release's default: a hint, not a failure

        code, out = run_cli(capsys, "emqx", "sync", *rig.flags(name, ACK_PREFIX))
        assert code == 0, out
        assert f"changed: exhook {name}: create" in out and "changed: rule sdv-fanout-acks: create" in out
        cfg = rig.cfg(name, ACK_PREFIX)
        want = emqx_sync.wanted_hooks(cfg)
        assert "message.acked" not in want
        poll(lambda: connected_and_loaded(rig, name, want), timeout_s=20)
        assert rig.rules() == [emqx_sync.RULE_ID]
        code, out = run_cli(capsys, "emqx", "check", *rig.flags(name, ACK_PREFIX))
        assert code == 0 and "in sync" in out, out

        # A second run: no write at all, so no reload either.
        before = loads(srv)
        api = rig.api()
        again = emqx_sync.plan(cfg, api)
        assert again.in_sync, (again.changes, again.problems)
        assert emqx_sync.apply(cfg, api, again) == [] and api.writes == []
        code, out = run_cli(capsys, "emqx", "sync", *rig.flags(name, ACK_PREFIX))
        assert code == 0 and "0 change(s) made" in out and "changed:" not in out, out
        assert loads(srv) == before == 1
    finally:
        rig.cleanup(name)


def ack_a_request(rig: Rig, vin: str) -> None:
    """A vehicle PUBACKs a message on its request topic: EMQX runs message.acked for it."""
    with Fleet(rig.broker) as fleet:
        [vehicle] = fleet.online([vin])
        sender = fleet.vehicle(f"{vin}-sender")
        sender.connect()
        sender.publish(f"agent/{vin}/proxy/request/r1", b"x")
        assert poll(lambda: vehicle.received, 10)


@pytest.mark.parametrize("rig", RESTARTING, indirect=True)
def test_changed_hook_set_is_noticed_at_run_time_and_sync_reloads_it(
    rig: Rig, capsys: pytest.CaptureFixture[str]
) -> None:
    name = EXHOOK
    hooks_acked = emqx_sync.wanted_hooks(rig.cfg(name, ""))
    hooks_rule = emqx_sync.wanted_hooks(rig.cfg(name, ACK_PREFIX))
    may_reload_itself = rig.broker.version in RELOADS_BY_ITSELF
    try:
        # Acks through the hook: the baseline.
        rig.serve(name, "")
        assert run_cli(capsys, "emqx", "sync", *rig.flags(name, ""))[0] == 0
        poll(lambda: connected_and_loaded(rig, name, hooks_acked), timeout_s=20)

        # The server restarts with ack_topic_prefix: EMQX reconnects and keeps the old list.
        srv = rig.serve(name, ACK_PREFIX, "--hook-set-confirm-s", "1")

        # hook_set_confirm_s after its start it asked EMQX (emqx_api_url is set): not its list.
        def settled() -> str | None:
            if any(e.get("reason") == "emqx_holds_other_list" for e in srv.events()):
                return "old list"
            if may_reload_itself and connected_and_loaded(rig, name, hooks_rule):
                return "reloaded"
            return None

        if poll(settled, timeout_s=10) == "old list":
            assert loads(srv) == 0 and metric(srv, "sdv_fanout_hook_set_confirmed") == 0
            # A call for the hook it no longer asks for is logged and counted.
            ack_a_request(rig, "SYNCVIN1")
            poll(lambda: any(e.get("reason") == "not_registered" for e in srv.events()), timeout_s=10)
            assert metric(srv, "sdv_fanout_hook_set_mismatch_total", hook="message.acked") >= 2

        code, out = run_cli(capsys, "emqx", "check", *rig.flags(name, ACK_PREFIX))
        assert code == 1 and "rule sdv-fanout-acks: create" in out, out
        assert may_reload_itself or ("reload" in out and "- message.acked" in out), out
        code, out = run_cli(capsys, "emqx", "sync", *rig.flags(name, ACK_PREFIX))
        assert code == 0 and "problem" not in out, out
        assert may_reload_itself or f"changed: exhook {name}: reload" in out, out
        # (e5.9.1 may be reconnecting: then it loads the server, with this list, when it connects)
        poll(lambda: connected_and_loaded(rig, name, hooks_rule), timeout_s=20)
        assert rig.rules() == [emqx_sync.RULE_ID] and metric(srv, "sdv_fanout_hook_set_confirmed") == 1
        assert loads(srv) == 1 or may_reload_itself
        loaded = loads(srv)
        api = rig.api()
        emqx_sync.apply(rig.cfg(name, ACK_PREFIX), api, emqx_sync.plan(rig.cfg(name, ACK_PREFIX), api))
        assert api.writes == [] and loads(srv) == loaded

        # And back: the hook acks again, the rule goes (after the reload).
        srv = rig.serve(name, "")
        code, out = run_cli(capsys, "emqx", "sync", *rig.flags(name, ""))
        assert code == 0 and "rule sdv-fanout-acks: delete" in out, out
        assert may_reload_itself or ("reload" in out and "+ message.acked" in out), out
        poll(lambda: connected_and_loaded(rig, name, hooks_acked), timeout_s=20)
        assert rig.rules() == [] and (loads(srv) == 1 or may_reload_itself)
        assert run_cli(capsys, "emqx", "check", *rig.flags(name, ""))[0] == 0
    finally:
        rig.cleanup(name)


def test_unreachable_api_and_bad_credentials_exit_2_with_one_line(rig: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    flags = rig.flags(EXHOOK, "")
    wrong = [*flags, "--emqx-api-secret", "not-the-secret"]
    code, out = run_cli(capsys, "emqx", "check", *wrong)
    assert code == 2 and "refused the API key" in out and "not-the-secret" not in out, out
    assert len(out.strip().splitlines()) == 1
    closed = [*flags, "--emqx-api-url", f"http://127.0.0.1:{free_port()}"]
    code, out = run_cli(capsys, "emqx", "sync", *closed)
    assert code == 2 and "unreachable" in out and len(out.strip().splitlines()) == 1, out


@pytest.mark.parametrize("rig", RESTARTING, indirect=True)
def rule_enabled(rig: Rig) -> bool | None:
    """Whether the ack rule is enabled (None: there is none)."""
    found = [r for r in rig.broker.api("GET", "/rules")["data"] if r.get("name") == emqx_sync.RULE_ID]
    return bool(found[0].get("enable")) if found else None


def test_server_syncs_on_start_confirms_the_hook_set_and_puts_back_a_rule_changed_by_hand(rig: Rig) -> None:
    """emqx_sync_on_start provisions; then every emqx_resync_s the leader puts back the ack rule
    an operator disabled, then deleted (without it no delivery is ever acknowledged)."""
    name = EXHOOK
    try:
        srv = rig.serve(name, ACK_PREFIX, "--emqx-sync-on-start", "--hook-set-confirm-s", "1", "--emqx-resync-s", "0.5")
        poll(lambda: srv.logged("emqx_sync_done"), timeout_s=20)
        poll(lambda: connected_and_loaded(rig, name, emqx_sync.wanted_hooks(rig.cfg(name, ACK_PREFIX))), timeout_s=20)
        assert rig.rules() == [emqx_sync.RULE_ID]
        poll(lambda: metric(srv, "sdv_fanout_hook_set_confirmed") == 1, timeout_s=10)
        assert not srv.logged("hook_set_mismatch") and not srv.logged("emqx_sync_failed")
        assert not srv.logged("emqx_drift_healed")  # nothing drifted yet: nothing written

        def healed(kind: str) -> bool:
            return any(e.get("kind") == kind for e in srv.events() if e.get("event") == "emqx_drift_healed")

        rig.broker.api("PUT", f"/rules/{rig.rules()[0]}", {"enable": False})  # (put back at once, maybe)
        poll(lambda: healed("rule-update"), timeout_s=20)  # logged once EMQX took the change
        assert rule_enabled(rig) is True
        rig.broker.api("DELETE", f"/rules/{rig.rules()[0]}")
        poll(lambda: healed("rule-create"), timeout_s=20)
        assert rule_enabled(rig) is True and rig.rules() == [emqx_sync.RULE_ID]
    finally:
        rig.cleanup(name)


def test_mutual_tls_entry_connects_and_a_second_sync_changes_nothing(
    rig: Rig, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """With tls_cert_file the entry is https:// with the ssl block (CA and client certificate as
    paths on the EMQX node): EMQX loads the mutual-TLS server, and EMQX's answer (with the TLS
    defaults it adds) compares equal, so a second sync writes nothing."""
    name = EXHOOK
    pki = make_pki(tmp_path)
    tls = [
        *("--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.server_key)),
        *("--tls-client-ca-file", str(pki.ca)),
    ]
    emqx_side = [
        *("--emqx-exhook-url", f"https://127.0.0.1:{rig.port(name)}", "--emqx-exhook-tls-ca-file", str(pki.ca)),
        *("--emqx-exhook-tls-cert-file", str(pki.client_cert), "--emqx-exhook-tls-key-file", str(pki.client_key)),
        # Our certificate names 127.0.0.1 as an IP address and `localhost`: 5.8.9 fails the first
        # against the URL's 127.0.0.1 (hostname_check_failed), every version takes the name.
        *("--emqx-exhook-tls-server-name", "localhost"),
    ]
    flags = [*rig.flags(name, ""), *tls, *emqx_side]
    try:
        srv = rig.serve(name, "", *tls, *emqx_side)
        code, out = run_cli(capsys, "emqx", "sync", *flags)
        port = rig.port(name)
        assert code == 0 and f"url: 'http://127.0.0.1:{port}' -> 'https://127.0.0.1:{port}'" in out, out
        poll(lambda: connected_and_loaded(rig, name, emqx_sync.wanted_hooks(Config())), timeout_s=20)
        held = rig.broker.api("GET", f"/exhooks/{name}")["ssl"]
        assert held["enable"] and held["verify"] == "verify_peer" and held["cacertfile"] == str(pki.ca)
        assert held["server_name_indication"] == "localhost"
        assert run_cli(capsys, "emqx", "check", *flags)[0] == 0
        code, out = run_cli(capsys, "emqx", "sync", *flags)
        assert code == 0 and "0 change(s) made" in out, out
        assert loads(srv) == 1
    finally:
        rig.cleanup(name)
