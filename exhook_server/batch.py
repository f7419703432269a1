"""Batch messages: which topics carry them, and turning their payloads into checked values.

Pure functions of (topic, payload, config): nothing here touches gRPC or LMDB.
Every rejection is a `BatchRejected` with a stable `Reason`, raised before any
byte is written, so a bad batch can never leave half of itself behind.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import enum
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from exhook_server.config import MAX_DATA_ID_BYTES, MAX_VIN_BYTES, Config
from exhook_server.errors import BatchRejected, Reason
from exhook_server.topics import is_level, level_problem
from storage.model import FLAG_AWAIT_RESPONSE, FLAG_HIGH_PRIORITY, now_ms


class Kind(enum.Enum):
    """The three batch topics."""

    BATCH = "batch"  # seed 000: {ids, request_id, data}
    DATA = "data"  # plugin 0.4.x: raw payload on <prefix>/<data_id>
    TRIGGER = "trigger"  # plugin 0.4.x: {ids, request_id, data_id}
    CANCEL = "cancel"  # {request_id, ids?}: end the request's pending rows
    POLICY = "policy"  # {request_id, ...fields}: set (or, with no field, clear) the request's policy


#: Longest optional batch_id (it keys the receipts kept for idempotent retries) and correlation_id.
MAX_BATCH_ID_BYTES = 128
MAX_CORRELATION_ID_BYTES = 256


@dataclass(frozen=True, slots=True)
class Tags:
    """Optional fields the platform adds to follow a batch: `batch_id` makes a retry store
    nothing twice; `correlation_id` is echoed in every status message about the batch."""

    batch_id: str | None = None
    correlation_id: str | None = None


#: Starts the batch_id implied for a batch or trigger that names none (`implied_batch_id`): 59
#: bytes with the digest, kept apart from the platform's own ids by this prefix.
IMPLIED_PREFIX = "sdv-fanout:message:"


def implied_batch_id(topic: str, payload: bytes) -> str:
    """The batch_id of a message that names none: a digest of its topic and payload, so the same
    message reaching us twice (the hook and the catch-up session, or a redelivery) is stored once."""
    digest = hashlib.blake2b(topic.encode(), digest_size=20)
    digest.update(b"\0")
    digest.update(payload)  # fed in parts: no copy of a payload of megabytes
    return IMPLIED_PREFIX + digest.hexdigest()


def shown_batch_id(batch_id: str | None) -> str | None:
    """The batch_id a receipt shows: the platform's own, never an implied one."""
    return None if batch_id is None or batch_id.startswith(IMPLIED_PREFIX) else batch_id


#: The latest expires_at taken (9999-12-31T23:59:59.999Z): beyond it, a typo, not a plan.
MAX_EXPIRES_MS = 253_402_300_799_999


@dataclass(frozen=True, slots=True)
class Lifecycle:
    """What a batch asks of its rows' life: when they stop being worth sending, whether the
    vehicle's answer (not its PUBACK) ends them, and whether they go before its normal rows."""

    #: Epoch ms; 0 = never.
    expires_ms: int = 0
    await_response: bool = False
    high_priority: bool = False

    @property
    def flags(self) -> int:
        return (FLAG_AWAIT_RESPONSE if self.await_response else 0) | (FLAG_HIGH_PRIORITY if self.high_priority else 0)


_PLAIN = Lifecycle()


@dataclass(frozen=True, slots=True)
class Batch:
    """A complete request for many vehicles, payload inline."""

    vins: tuple[str, ...]
    request_id: str
    blob: bytes
    tags: Tags = Tags()
    life: Lifecycle = Lifecycle()


@dataclass(frozen=True, slots=True)
class Preview:
    """A batch or trigger with `"dry_run": true`: what it would do is reported, nothing is stored.
    `batch` is the batch or trigger as parsed; None when VINs would get it rejected, every one of
    them in `rejected_vins` (shown form)."""

    request_id: str
    batch: Batch | Trigger | None
    rejected_vins: tuple[str, ...] = ()
    tags: Tags = Tags()


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
    tags: Tags = Tags()
    life: Lifecycle = Lifecycle()


