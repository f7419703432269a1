"""`emqx sync|check` without a broker: the EMQX settings, what the settings want, how EMQX's answers
compare, the run-time hook-set watch (injected clock) and the CLI's one-line failures.

The broker side (EMQX 5.1.6, 5.8.9, 5.9.1) is tests/integration/test_emqx_sync.py.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
import structlog

from exhook_server import cli, emqx_sync, metrics
from exhook_server.config import Config
from exhook_server.errors import ConfigError
from exhook_server.hookset import HookSetWatch, hook_of
from exhook_server.topics import filter_matches
from testkit.emqx_sim import free_port

#: `GET /api/v5/exhooks/<name>` of EMQX 5.8.9 for what `wanted_exhook(Config())` registers.
HELD_ENTRY = {
    "auto_reconnect": "2s",
    "enable": True,
    "failed_action": "ignore",
    "name": "sdv-fanout",
    "pool_size": 8,
    "request_timeout": "5s",
    "socket_options": {"keepalive": True, "nodelay": True},
    "ssl": {"ciphers": [], "depth": 10, "enable": False, "verify": "verify_none", "versions": ["tlsv1.3"]},
    "url": "http://127.0.0.1:9000",
    "node_status": [{"node": "emqx@127.0.0.1", "status": "connected"}],
}


def test_exhook_url_defaults_to_listen_with_the_wildcard_replaced_by_the_hostname() -> None:
    assert Config(listen="127.0.0.1:9100").exhook_url == "http://127.0.0.1:9100"
    assert Config(listen="0.0.0.0:9000").exhook_url == f"http://{socket.gethostname()}:9000"
    assert Config(listen="[::]:9000").exhook_url == f"http://{socket.gethostname()}:9000"
    assert Config(listen="[::1]:9000").exhook_url == "http://[::1]:9000"
    tls = Config(listen="10.0.0.5:9000", tls_cert_file="c.pem", tls_key_file="k.pem")
    assert tls.exhook_url == "https://10.0.0.5:9000"
    assert Config(emqx_exhook_url="http://sdv-fanout.sdv.svc:9000/").exhook_url == "http://sdv-fanout.sdv.svc:9000"


def test_pool_size_follows_the_store_unless_set() -> None:
    assert Config().exhook_pool_size == 8
    assert Config(store_url="postgresql://db/x").exhook_pool_size == 32
    assert Config(store_url="postgresql://db/x", emqx_exhook_pool_size=4).exhook_pool_size == 4


@pytest.mark.parametrize(
    ("settings", "names"),
    [
        ({"emqx_api_url": "emqx:18083"}, "emqx_api_url"),
        ({"emqx_exhook_url": "grpc://x:9000"}, "emqx_exhook_url"),
        ({"emqx_sync_on_start": True}, "emqx_sync_on_start"),
        ({"emqx_exhook_name": "a b"}, "emqx_exhook_name"),
        ({"emqx_exhook_failed_action": "drop"}, "emqx_exhook_failed_action"),
        ({"emqx_exhook_auto_reconnect_s": 0}, "emqx_exhook_auto_reconnect_s"),
        ({"hook_set_confirm_s": -1}, "hook_set_confirm_s"),
        ({"emqx_exhook_tls_cert_file": "/c.pem"}, "emqx_exhook_tls_key_file"),
        ({"emqx_exhook_pool_size": -1}, "emqx_exhook_pool_size"),
    ],
)
def test_bad_emqx_settings_are_refused_naming_the_setting(settings: dict[str, Any], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        Config(**settings)


def test_durations_as_emqx_writes_and_reads_them() -> None:
    assert [emqx_sync.duration(s) for s in (2, 5.0, 0.5, 60)] == ["2s", "5s", "500ms", "60s"]
    assert [emqx_sync.duration_ms(t) for t in ("2s", "1m", "500ms", "1h30m", 7)] == [
        2000,
        60_000,
        500,
        5_400_000,
        7,
    ]
    assert emqx_sync.duration_ms(False) is None and emqx_sync.duration_ms("never") is None


def test_wanted_entry_and_tls() -> None:
    plain = emqx_sync.wanted_exhook(Config(listen="127.0.0.1:9000"))
    assert plain == {
        "name": "sdv-fanout",
        "enable": True,
        "url": "http://127.0.0.1:9000",
        "request_timeout": "5s",
        "failed_action": "ignore",
        "pool_size": 8,
        "auto_reconnect": "2s",
        "ssl": {"enable": False},
    }
    mutual = emqx_sync.wanted_exhook(
        Config(
            listen="127.0.0.1:9000",
            tls_cert_file="c.pem",
            tls_key_file="k.pem",
            emqx_exhook_tls_ca_file="/etc/emqx/certs/ca.pem",
            emqx_exhook_tls_cert_file="/etc/emqx/certs/client.pem",
            emqx_exhook_tls_key_file="/etc/emqx/certs/client.key",
            emqx_exhook_tls_server_name="sdv-fanout.sdv.svc",
        )
    )
    assert mutual["url"] == "https://127.0.0.1:9000"
    assert mutual["ssl"] == {
        "enable": True,
        "verify": "verify_peer",
        "cacertfile": "/etc/emqx/certs/ca.pem",
        "certfile": "/etc/emqx/certs/client.pem",
        "keyfile": "/etc/emqx/certs/client.key",
        "server_name_indication": "sdv-fanout.sdv.svc",
    }
    unverified = emqx_sync.wanted_exhook(Config(listen="127.0.0.1:9000", tls_cert_file="c", tls_key_file="k"))
    assert unverified["ssl"] == {"enable": True, "verify": "verify_none"}


def test_entry_differences_ignore_what_emqx_adds_and_name_what_differs() -> None:
    want = emqx_sync.wanted_exhook(Config(listen="127.0.0.1:9000"))
    assert emqx_sync.exhook_differences(want, HELD_ENTRY) == []
    held = {**HELD_ENTRY, "auto_reconnect": "60s", "pool_size": 16, "enable": False, "url": "http://old:9000"}
    assert emqx_sync.exhook_differences(want, held) == [
        "enable: False -> True",
        "url: 'http://old:9000' -> 'http://127.0.0.1:9000'",
        "auto_reconnect: '60s' -> '2s'",
        "pool_size: 16 -> 8",
    ]
    assert emqx_sync.exhook_differences(want, {**HELD_ENTRY, "auto_reconnect": False}) == [
        "auto_reconnect: False -> '2s'"
    ]


def test_hook_differences() -> None:
    want = emqx_sync.wanted_hooks(Config(ack_topic_prefix="$SDV-FANOUT/acked"))
    held = emqx_sync.wanted_hooks(Config())
    assert emqx_sync.hook_differences(want, held) == ["- message.acked ['agent/+/proxy/request/+']"]
    assert emqx_sync.hook_differences(held, want) == ["+ message.acked ['agent/+/proxy/request/+']"]
    other = emqx_sync.wanted_hooks(Config(heartbeat_topics=("ecp/{VIN}/online",)))
    (line,) = emqx_sync.hook_differences(other, held)
    assert line.startswith("~ message.publish topics +[] -['ecp/+/heartbeat']")
    answer = [{"name": n, "params": {"topics": sorted(t)} if t else {}} for n, t in held.items()]
    assert emqx_sync.held_hooks(answer) == held


def test_rule_differences_ignore_emqx_defaults_and_see_direct_dispatch() -> None:
    cfg = Config(ack_topic_prefix="$SDV-FANOUT/acked")
    new = emqx_sync.wanted_rule(cfg, [(5, 8, 9)])
    old = emqx_sync.wanted_rule(cfg, [(5, 8, 9), (5, 1, 6)])  # a cluster mid-upgrade: the oldest counts
    assert new is not None and old is not None and new["id"] == emqx_sync.RULE_ID
    assert new["actions"][0]["args"]["direct_dispatch"] is True and "direct_dispatch" not in old["actions"][0]["args"]
    held = {**new, "actions": [{"function": "republish", "args": {**new["actions"][0]["args"], "mqtt_properties": {}}}]}
    held["actions"][0]["args"]["user_properties"] = "${user_properties}"
    assert emqx_sync.rule_differences(new, held) == []
    assert emqx_sync.rule_differences(old, held) == [
        "actions[0].args.direct_dispatch: True -> absent (EMQX before 5.8 fails every action with it)"
    ]
    assert emqx_sync.rule_differences(new, {**held, "enable": False}) == ["enable: False -> True"]
    assert emqx_sync.wanted_rule(Config(), [(5, 8, 9)]) is None


def test_hook_names_and_filters() -> None:
    assert hook_of("OnSessionTakenover") == "session.takenover" and hook_of("OnMessageAcked") == "message.acked"
    assert filter_matches("$SDV-FANOUT/data/#", "$SDV-FANOUT/data/1/2")
    assert filter_matches("ecp/+/online", "ecp/V1/online") and not filter_matches("ecp/+/online", "ecp/V1")
    assert not filter_matches("+/x", "$SYS/x") and not filter_matches("#", "$SYS/x")


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _mismatches(hook: str) -> float:
    return metrics.HOOK_SET_MISMATCH.labels(hook)._value.get()  # type: ignore[attr-defined,no-any-return]


def test_watch_counts_every_sign_and_logs_once_a_minute_per_hook() -> None:
    cfg = Config(ack_topic_prefix="$SDV-FANOUT/acked")
    clock = _Clock()
    watch = HookSetWatch(cfg, dict(emqx_sync.hook_specs(cfg)), bytearray(1), clock)
    before = _mismatches("message.acked")
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            watch.unexpected_call("OnMessageAcked")
        clock.now += 61
        watch.unexpected_call("OnMessageAcked")
        watch.unexpected_topic("OnMessagePublish", "ecp/V1/online")  # one of our filters: fine
        watch.unexpected_topic("OnMessagePublish", "old/topic")
    assert _mismatches("message.acked") - before == 4
    lines = [(e["hook"], e["reason"], e["not_logged_before"]) for e in logs if e["event"] == "hook_set_mismatch"]
    assert lines == [
        ("message.acked", "not_registered", 0),
        ("message.acked", "not_registered", 2),
        ("message.publish", "topic_not_registered", 0),
    ]


def test_watch_deadline_confirms_or_reports() -> None:
    cfg = Config()
    shared = bytearray(1)
    watch = HookSetWatch(cfg, dict(emqx_sync.hook_specs(cfg)), shared)
    down = lambda: (_ for _ in ()).throw(OSError("down"))  # noqa: E731
    with structlog.testing.capture_logs() as logs:
        assert watch.deadline_passed(None)  # decided: nothing to ask
        assert watch.deadline_passed(lambda: ["- message.acked ['agent/+/proxy/request/+']"])
        assert not watch.deadline_passed(down)  # EMQX could not tell: worth asking again
        assert not watch.deadline_passed(down, quiet=True)  # ... the next times without a line
    assert [(e["event"], e.get("reason")) for e in logs] == [
        ("hook_set_unconfirmed", None),
        ("hook_set_mismatch", "emqx_holds_other_list"),
        ("hook_set_unconfirmed", "emqx_check_failed"),
    ]
    assert not watch.confirmed
    assert watch.deadline_passed(lambda: [], quiet=True)
    assert watch.confirmed and shared[0] == 1
    other = HookSetWatch(cfg, {}, shared)  # another process of the group sees it
    with structlog.testing.capture_logs() as logs:
        other.deadline_passed(None)
    assert other.confirmed and logs == []


def test_cli_fails_with_one_line_without_key_or_broker(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["emqx", "check"]) == 2
    assert capsys.readouterr().err.strip() == (
        "sdv-fanout: emqx_api_url is empty: where is EMQX's REST API (e.g. http://emqx:18083)?"
    )
    url = f"http://127.0.0.1:{free_port()}"
    assert cli.main(["emqx", "check", "--emqx-api-url", url]) == 2
    assert "emqx_api_key" in capsys.readouterr().err
    code = cli.main(["emqx", "sync", "--emqx-api-url", url, "--emqx-api-key", "k", "--emqx-api-secret", "s3cr3t"])
    err = capsys.readouterr().err
    assert code == 2 and "unreachable" in err and "s3cr3t" not in err and len(err.strip().splitlines()) == 1


def test_key_files_win_and_check_config_masks_the_secrets(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from exhook_server.emqx_api import credentials

    (tmp_path / "key").write_text("from-file\n")
    (tmp_path / "secret").write_text("file-secret\n")
    cfg = Config(
        emqx_api_key="inline",
        emqx_api_secret="inline-secret",
        emqx_api_key_file=str(tmp_path / "key"),
        emqx_api_secret_file=str(tmp_path / "secret"),
    )
    assert credentials(cfg) == ("from-file", "file-secret")
    with pytest.raises(ConfigError, match="emqx_api_secret_file"):
        credentials(Config(emqx_api_key="k", emqx_api_secret_file=str(tmp_path / "missing")))
    assert cli.main(["check-config", "--emqx-api-key", "the-key", "--emqx-api-secret", "the-secret"]) == 0
    out = capsys.readouterr().out
    assert "the-secret" not in out and "the-key" not in out and out.count("# masked") >= 2


def test_start_up_calls_run_in_a_daemon_thread_that_does_not_hold_up_the_exit() -> None:
    """in_daemon_thread returns fn's result or raises its error; a call still blocked when its
    await is cancelled does not keep asyncio.run from returning (asyncio.to_thread would: the
    loop's shutdown waits for the default executor's threads)."""
    import asyncio
    import threading

    from exhook_server.aio import in_daemon_thread
    from testkit.harness import poll

    async def ok() -> int:
        return await in_daemon_thread(lambda: 41 + 1)

    def fail() -> None:
        raise OSError("api down")

    async def failing() -> None:
        await in_daemon_thread(fail)

    assert asyncio.run(ok()) == 42
    with pytest.raises(OSError, match="api down"):
        asyncio.run(failing())

    release = threading.Event()

    async def abandoned() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(in_daemon_thread(release.wait), timeout=0.05)

    runner = threading.Thread(target=lambda: asyncio.run(abandoned()))
    runner.start()
    try:
        poll(lambda: not runner.is_alive(), timeout_s=10)  # returned while the call still blocks
        assert not release.is_set()
    finally:
        release.set()
        runner.join(10)
