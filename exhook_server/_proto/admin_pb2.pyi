from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Stats(_message.Message):
    __slots__ = ("rows", "blobs", "blob_bytes", "logical_bytes", "dedup_ratio", "aliases", "early_triggers", "map_size_bytes", "map_used_bytes", "schema_version", "online_vehicles", "in_flight", "dispatch_backlog", "mqtt_connected")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BLOBS_FIELD_NUMBER: _ClassVar[int]
    BLOB_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEDUP_RATIO_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    EARLY_TRIGGERS_FIELD_NUMBER: _ClassVar[int]
    MAP_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAP_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    ONLINE_VEHICLES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_BACKLOG_FIELD_NUMBER: _ClassVar[int]
    MQTT_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    rows: int
    blobs: int
    blob_bytes: int
    logical_bytes: int
    dedup_ratio: float
    aliases: int
    early_triggers: int
    map_size_bytes: int
    map_used_bytes: int
    schema_version: int
    online_vehicles: int
    in_flight: int
    dispatch_backlog: int
    mqtt_connected: bool
    def __init__(self, rows: _Optional[int] = ..., blobs: _Optional[int] = ..., blob_bytes: _Optional[int] = ..., logical_bytes: _Optional[int] = ..., dedup_ratio: _Optional[float] = ..., aliases: _Optional[int] = ..., early_triggers: _Optional[int] = ..., map_size_bytes: _Optional[int] = ..., map_used_bytes: _Optional[int] = ..., schema_version: _Optional[int] = ..., online_vehicles: _Optional[int] = ..., in_flight: _Optional[int] = ..., dispatch_backlog: _Optional[int] = ..., mqtt_connected: _Optional[bool] = ...) -> None: ...