@dataclass(frozen=True, slots=True)
class Cancel:
    """End the pending rows of `request_id`: of these VINs, or of every vehicle (None)."""

    request_id: str
    vins: tuple[str, ...] | None
    tags: Tags = Tags()


@dataclass(frozen=True, slots=True)
class PolicyDoc:
    """A policy message for `request_id`: its fields still to be checked (exhook_server/policy.py)."""

    request_id: str
    fields: dict[str, Any]
    tags: Tags = Tags()


Parsed = Batch | Preview | Data | Trigger | Cancel | PolicyDoc


class BatchParser:
    """Classifies topics and validates batch payloads against the configured limits."""

    def __init__(self, cfg: Config, clock: Callable[[], int] = now_ms) -> None:
        self._cfg = cfg
        self._clock = clock
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
        if topic == self._cfg.cancel_topic:
            return Kind.CANCEL
        if topic == self._cfg.policy_topic:
            return Kind.POLICY
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
        if kind is Kind.CANCEL:
            request_id = self._request_id(doc)
            # Absent = every vehicle; present, it must be an array like a batch's (null is no
            # array: it must not widen a cancel to every vehicle).
            vins = self._vins(doc) if "ids" in doc else None
            return Cancel(request_id, vins, _tags(doc))
        if kind is Kind.POLICY:
            return PolicyDoc(self._request_id(doc), doc, _tags(doc))
        if kind in (Kind.BATCH, Kind.TRIGGER) and _dry_run(doc):
            return self._preview(kind, doc)
        return self._rows(kind, doc)

    def _rows(self, kind: Kind, doc: dict[str, Any]) -> Batch | Trigger:
        vins = self._vins(doc)
        request_id = self._request_id(doc)
        tags = _tags(doc)
        life = self._lifecycle(doc)
        if kind is Kind.TRIGGER:
            return Trigger(vins, request_id, self._data_id(_field(doc, "data_id")), tags, life)
        return Batch(vins, request_id, _blob(doc), tags, life)

    def _preview(self, kind: Kind, doc: dict[str, Any]) -> Preview:
        """The batch's (or trigger's) own checks, in their order; a rejection for a VIN names
        every bad VIN instead of the first (any other rejection is the batch's)."""
        try:
            batch = self._rows(kind, doc)
        except BatchRejected as rej:
            if rej.reason is not Reason.BAD_VIN:
                raise
            return Preview(self._request_id(doc), None, self.bad_vins(doc["ids"]), _tags(doc))
        return Preview(batch.request_id, batch, (), batch.tags)

    def bad_vins(self, ids: list[Any]) -> tuple[str, ...]:
        """Every distinct VIN of `ids` (a list within max_ids_per_batch) that `_check_vin`
        refuses, in order, in the shown form of a receipt."""
        bad: dict[str, None] = {}
        for vin in dict.fromkeys(v for v in ids if isinstance(v, str)):
            try:
                self._check_vin(vin)
            except BatchRejected:
                bad[_shown(vin)] = None
        return tuple(bad)

    def _lifecycle(self, doc: dict[str, Any]) -> Lifecycle:
        expires_ms = _expires_ms(doc.get("expires_at"))
        if expires_ms and expires_ms <= self._clock():
            raise BatchRejected(
                Reason.EXPIRED, "expires_at is past: the request would never be sent", field="expires_at"
            )
        wait = doc.get("await_response")
        if wait is None:
            wait = self._cfg.await_response
        elif not isinstance(wait, bool):
            raise BatchRejected(Reason.WRONG_TYPE, "await_response must be true or false", field="await_response")
        if wait and not self._cfg.response_topic_prefix:
            raise BatchRejected(
                Reason.RESPONSES_OFF, "await_response needs response_topic_prefix (it is empty)", field="await_response"
            )
        high = _high_priority(doc.get("priority"))
        if not expires_ms and not wait and not high:
            return _PLAIN
        return Lifecycle(expires_ms, wait, high)

    # -- fields ----------------------------------------------------------------
    def _vins(self, doc: dict[str, Any]) -> tuple[str, ...]:
        ids = _field(doc, "ids")
        if not isinstance(ids, list):
            raise BatchRejected(Reason.WRONG_TYPE, "ids must be an array of strings", field="ids")
        if not ids:
            raise BatchRejected(Reason.EMPTY_IDS, "ids is empty", field="ids")
        if len(ids) > self._cfg.max_ids_per_batch:
            raise BatchRejected(
                Reason.TOO_MANY_IDS, f"{len(ids)} ids > max_ids_per_batch {self._cfg.max_ids_per_batch}", field="ids"
            )
        # Fast path for the common case, every VIN good: the checks run over the whole list in
        # C (type set, dict fold, map of the compiled pattern, one forbidden-char scan of the
        # joined VINs) instead of a Python loop per VIN; ~4x cheaper for 200 VINs. Any doubt
        # falls through to the loop below, which finds the first problem in order, as always.
        if set(map(type, ids)) == {str}:
            folded = dict.fromkeys(ids)
            # A character is at most 4 bytes of UTF-8: short VINs need no encoding to check.
            if (
                all(folded)
                and max(map(len, folded)) <= MAX_VIN_BYTES // 4
                and all(map(self._vin_re.fullmatch, folded))
                and is_level("".join(folded))
            ):
                return tuple(folded)
        seen: dict[str, None] = {}
        for i, vin in enumerate(ids):
            if not isinstance(vin, str):
                raise BatchRejected(Reason.WRONG_TYPE, f"ids[{i}] is not a string", field="ids")
            if vin not in seen:
                self._check_vin(vin)
                seen[vin] = None
        # Duplicates are folded, first occurrence wins the order.
        return tuple(seen)

    def _check_vin(self, vin: str) -> None:
        if not self._vin_re.fullmatch(vin):
            raise BatchRejected(Reason.BAD_VIN, "VIN does not match vin_pattern", field="ids", vin=_shown(vin))
        _check_level(Reason.BAD_VIN, "vin", vin, MAX_VIN_BYTES)

    def _request_id(self, doc: dict[str, Any]) -> str:
        rid = _field(doc, "request_id")
        if not isinstance(rid, str):
            raise BatchRejected(Reason.WRONG_TYPE, "request_id must be a string", field="request_id")
        _check_level(Reason.BAD_REQUEST_ID, "request_id", rid, self._cfg.max_request_id_bytes)
        return rid

    def _data_id(self, data_id: Any) -> str:
        if not isinstance(data_id, str):
            raise BatchRejected(Reason.WRONG_TYPE, "data_id must be a string", field="data_id")
        if not self._data_id_re.fullmatch(data_id):
            raise BatchRejected(
                Reason.BAD_DATA_ID, "data_id does not match data_id_pattern", field="data_id", data_id=_shown(data_id)
            )
        _check_level(Reason.BAD_DATA_ID, "data_id", data_id, MAX_DATA_ID_BYTES)
        return data_id


