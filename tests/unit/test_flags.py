"""Every setting is a flag generated from the settings table, and a flag means what its variable means."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import pytest

from exhook_server import cli, flags
from exhook_server.config import ENV_PREFIX, Config, load
from exhook_server.errors import ConfigError

DEFAULTS = Config()
HINTS = typing.get_type_hints(Config)

#: A valid non-default text for the string settings whose validation wants a shape.
STRINGS = {
    "listen": "127.0.0.1:9555",
    "metrics_listen": "127.0.0.1:9556",
    "admin_listen": "",
    "batch_topic": "fleet/batch",
    "data_topic_prefix": "fleet/data",
    "trigger_topic": "fleet/trigger",
    "cancel_topic": "fleet/cancel",
    "response_topic_prefix": "car/{VIN}/answer",
    "store_url": "postgresql://sdv@db-1:5432,db-2:5432/sdv?target_session_attrs=read-write",
    "vin_pattern": "[A-Z0-9]{17}",
    "data_id_pattern": "[a-f0-9]{40}",
    "request_topic_prefix": "car/{VIN}/cmd",
    "vehicle_events": "hooks",
    "mqtt_url": "mqtts://broker.example:8883",
    "log_format": "json",
    "log_level": "debug",
    "emqx_api_url": "http://emqx.emqx.svc:18083",
    "emqx_exhook_url": "http://sdv-fanout.sdv.svc:9000",
    "emqx_exhook_name": "fleet-hook",
    "emqx_exhook_failed_action": "deny",
}
#: Settings that are only valid together with others: given the same way to both sides.
COMPANIONS = {
    "tls_cert_file": {"tls_key_file": "key.pem"},
    "tls_key_file": {"tls_cert_file": "cert.pem"},
    "tls_client_ca_file": {"tls_cert_file": "cert.pem", "tls_key_file": "key.pem"},
    "cli_tls_cert_file": {"cli_tls_key_file": "client.key"},
    "cli_tls_key_file": {"cli_tls_cert_file": "client.pem"},
    "emqx_exhook_tls_cert_file": {"emqx_exhook_tls_key_file": "client.key"},
    "emqx_exhook_tls_key_file": {"emqx_exhook_tls_cert_file": "client.pem"},
    "emqx_sync_on_start": {"emqx_api_url": "http://emqx:18083"},
}


def sample(name: str) -> str:
    """A representative non-default value of the setting, as text (what a flag or variable holds)."""
    kind, default = HINTS[name], getattr(DEFAULTS, name)
    if kind is bool:
        return "false" if default else "true"
    if kind is int:
        return f"{default - 1 if name == 'max_ids_per_batch' else default + 1:_}"  # `_` as people write it
    if kind is float:
        return str(default + 0.5)
    if kind is str:
        return STRINGS.get(name, f"/etc/sdv-fanout/{name}.pem" if name.endswith("_file") else "sample-text")
    return "car/{VIN}/up,car/{VIN}/beat" if name == "heartbeat_topics" else "sdv-platform,ops"


def argv(name: str, text: str) -> list[str]:
    if HINTS[name] is bool:
        return [flags.flag(name) if text == "true" else "--no-" + flags.flag(name)[2:]]
    return [flags.flag(name), text]


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The test process's own SDV_FANOUT_* variables do not leak into the comparison."""
    import os

    for key in list(os.environ):
        if key.startswith(ENV_PREFIX):
            monkeypatch.delenv(key)
    return monkeypatch


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(Config)])
@pytest.mark.parametrize("command", [["serve"], ["check-config"], ["gc", "run"], ["gc", "apply", "PLAN"]])
def test_flag_gives_the_same_config_as_its_environment_variable(
    name: str, command: list[str], no_env: pytest.MonkeyPatch
) -> None:
    """`--<name>` and `SDV_FANOUT_<NAME>` with the same text load to one and the same Config."""
    text = sample(name)
    companions = {ENV_PREFIX + k.upper(): v for k, v in COMPANIONS.get(name, {}).items()}
    for key, value in companions.items():
        no_env.setenv(key, value)
    by_flag = cli._load(cli._parser().parse_args([*command, *argv(name, text)]))
    by_env = load(env={**companions, ENV_PREFIX + name.upper(): text})
    assert getattr(by_flag, name) != getattr(DEFAULTS, name), "the sample must differ from the default"
    assert by_flag == by_env


def test_flag_beats_environment_which_beats_file(tmp_path: Path, no_env: pytest.MonkeyPatch) -> None:
    """Flags override SDV_FANOUT_* variables, which override the --config file."""
    f = tmp_path / "c.toml"
    f.write_text('mqtt_url = "mqtt://file:1883"\nmetrics_listen = "127.0.0.1:1"\nworkers = 3\n')
    no_env.setenv("SDV_FANOUT_MQTT_URL", "mqtt://env:1883")
    no_env.setenv("SDV_FANOUT_WORKERS", "4")
    args = cli._parser().parse_args(["serve", "--config", str(f), "--workers", "5"])
    cfg = cli._load(args)
    assert (cfg.metrics_listen, cfg.mqtt_url, cfg.workers) == ("127.0.0.1:1", "mqtt://env:1883", 5)


def test_serve_accepts_mqtt_url_and_metrics_listen(no_env: pytest.MonkeyPatch) -> None:
    """The flags the hand-written list lacked are there: --mqtt-url "" (store only) and --metrics-listen."""
    args = cli._parser().parse_args(["serve", "--mqtt-url", "", "--metrics-listen", "127.0.0.1:0", "--ready-file", "r"])
    cfg = cli._load(args)
    assert (cfg.mqtt_url, cfg.metrics_listen, args.ready_file) == ("", "127.0.0.1:0", "r")


def test_choices_and_bad_values_are_refused(no_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A word outside a setting's choices stops argparse; a bad number is the loader's ConfigError."""
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["serve", "--log-format", "xml"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="max_ids_per_batch"):
        cli._load(cli._parser().parse_args(["check-config", "--max-ids-per-batch", "many"]))


def test_every_flag_has_help_from_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    """Help text comes from the comment above the field (most fields have one) and names the default."""
    helps = flags.setting_help()
    assert "loopback only by default" in helps["admin_listen"]
    assert len(helps) >= len(dataclasses.fields(Config)) - 8
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "(default: 127.0.0.1:9001)" in text
    for field in dataclasses.fields(Config):
        assert flags.flag(field.name) in text


def test_check_config_prints_flags_like_default_config(no_env: pytest.MonkeyPatch, capsys: Any) -> None:
    """check-config with flags prints the same TOML format as default-config, with the flags applied."""
    assert cli.main(["check-config", "--workers", "6", "--no-vin-from-clientid"]) == 0
    shown = capsys.readouterr().out
    assert "workers = 6\n" in shown and "vin_from_clientid = false\n" in shown
    assert cli.main(["default-config"]) == 0
    assert capsys.readouterr().out == Config().to_toml()