class GetVehicleRequest(_message.Message):
    __slots__ = ("vin", "outcomes_limit")
    VIN_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_LIMIT_FIELD_NUMBER: _ClassVar[int]
    vin: str
    outcomes_limit: int
    def __init__(self, vin: _Optional[str] = ..., outcomes_limit: _Optional[int] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("node", "clientid", "peerhost", "peerport")
    NODE_FIELD_NUMBER: _ClassVar[int]
    CLIENTID_FIELD_NUMBER: _ClassVar[int]
    PEERHOST_FIELD_NUMBER: _ClassVar[int]
    PEERPORT_FIELD_NUMBER: _ClassVar[int]
    node: str
    clientid: str
    peerhost: str
    peerport: int
    def __init__(self, node: _Optional[str] = ..., clientid: _Optional[str] = ..., peerhost: _Optional[str] = ..., peerport: _Optional[int] = ...) -> None: ...

class InFlight(_message.Message):
    __slots__ = ("request_id", "sha1", "session", "age_ms", "acking", "attempts", "await_response", "acked_age_ms", "cancelled")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SHA1_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    AGE_MS_FIELD_NUMBER: _ClassVar[int]
    ACKING_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    AWAIT_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ACKED_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sha1: str
    session: Session
    age_ms: int
    acking: bool
    attempts: int
    await_response: bool
    acked_age_ms: int
    cancelled: bool
    def __init__(self, request_id: _Optional[str] = ..., sha1: _Optional[str] = ..., session: _Optional[_Union[Session, _Mapping]] = ..., age_ms: _Optional[int] = ..., acking: _Optional[bool] = ..., attempts: _Optional[int] = ..., await_response: _Optional[bool] = ..., acked_age_ms: _Optional[int] = ..., cancelled: _Optional[bool] = ...) -> None: ...

class Pending(_message.Message):
    __slots__ = ("request_id", "ts_ms", "sha1", "size", "expires_at_ms", "await_response", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TS_MS_FIELD_NUMBER: _ClassVar[int]
    SHA1_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    AWAIT_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ts_ms: int
    sha1: str
    size: int
    expires_at_ms: int
    await_response: bool
    priority: str
    def __init__(self, request_id: _Optional[str] = ..., ts_ms: _Optional[int] = ..., sha1: _Optional[str] = ..., size: _Optional[int] = ..., expires_at_ms: _Optional[int] = ..., await_response: _Optional[bool] = ..., priority: _Optional[str] = ...) -> None: ...

class Vehicle(_message.Message):
    __slots__ = ("vin", "online", "session", "in_flight", "pending", "worker", "outcomes", "backlog", "at_backlog_bound")
    VIN_FIELD_NUMBER: _ClassVar[int]
    ONLINE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_FIELD_NUMBER: _ClassVar[int]
    AT_BACKLOG_BOUND_FIELD_NUMBER: _ClassVar[int]
    vin: str
    online: bool
    session: Session
    in_flight: InFlight
    pending: _containers.RepeatedCompositeFieldContainer[Pending]
    worker: str
    outcomes: _containers.RepeatedCompositeFieldContainer[Outcome]
    backlog: int
    at_backlog_bound: bool
    def __init__(self, vin: _Optional[str] = ..., online: _Optional[bool] = ..., session: _Optional[_Union[Session, _Mapping]] = ..., in_flight: _Optional[_Union[InFlight, _Mapping]] = ..., pending: _Optional[_Iterable[_Union[Pending, _Mapping]]] = ..., worker: _Optional[str] = ..., outcomes: _Optional[_Iterable[_Union[Outcome, _Mapping]]] = ..., backlog: _Optional[int] = ..., at_backlog_bound: _Optional[bool] = ...) -> None: ...

class Outcome(_message.Message):
    __slots__ = ("request_id", "sha1", "outcome", "ts_ms", "stored_ms", "attempts", "response")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SHA1_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    TS_MS_FIELD_NUMBER: _ClassVar[int]
    STORED_MS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sha1: str
    outcome: str
    ts_ms: int
    stored_ms: int
    attempts: int
    response: bytes
    def __init__(self, request_id: _Optional[str] = ..., sha1: _Optional[str] = ..., outcome: _Optional[str] = ..., ts_ms: _Optional[int] = ..., stored_ms: _Optional[int] = ..., attempts: _Optional[int] = ..., response: _Optional[bytes] = ...) -> None: ...

class ListOnlineRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListOnlineResponse(_message.Message):
    __slots__ = ("vins", "next_page_token", "total")
    VINS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    vins: _containers.RepeatedScalarFieldContainer[str]
    next_page_token: str
    total: int
    def __init__(self, vins: _Optional[_Iterable[str]] = ..., next_page_token: _Optional[str] = ..., total: _Optional[int] = ...) -> None: ...

class TriggerGCRequest(_message.Message):
    __slots__ = ("dry_run",)
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    dry_run: bool
    def __init__(self, dry_run: _Optional[bool] = ...) -> None: ...

class GCReport(_message.Message):
    __slots__ = ("dry_run", "rows_expired", "aliases_expired", "blobs_deleted", "blob_bytes_freed", "blobs_kept_recent", "early_expired", "seconds", "outcomes_expired", "generations_expired", "batch_ids_expired")
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    ROWS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    ALIASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    BLOBS_DELETED_FIELD_NUMBER: _ClassVar[int]
    BLOB_BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    BLOBS_KEPT_RECENT_FIELD_NUMBER: _ClassVar[int]
    EARLY_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    BATCH_IDS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    dry_run: bool
    rows_expired: int
    aliases_expired: int
    blobs_deleted: int
    blob_bytes_freed: int
    blobs_kept_recent: int
    early_expired: int
    seconds: float
    outcomes_expired: int
    generations_expired: int
    batch_ids_expired: int
    def __init__(self, dry_run: _Optional[bool] = ..., rows_expired: _Optional[int] = ..., aliases_expired: _Optional[int] = ..., blobs_deleted: _Optional[int] = ..., blob_bytes_freed: _Optional[int] = ..., blobs_kept_recent: _Optional[int] = ..., early_expired: _Optional[int] = ..., seconds: _Optional[float] = ..., outcomes_expired: _Optional[int] = ..., generations_expired: _Optional[int] = ..., batch_ids_expired: _Optional[int] = ...) -> None: ...

class RequeueRequest(_message.Message):
    __slots__ = ("vin",)
    VIN_FIELD_NUMBER: _ClassVar[int]
    vin: str
    def __init__(self, vin: _Optional[str] = ...) -> None: ...

class RequeueResponse(_message.Message):
    __slots__ = ("was_in_flight", "online")
    WAS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ONLINE_FIELD_NUMBER: _ClassVar[int]
    was_in_flight: bool
    online: bool
    def __init__(self, was_in_flight: _Optional[bool] = ..., online: _Optional[bool] = ...) -> None: ...

class GetRequestRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class Counts(_message.Message):
    __slots__ = ("total", "pending", "delivered", "superseded", "cancelled", "expired", "failed", "responded")
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDED_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    RESPONDED_FIELD_NUMBER: _ClassVar[int]
    total: int
    pending: int
    delivered: int
    superseded: int
    cancelled: int
    expired: int
    failed: int
    responded: int
    def __init__(self, total: _Optional[int] = ..., pending: _Optional[int] = ..., delivered: _Optional[int] = ..., superseded: _Optional[int] = ..., cancelled: _Optional[int] = ..., expired: _Optional[int] = ..., failed: _Optional[int] = ..., responded: _Optional[int] = ...) -> None: ...

class Generation(_message.Message):
    __slots__ = ("request_id", "sha1", "counts", "first_ms", "last_ms", "latency_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SHA1_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    FIRST_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_MS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sha1: str
    counts: Counts
    first_ms: int
    last_ms: int
    latency_ms: Latency
    def __init__(self, request_id: _Optional[str] = ..., sha1: _Optional[str] = ..., counts: _Optional[_Union[Counts, _Mapping]] = ..., first_ms: _Optional[int] = ..., last_ms: _Optional[int] = ..., latency_ms: _Optional[_Union[Latency, _Mapping]] = ...) -> None: ...

class Percentiles(_message.Message):
    __slots__ = ("p50", "p90", "p99")
    P50_FIELD_NUMBER: _ClassVar[int]
    P90_FIELD_NUMBER: _ClassVar[int]
    P99_FIELD_NUMBER: _ClassVar[int]
    p50: int
    p90: int
    p99: int
    def __init__(self, p50: _Optional[int] = ..., p90: _Optional[int] = ..., p99: _Optional[int] = ...) -> None: ...

class Latency(_message.Message):
    __slots__ = ("delivered", "answered")
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_FIELD_NUMBER: _ClassVar[int]
    delivered: Percentiles
    answered: Percentiles
    def __init__(self, delivered: _Optional[_Union[Percentiles, _Mapping]] = ..., answered: _Optional[_Union[Percentiles, _Mapping]] = ...) -> None: ...

class RequestStatus(_message.Message):
    __slots__ = ("request_id", "generations")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    def __init__(self, request_id: _Optional[str] = ..., generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ...) -> None: ...

class ListRequestsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListRequestsResponse(_message.Message):
    __slots__ = ("generations", "next_page_token", "total")
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    next_page_token: str
    total: int
    def __init__(self, generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., total: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id", "vins")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    VINS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    vins: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., vins: _Optional[_Iterable[str]] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled", "in_flight")
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    cancelled: int
    in_flight: int
    def __init__(self, cancelled: _Optional[int] = ..., in_flight: _Optional[int] = ...) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("request_id", "policy")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    policy: str
    def __init__(self, request_id: _Optional[str] = ..., policy: _Optional[str] = ...) -> None: ...

class GetPolicyRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class Policy(_message.Message):
    __slots__ = ("request_id", "policy", "set_ms", "aborted", "pacing")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    SET_MS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    PACING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    policy: str
    set_ms: int
    aborted: str
    pacing: str
    def __init__(self, request_id: _Optional[str] = ..., policy: _Optional[str] = ..., set_ms: _Optional[int] = ..., aborted: _Optional[str] = ..., pacing: _Optional[str] = ...) -> None: ...

class ForecastRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ForecastReply(_message.Message):
    __slots__ = ("request_id", "pending", "online_now", "completes_at_ms", "policy", "set_ms", "now_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    ONLINE_NOW_FIELD_NUMBER: _ClassVar[int]
    COMPLETES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    SET_MS_FIELD_NUMBER: _ClassVar[int]
    NOW_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    pending: int
    online_now: int
    completes_at_ms: int
    policy: str
    set_ms: int
    now_ms: int
    def __init__(self, request_id: _Optional[str] = ..., pending: _Optional[int] = ..., online_now: _Optional[int] = ..., completes_at_ms: _Optional[int] = ..., policy: _Optional[str] = ..., set_ms: _Optional[int] = ..., now_ms: _Optional[int] = ...) -> None: ...
