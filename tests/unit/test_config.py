"""Settings: defaults, then TOML, then SDV_FANOUT_* environment, then flags; bad values fail early."""

from __future__ import annotations

from pathlib import Path

import pytest

from exhook_server.config import Config, load
from exhook_server.errors import ConfigError


def test_later_sources_win(tmp_path: Path) -> None:
    """A flag beats the environment, which beats the file, which beats the default."""
    f = tmp_path / "c.toml"
    f.write_text('listen = "127.0.0.1:1"\ndata_dir = "/file"\nmax_ids_per_batch = 5\n')
    env = {"SDV_FANOUT_DATA_DIR": "/env", "SDV_FANOUT_MAX_IDS_PER_BATCH": "7", "OTHER": "x"}
    cfg = load(f, env=env, overrides={"data_dir": "/flag", "listen": None})
    assert (cfg.listen, cfg.data_dir, cfg.max_ids_per_batch) == ("127.0.0.1:1", "/flag", 7)


def test_default_config_round_trips(tmp_path: Path) -> None:
    """`default-config` output is a valid config file that loads to the defaults."""
    f = tmp_path / "d.toml"
    f.write_text(Config().to_toml())
    assert load(f, env={}) == Config()


def test_list_settings_from_environment() -> None:
    """A list setting accepts comma-separated or JSON text in the environment."""
    assert load(env={"SDV_FANOUT_PUBLISHER_ALLOWLIST": "a,b"}).publisher_allowlist == ("a", "b")
    assert load(env={"SDV_FANOUT_PUBLISHER_ALLOWLIST": '["c"]'}).publisher_allowlist == ("c",)


@pytest.mark.parametrize("name", ["publisher_allowlist", "heartbeat_topics"])
@pytest.mark.parametrize("raw", ['["sdv-platform", " "]', "sdv-platform, ,ops", '[""]'])
def test_blank_list_entries_are_refused(tmp_path: Path, name: str, raw: str) -> None:
    """A blank entry (an empty name would admit every publisher without a username) fails the load."""
    with pytest.raises(ConfigError, match=f"{name} has a blank entry"):
        load(env={"SDV_FANOUT_" + name.upper(): raw})
    f = tmp_path / "c.toml"
    f.write_text(f'{name} = ["sdv-platform", " "]\n')
    with pytest.raises(ConfigError, match="blank entry"):
        load(f, env={})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SDV_FANOUT_NO_SUCH": "1"}, "unknown setting"),
        ({"SDV_FANOUT_MAX_IDS_PER_BATCH": "many"}, "max_ids_per_batch"),
        ({"SDV_FANOUT_MAX_IDS_PER_BATCH": "0"}, "positive"),
        ({"SDV_FANOUT_LISTEN": "nowhere"}, "HOST:PORT"),
        ({"SDV_FANOUT_VIN_PATTERN": "(["}, "regular expression"),
        ({"SDV_FANOUT_BATCH_TOPIC": "$SDV/+"}, "wildcards"),
        ({"SDV_FANOUT_LOG_FORMAT": "xml"}, "log_format"),
        ({"SDV_FANOUT_MAP_MAX_BYTES": "1024"}, "map_max_bytes"),
        ({"SDV_FANOUT_CATCHUP_SESSION_EXPIRY_S": "0"}, "catchup_session_expiry_s"),
        ({"SDV_FANOUT_CATCHUP_CLIENTID": "x" * 257}, "catchup_clientid"),
        ({"SDV_FANOUT_MAX_DELIVERIES_PER_S": "-1"}, "max_deliveries_per_s"),
        ({"SDV_FANOUT_MAX_DELIVERIES_PER_S": "nan"}, "max_deliveries_per_s"),
    ],
)
def test_bad_settings_are_refused_with_the_setting_named(env: dict[str, str], message: str) -> None:
    """An unusable value raises ConfigError naming what is wrong."""
    with pytest.raises(ConfigError, match=message):
        load(env=env)


def test_unknown_key_in_file_is_refused(tmp_path: Path) -> None:
    """A typo in the TOML file is an error, not silently ignored."""
    f = tmp_path / "c.toml"
    f.write_text("lisen = '0.0.0.0:1'\n")
    with pytest.raises(ConfigError, match="lisen"):
        load(f, env={})


