"""Batch messages: which topics carry them, and turning their payloads into checked values.

Pure functions of (topic, payload, config): nothing here touches gRPC or LMDB.
Every rejection is a `BatchRejected` with a stable `Reason`, raised before any
byte is written, so a bad batch can never leave half of itself behind.
"""

from __future__ import annotations

import base64
import binascii
import enum
import re
from dataclasses import dataclass
from typing import Any

import orjson

from exhook_server.config import FORBIDDEN_LEVEL_CHARS, Config
from exhook_server.errors import BatchRejected, Reason


class Kind(enum.Enum):
    """The three batch topics."""

    BATCH = "batch"  # seed 000: {ids, request_id, data}
    DATA = "data"  # plugin 0.4.x: raw payload on <prefix>/<data_id>
    TRIGGER = "trigger"  # plugin 0.4.x: {ids, request_id, data_id}


@dataclass(frozen=True, slots=True)
class Batch:
    """A complete request for many vehicles, payload inline."""

    vins: tuple[str, ...]
    request_id: str
    blob: bytes


@dataclass(frozen=True, slots=True)
class Data:
    """A payload named by the platform's data_id, waited for by triggers."""

    data_id: str
    blob: bytes


@dataclass(frozen=True, slots=True)
class Trigger:
    """A request for many vehicles whose payload travels separately as `data_id`."""

    vins: tuple[str, ...]
    request_id: str
    data_id: str


Parsed = Batch | Data | Trigger


class BatchParser:
    """Classifies topics and validates batch payloads against the configured limits."""

    def __init__(self, cfg: Config) -> None:
        self._cfg = cfg
        self._vin_re = re.compile(cfg.vin_pattern)
        self._data_id_re = re.compile(cfg.data_id_pattern)
        self._data_prefix = cfg.data_topic_prefix + "/"
        self._allow = frozenset(cfg.publisher_allowlist)

    def classify(self, topic: str) -> Kind | None:
        """The batch kind a topic carries, or None for every other topic."""
        if topic == self._cfg.batch_topic:
            return Kind.BATCH
        if topic == self._cfg.trigger_topic:
            return Kind.TRIGGER
        if topic.startswith(self._data_prefix) or topic == self._cfg.data_topic_prefix:
            return Kind.DATA
        return None

    def check_publisher(self, clientid: str, username: str) -> None:
        """Enforce the optional allowlist; either the clientid or the username may match."""
        if self._allow and clientid not in self._allow and username not in self._allow:
            raise BatchRejected(
                Reason.PUBLISHER_NOT_ALLOWED,
                "publisher is not in publisher_allowlist",
                clientid=clientid,
                username=username,
            )

    def parse(self, kind: Kind, topic: str, payload: bytes) -> Parsed:
        """Validate one batch message; raises BatchRejected with the first problem found."""
        if len(payload) > self._cfg.max_payload_bytes:
            raise BatchRejected(
                Reason.PAYLOAD_TOO_LARGE,
                f"{len(payload)} bytes > max_payload_bytes {self._cfg.max_payload_bytes}",
            )
        if kind is Kind.DATA:
            return Data(self._data_id(topic[len(self._data_prefix) :]), payload)
        doc = _json_object(payload)
        vins = self._vins(doc)
        request_id = self._request_id(doc)
        if kind is Kind.TRIGGER:
            return Trigger(vins, request_id, self._data_id(_field(doc, "data_id")))
        return Batch(vins, request_id, _blob(doc))

    # -- fields ----------------------------------------------------------------
    def _vins(self, doc: dict[str, Any]) -> tuple[str, ...]:
        ids = _field(doc, "ids")
        if not isinstance(ids, list):
            raise BatchRejected(Reason.WRONG_TYPE, "ids must be an array of strings")
        if not ids:
            raise BatchRejected(Reason.EMPTY_IDS, "ids is empty")
        if len(ids) > self._cfg.max_ids_per_batch:
            raise BatchRejected(
                Reason.TOO_MANY_IDS, f"{len(ids)} ids > max_ids_per_batch {self._cfg.max_ids_per_batch}"
            )
        # Fast path for the common case, every VIN good: the checks run over the whole list in
        # C (type set, dict fold, map of the compiled pattern, one forbidden-char scan of the
        # joined VINs) instead of a Python loop per VIN; ~4x cheaper for 200 VINs. Any doubt
        # falls through to the loop below, which finds the first problem in order, as always.
        if set(map(type, ids)) == {str}:
            folded = dict.fromkeys(ids)
            if all(folded) and all(map(self._vin_re.fullmatch, folded)) and _is_level("".join(folded)):
                return tuple(folded)
        seen: dict[str, None] = {}
        for vin in ids:
            if not isinstance(vin, str):
                raise BatchRejected(Reason.WRONG_TYPE, "ids must be an array of strings")
            if vin not in seen:
                if not self._vin_re.fullmatch(vin) or not _is_level(vin):
                    raise BatchRejected(Reason.BAD_VIN, "VIN does not match vin_pattern", vin=vin[:80])
                seen[vin] = None
        # Duplicates are folded, first occurrence wins the order.
        return tuple(seen)

    def _request_id(self, doc: dict[str, Any]) -> str:
        rid = _field(doc, "request_id")
        if not isinstance(rid, str):
            raise BatchRejected(Reason.WRONG_TYPE, "request_id must be a string")
        try:
            size = len(rid.encode())
        except UnicodeEncodeError:
            size = -1
        if not 0 < size <= self._cfg.max_request_id_bytes or not _is_level(rid):
            raise BatchRejected(
                Reason.BAD_REQUEST_ID,
                "request_id must be 1..max_request_id_bytes of UTF-8, one topic level, no control chars",
                request_id=rid[:80],
            )
        return rid

    def _data_id(self, data_id: Any) -> str:
        if not isinstance(data_id, str):
            raise BatchRejected(Reason.WRONG_TYPE, "data_id must be a string")
        if not self._data_id_re.fullmatch(data_id) or not _is_level(data_id):
            raise BatchRejected(Reason.BAD_DATA_ID, "data_id does not match data_id_pattern", data_id=data_id[:80])
        return data_id