def _check_level(reason: Reason, name: str, text: str, max_bytes: int) -> None:
    """An id becomes one level of a delivery topic and part of an LMDB key: it must be a topic
    level every broker accepts (topics.level_problem) and fit its byte bound. `name` is the
    batch's field, or `vin` for one of its ids."""
    problem = level_problem(text)
    if problem is None and len(text.encode()) > max_bytes:
        problem = f"longer than {max_bytes} bytes of UTF-8"
    if problem is not None:
        field = "ids" if name == "vin" else name
        what = "VIN" if name == "vin" else name
        detail = f"{what} is not usable as one topic level: {problem}"
        raise BatchRejected(reason, detail, field=field, **{name: _shown(text)})


def _dry_run(doc: dict[str, Any]) -> bool:
    value = doc.get("dry_run", False)
    if not isinstance(value, bool):
        raise BatchRejected(Reason.WRONG_TYPE, "dry_run must be true or false", field="dry_run")
    return value


#: A batch's `priority` values: "high" rows go before the vehicle's "normal" ones (the default).
PRIORITIES = ("normal", "high")


def _high_priority(value: Any) -> bool:
    """Whether a batch's `priority` field asks for high priority (absent: normal)."""
    if value is None:
        return False
    if not isinstance(value, str):
        raise BatchRejected(Reason.WRONG_TYPE, "priority must be a string", field="priority")
    if value not in PRIORITIES:
        raise BatchRejected(Reason.BAD_PRIORITY, 'priority must be "high" or "normal"', field="priority")
    return value == "high"