def test_processes_zero_respects_a_cgroup_cpu_quota(tmp_path: Path) -> None:
    """One process per CPU means per CPU the cgroup lets us use, not per CPU of the node:
    cgroup v2 `cpu.max`, else v1 CFS quota/period, rounded up; no quota: the affinity mask."""
    import os

    from exhook_server.cpus import usable_cpus

    visible = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == visible  # no cgroup files at all
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(tmp_path) == visible
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert usable_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").write_text(f"{visible * 100000 * 4} 100000\n")
    assert usable_cpus(tmp_path) == visible, "a quota above the affinity changes nothing"
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert usable_cpus(tmp_path) == visible
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")
    assert usable_cpus(tmp_path) == min(visible, 2)
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("garbage\n")
    assert usable_cpus(tmp_path) == visible


SECRETS = {
    "mqtt_password": "hunter2",
    "store_url": "postgresql://app:s3cr%40t@db-1:5432,db-2:5432/sdv?target_session_attrs=read-write&password=hunter3",
}


def test_secret_settings_are_every_setting_named_like_a_secret() -> None:
    """SECRET_SETTINGS is one set: every *_password / *_secret / *_api_key setting, whoever added
    it, and store_url; never a path to a file (tls_key_file)."""
    import dataclasses

    from exhook_server.config import SECRET_SETTINGS

    names = {f.name for f in dataclasses.fields(Config)}
    assert {"mqtt_password", "store_url"} <= SECRET_SETTINGS <= names
    assert {n for n in names if n.endswith(("_password", "_secret", "_api_key"))} <= SECRET_SETTINGS
    assert not {n for n in SECRET_SETTINGS if n.endswith("_file")}


@pytest.mark.parametrize("command", ["check-config", "default-config"])
def test_config_printouts_mask_secrets_unless_asked(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """check-config and default-config print no password (mqtt_password, the one inside store_url,
    in its userinfo or query) unless --show-secrets; masked lines say so; `load` reads it back."""
    from exhook_server import cli

    for name, value in SECRETS.items():
        monkeypatch.setenv("SDV_FANOUT_" + name.upper(), value)
    assert cli.main([command]) == 0
    shown = capsys.readouterr().out
    assert "hunter" not in shown and "s3cr" not in shown
    if command == "check-config":
        assert 'mqtt_password = "********"  # masked (--show-secrets prints it)' in shown
        url = "postgresql://app:********@db-1:5432,db-2:5432/sdv?target_session_attrs=read-write&password=********"
        assert f'store_url = "{url}"  # masked' in shown
    assert cli.main([command, "--show-secrets"]) == 0
    full = capsys.readouterr().out
    assert "masked" not in full
    if command == "check-config":
        assert all(value in full for value in SECRETS.values())


def test_an_unset_secret_and_a_url_without_a_password_show_as_they_are() -> None:
    """Masking hides values, not their absence: "" stays "", a URL without a password stays whole."""
    from exhook_server.config import masked

    assert masked("mqtt_password", "") == ""
    assert masked("store_url", "postgresql://app@db/sdv") == "postgresql://app@db/sdv"
    assert masked("mqtt_username", "fleet") == "fleet"


def test_lock_timeout_and_cancel_chunk_derive_from_their_bounds() -> None:
    """PostgreSQL's lock_timeout is a quarter of ingest_timeout_s unless set, and must stay below
    it; a cancel's chunk is cancel_chunk_rows, never more than max_rows_per_commit."""
    assert Config().lock_timeout_s == 1.0
    assert Config(ingest_timeout_s=2.0, store_lock_timeout_s=0.5).lock_timeout_s == 0.5
    with pytest.raises(ConfigError, match="store_lock_timeout_s"):
        Config(store_lock_timeout_s=4.0)
    assert Config().cancel_rows == 500
    assert Config(max_ids_per_batch=100, max_rows_per_commit=100).cancel_rows == 100
    with pytest.raises(ConfigError, match="cancel_chunk_rows"):
        Config(cancel_chunk_rows=0)


def test_the_catchup_session_has_one_client_id_per_deployment_and_needs_a_broker() -> None:
    """Not per process or host: every process and restart asks EMQX for the same session."""
    assert load(env={}).catchup_session_clientid == "sdv-fanout-catchup"
    assert load(env={"SDV_FANOUT_MQTT_CLIENTID_PREFIX": "fleet-a-"}).catchup_session_clientid == "fleet-a-catchup"
    assert load(env={"SDV_FANOUT_CATCHUP_CLIENTID": "mine"}).catchup_session_clientid == "mine"
    assert load(env={}).catchup_active
    assert not load(env={"SDV_FANOUT_MQTT_URL": ""}).catchup_active
    assert not load(env={"SDV_FANOUT_CATCHUP_ENABLED": "false"}).catchup_active
