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
    __slots__ = ("vin",)
    VIN_FIELD_NUMBER: _ClassVar[int]
    vin: str
    def __init__(self, vin: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("request_id", "sha1", "session", "age_ms", "acking")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SHA1_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    AGE_MS_FIELD_NUMBER: _ClassVar[int]
    ACKING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sha1: str
    session: Session
    age_ms: int
    acking: bool
    def __init__(self, request_id: _Optional[str] = ..., sha1: _Optional[str] = ..., session: _Optional[_Union[Session, _Mapping]] = ..., age_ms: _Optional[int] = ..., acking: _Optional[bool] = ...) -> None: ...

class Pending(_message.Message):
    __slots__ = ("request_id", "ts_ms", "sha1", "size")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TS_MS_FIELD_NUMBER: _ClassVar[int]
    SHA1_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ts_ms: int
    sha1: str
    size: int
    def __init__(self, request_id: _Optional[str] = ..., ts_ms: _Optional[int] = ..., sha1: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class Vehicle(_message.Message):
    __slots__ = ("vin", "online", "session", "in_flight", "pending", "worker")
    VIN_FIELD_NUMBER: _ClassVar[int]
    ONLINE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    vin: str
    online: bool
    session: Session
    in_flight: InFlight
    pending: _containers.RepeatedCompositeFieldContainer[Pending]
    worker: str
    def __init__(self, vin: _Optional[str] = ..., online: _Optional[bool] = ..., session: _Optional[_Union[Session, _Mapping]] = ..., in_flight: _Optional[_Union[InFlight, _Mapping]] = ..., pending: _Optional[_Iterable[_Union[Pending, _Mapping]]] = ..., worker: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("dry_run", "rows_expired", "aliases_expired", "blobs_deleted", "blob_bytes_freed", "blobs_kept_recent", "early_expired", "seconds")
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    ROWS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    ALIASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    BLOBS_DELETED_FIELD_NUMBER: _ClassVar[int]
    BLOB_BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    BLOBS_KEPT_RECENT_FIELD_NUMBER: _ClassVar[int]
    EARLY_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    dry_run: bool
    rows_expired: int
    aliases_expired: int
    blobs_deleted: int
    blob_bytes_freed: int
    blobs_kept_recent: int
    early_expired: int
    seconds: float
    def __init__(self, dry_run: _Optional[bool] = ..., rows_expired: _Optional[int] = ..., aliases_expired: _Optional[int] = ..., blobs_deleted: _Optional[int] = ..., blob_bytes_freed: _Optional[int] = ..., blobs_kept_recent: _Optional[int] = ..., early_expired: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

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