def _tags(doc: dict[str, Any]) -> Tags:
    batch_id = _optional_text(doc, "batch_id", Reason.BAD_BATCH_ID, MAX_BATCH_ID_BYTES)
    correlation_id = _optional_text(doc, "correlation_id", Reason.BAD_CORRELATION_ID, MAX_CORRELATION_ID_BYTES)
    return Tags(batch_id, correlation_id) if batch_id or correlation_id else _NO_TAGS


def _optional_text(doc: dict[str, Any], name: str, reason: Reason, max_bytes: int) -> str | None:
    value = doc.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise BatchRejected(Reason.WRONG_TYPE, f"{name} must be a string", field=name)
    try:
        size = len(value.encode())
    except UnicodeEncodeError:  # a lone surrogate
        size = -1
    if not 0 < size <= max_bytes:
        detail = f"{name} must be 1..{max_bytes} bytes of UTF-8"
        raise BatchRejected(reason, detail, field=name, **{name: _shown(value)})
    return value


_NO_TAGS = Tags()


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


def _expires_ms(value: Any) -> int:
    """expires_at as epoch ms: an integer of ms, or an RFC 3339 date-time with its offset."""
    return 0 if value is None else instant_ms(value, "expires_at", Reason.BAD_EXPIRES_AT)


def instant_ms(value: Any, name: str, reason: Reason) -> int:
    """A point in time given as an integer of epoch ms or an RFC 3339 date-time with its offset,
    as epoch ms; BatchRejected(`reason`, field=`name`) otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 < value <= MAX_EXPIRES_MS:
            raise BatchRejected(reason, f"{name} must be 1..{MAX_EXPIRES_MS} epoch milliseconds", field=name)
        return value
    if isinstance(value, str) and len(value) <= 64:
        try:
            when = datetime.datetime.fromisoformat(value.upper())  # RFC 3339 allows "t" and "z"
        except ValueError:
            when = None
        if when is not None and when.tzinfo is not None and "T" in value.upper():
            ms = (when - _EPOCH) // datetime.timedelta(milliseconds=1)
            if 0 < ms <= MAX_EXPIRES_MS:
                return ms
        raise BatchRejected(
            reason,
            f"{name} must be RFC 3339 with an offset (2026-11-23T18:00:00Z) or epoch milliseconds",
            field=name,
            **{name: _shown(value)},
        )
    raise BatchRejected(reason, f"{name} must be an integer (epoch ms) or an RFC 3339 string", field=name)


def _shown(text: str) -> str:
    """An untrusted id as a log or receipt field: control characters escaped (one event per
    line), cut to 80 characters."""
    return text[:80].encode("unicode_escape").decode("ascii")[:80]


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
        raise BatchRejected(Reason.WRONG_TYPE, "data must be a string", field="data")
    encoding = doc.get("data_encoding", "utf-8")
    if encoding in ("utf-8", "utf8", "plain"):
        try:
            return data.encode()
        except UnicodeEncodeError:
            raise BatchRejected(Reason.BAD_DATA_ENCODING, "data is not valid Unicode", field="data") from None
    if encoding == "base64":
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise BatchRejected(Reason.BAD_DATA_ENCODING, "data is not valid base64", field="data") from None
    raise BatchRejected(
        Reason.BAD_DATA_ENCODING,
        "data_encoding must be 'utf-8' or 'base64'",
        field="data_encoding",
        data_encoding=str(encoding)[:40],
    )