_NOT_IN_LEVEL = re.compile("[" + re.escape("".join(sorted(FORBIDDEN_LEVEL_CHARS))) + "\x01-\x1f\x7f]")


def _is_level(text: str) -> bool:
    """Usable as one MQTT topic level and inside our NUL-separated keys (no control chars)."""
    return bool(text) and _NOT_IN_LEVEL.search(text) is None


def _json_object(payload: bytes) -> dict[str, Any]:
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise BatchRejected(Reason.INVALID_JSON, str(exc)) from None
    if not isinstance(doc, dict):
        raise BatchRejected(Reason.WRONG_TYPE, "the batch must be a JSON object")
    return doc


def _field(doc: dict[str, Any], name: str) -> Any:
    if name not in doc:
        raise BatchRejected(Reason.MISSING_FIELD, f"{name} is missing", field=name)
    return doc[name]


def _blob(doc: dict[str, Any]) -> bytes:
    data = _field(doc, "data")
    if not isinstance(data, str):
        raise BatchRejected(Reason.WRONG_TYPE, "data must be a string")
    encoding = doc.get("data_encoding", "utf-8")
    if encoding in ("utf-8", "utf8", "plain"):
        try:
            return data.encode()
        except UnicodeEncodeError:
            raise BatchRejected(Reason.BAD_DATA_ENCODING, "data is not valid Unicode") from None
    if encoding == "base64":
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise BatchRejected(Reason.BAD_DATA_ENCODING, "data is not valid base64") from None
    raise BatchRejected(
        Reason.BAD_DATA_ENCODING, "data_encoding must be 'utf-8' or 'base64'", data_encoding=str(encoding)[:40]
    )
