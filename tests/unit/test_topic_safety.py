"""Identifiers and topic templates are refused unless every MQTT broker accepts them in a topic name."""

from __future__ import annotations

import json

import pytest

from exhook_server.batch import BatchParser, Kind
from exhook_server.config import Config, load
from exhook_server.errors import BatchRejected, ConfigError, Reason
from exhook_server.topics import level_problem, name_problem

#: Characters MQTT 5 (§1.5.4) forbids or discourages and mosquitto refuses by dropping the client.
UNSAFE = [
    "\u0000",
    "\u0001",
    "\u001f",
    "\u007f",
    "\u0085",  # NEL: the C1 control that stalled the fleet
    "\u009f",
    "\ufdd0",
    "\ufdef",
    "\ufffe",
    "\uffff",
    "\U0001fffe",
    "\U0010ffff",
]
SAFE = ["task_ota_1", "täsk-ü", "任务_1", "\u00a0nbsp", "\U0001f697car", "a.b:c"]


def _batch(**fields: object) -> bytes:
    return json.dumps({"ids": ["VIN1"], "request_id": "task_ota_1", "data": "x", **fields}).encode()


@pytest.mark.parametrize("char", UNSAFE)
def test_unsafe_character_is_refused_in_request_id(char: str) -> None:
    """A request id holding a control character or non-character is rejected bad_request_id, naming it."""
    with pytest.raises(BatchRejected) as info:
        BatchParser(Config()).parse(Kind.BATCH, "$SDV-FANOUT", _batch(request_id=f"task{char}1"))
    assert info.value.reason is Reason.BAD_REQUEST_ID
    assert f"U+{ord(char):04X}" in info.value.detail


@pytest.mark.parametrize("char", UNSAFE)
def test_unsafe_character_is_refused_in_vin_even_if_the_pattern_allows_it(char: str) -> None:
    """A permissive vin_pattern cannot let a VIN through that no broker would carry."""
    parser = BatchParser(Config(vin_pattern=r".{1,64}"))
    with pytest.raises(BatchRejected) as info:
        parser.parse(Kind.BATCH, "$SDV-FANOUT", _batch(ids=["GOOD1", f"BAD{char}"]))
    assert info.value.reason is Reason.BAD_VIN


@pytest.mark.parametrize("char", UNSAFE)
def test_unsafe_character_is_refused_in_data_id(char: str) -> None:
    """The plugin format's data_id (topic level and trigger field) follows the same rule."""
    parser = BatchParser(Config(data_id_pattern=r".{1,128}"))
    with pytest.raises(BatchRejected) as info:
        parser.parse(Kind.DATA, f"$SDV-FANOUT/data/d{char}", b"blob")
    assert info.value.reason is Reason.BAD_DATA_ID


@pytest.mark.parametrize("rid", SAFE)
def test_printable_unicode_request_ids_are_accepted(rid: str) -> None:
    """Non-ASCII printable text is a valid topic level and stays accepted."""
    parsed = BatchParser(Config()).parse(Kind.BATCH, "$SDV-FANOUT", _batch(request_id=rid))
    assert parsed.request_id == rid


def test_long_vin_is_refused_whatever_the_pattern() -> None:
    """VINs stay within the byte bound that keeps LMDB keys under their 511-byte limit."""
    parser = BatchParser(Config(vin_pattern=r"[A-Z]{1,1000}"))
    with pytest.raises(BatchRejected) as info:
        parser.parse(Kind.BATCH, "$SDV-FANOUT", _batch(ids=["A" * 201]))
    assert info.value.reason is Reason.BAD_VIN
    assert "bytes" in info.value.detail


def test_rejection_log_field_escapes_control_characters() -> None:
    """The offending id is logged escaped, so a log line stays one line."""
    with pytest.raises(BatchRejected) as info:
        BatchParser(Config()).parse(Kind.BATCH, "$SDV-FANOUT", _batch(request_id="a\u0085\nb"))
    assert info.value.fields["request_id"] == "a\\x85\\nb"


def test_level_and_name_rules() -> None:
    """A level refuses separators and wildcards; a name allows separators but not wildcards."""
    assert level_problem("a/b") is not None
    assert name_problem("a/b") is None
    assert name_problem("a/+") is not None
    assert name_problem("a" * 65_536) is not None
    assert name_problem("/".join(["a"] * 129)) is not None


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("REQUEST_TOPIC_PREFIX", "agent/x{VIN}/req", "whole topic level"),
        ("REQUEST_TOPIC_PREFIX", "agent/{VIN}/{VIN}", "exactly once"),
        ("REQUEST_TOPIC_PREFIX", "agent/{VIN}/re\u0085q", "U\\+0085"),
        ("HEARTBEAT_TOPICS", "ecp/{VIN}/on\u0001line", "U\\+0001"),
        ("HEARTBEAT_TOPICS", "ecp/{VIN}-x/online", "whole topic level"),
        ("BATCH_TOPIC", "$SDV\u009fFANOUT", "U\\+009F"),
        ("TRIGGER_TOPIC", "$SDV-FANOUT/#", "wildcards"),
        ("MAX_REQUEST_ID_BYTES", "300", "max_request_id_bytes"),
    ],
)
def test_unusable_topic_settings_are_refused(setting: str, value: str, message: str) -> None:
    """A template or topic setting no broker would accept stops the server at start-up, saying why."""
    with pytest.raises(ConfigError, match=message):
        load(env={f"SDV_FANOUT_{setting}": value})
