"""The few exceptions sdv-fanout raises, and the stable reason codes of rejections.

    FanoutError
    ├── ConfigError           settings that cannot work; raised at start-up only
    └── BatchRejected(reason) a batch message we will not store; `reason` is a Reason

`storage.errors.StorageError` and its subclasses are re-exported here. A reason code is the same
string in the log event (`reason=`), the metric label and the tests, so operators can alert on it.
"""

from __future__ import annotations

import enum

from storage.errors import EarlyTriggersFull, StorageError, StorageFull

__all__ = [
    "BatchRejected",
    "ConfigError",
    "EarlyTriggersFull",
    "FanoutError",
    "Reason",
    "StorageError",
    "StorageFull",
]


class Reason(enum.StrEnum):
    """Why a batch message was rejected. Values are stable: dashboards depend on them."""

    INVALID_JSON = "invalid_json"
    MISSING_FIELD = "missing_field"
    WRONG_TYPE = "wrong_type"
    EMPTY_IDS = "empty_ids"
    BAD_VIN = "bad_vin"
    BAD_REQUEST_ID = "bad_request_id"
    TOO_MANY_IDS = "too_many_ids"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    BAD_DATA_ID = "bad_data_id"
    BAD_DATA_ENCODING = "bad_data_encoding"
    PUBLISHER_NOT_ALLOWED = "publisher_not_allowed"
    EARLY_TRIGGERS_FULL = "early_triggers_full"
    BAD_BATCH_ID = "bad_batch_id"
    BAD_CORRELATION_ID = "bad_correlation_id"
    #: expires_at is already past: the request would never be sent.
    EXPIRED = "expired"
    BAD_EXPIRES_AT = "bad_expires_at"
    #: await_response asked while response_topic_prefix is empty (responses off).
    RESPONSES_OFF = "responses_off"
    #: A batch's `priority` that is neither "high" nor "normal".
    BAD_PRIORITY = "bad_priority"
    #: A policy message with a field that is unknown, of the wrong type or out of range.
    BAD_POLICY = "bad_policy"
    #: A new request id's policy while max_policies are in force.
    POLICIES_FULL = "policies_full"
    #: A batch of a request whose campaign was aborted (its policy's abort criterion), until a
    #: new policy for the request re-opens it.
    ABORTED = "aborted"


class FanoutError(Exception):
    """Base of every error sdv-fanout raises on purpose."""


class ConfigError(FanoutError):
    """The configuration cannot work; the message says which setting and why."""


class BatchRejected(FanoutError):
    """A batch message that is not stored; nothing of it was written."""

    def __init__(self, reason: Reason, detail: str = "", **fields: object) -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail
        #: Extra structured context for the log line (e.g. the offending VIN); `field` names the
        #: batch field at fault and `vin` the VIN at fault, where there is one: both go into the
        #: `rejected` receipt too.
        self.fields = fields

    @property
    def field(self) -> str | None:
        """The batch field at fault (`ids`, `request_id`, `expires_at`, ...), if one is."""
        value = self.fields.get("field")
        return value if isinstance(value, str) else None

    @property
    def vin(self) -> str | None:
        """The VIN at fault (cut short, control characters escaped), if one is."""
        value = self.fields.get("vin")
        return value if isinstance(value, str) else None
