"""A tiny, hand-written protobuf wire codec for the ExHook messages.

Written from the message definitions of proto/exhook_v3.proto (v2: the same less a few fields) only:
it never imports the server's generated modules or google.protobuf, so the
wire-conformance tests act as an independent client of the server.

Raw level:   encode([(field_number, wire_type, value), ...]) -> bytes
             decode(bytes) -> {field_number: [value, ...]}   (ints or bytes)
Schema level: encode_message("ClientInfo", {"clientid": "c1", ...}, package="v3")
              decode_message("Message", data) -> {"topic": "t/1", ...}
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import Any

# -- wire types ----------------------------------------------------------------
VARINT = 0
I64 = 1
LEN = 2
I32 = 5

_MASK64 = (1 << 64) - 1


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message."""


def encode_varint(value: int) -> bytes:
    """Base-128 varint; negative numbers as 64-bit two's complement (10 bytes), as int64 does."""
    if value < 0:
        value &= _MASK64
    if value > _MASK64:
        raise WireError(f"varint out of range: {value}")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def decode_varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, next position); at most 10 bytes."""
    result = 0
    for shift in range(0, 70, 7):
        if pos >= len(data):
            raise WireError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result & _MASK64, pos
    raise WireError("varint longer than 10 bytes")


def tag(field_number: int, wire_type: int) -> bytes:
    if not 1 <= field_number < (1 << 29):
        raise WireError(f"bad field number {field_number}")
    return encode_varint((field_number << 3) | wire_type)


def encode_field(field_number: int, wire_type: int, value: Any) -> bytes:
    """One field: tag + payload. LEN takes bytes or str (UTF-8 encoded)."""
    if wire_type == VARINT:
        if isinstance(value, bool):
            value = int(value)
        return tag(field_number, VARINT) + encode_varint(value)
    if wire_type == LEN:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        return tag(field_number, LEN) + encode_varint(len(raw)) + raw
    if wire_type == I64:
        return tag(field_number, I64) + struct.pack("<Q", value & _MASK64)
    if wire_type == I32:
        return tag(field_number, I32) + struct.pack("<I", value & 0xFFFFFFFF)
    raise WireError(f"unsupported wire type {wire_type}")


def encode(fields: Iterable[tuple[int, int, Any]]) -> bytes:
    """Concatenate (field_number, wire_type, value) triples, in the order given."""
    return b"".join(encode_field(n, wt, v) for n, wt, v in fields)


def decode(data: bytes) -> dict[int, list[Any]]:
    """{field_number: [values]}: ints for VARINT/I64/I32, bytes for LEN. Strict: rejects garbage."""
    out: dict[int, list[Any]] = {}
    pos = 0
    data = bytes(data)
    while pos < len(data):
        key, pos = decode_varint(data, pos)
        field_number, wire_type = key >> 3, key & 7
        if field_number == 0:
            raise WireError("field number 0")
        value: Any
        if wire_type == VARINT:
            value, pos = decode_varint(data, pos)
        elif wire_type == LEN:
            size, pos = decode_varint(data, pos)
            if pos + size > len(data):
                raise WireError("truncated length-delimited field")
            value, pos = data[pos : pos + size], pos + size
        elif wire_type == I64:
            if pos + 8 > len(data):
                raise WireError("truncated fixed64")
            (value,), pos = struct.unpack_from("<Q", data, pos), pos + 8
        elif wire_type == I32:
            if pos + 4 > len(data):
                raise WireError("truncated fixed32")
            (value,), pos = struct.unpack_from("<I", data, pos), pos + 4
        else:
            raise WireError(f"unsupported wire type {wire_type} (field {field_number})")
        out.setdefault(field_number, []).append(value)
    return out


# -- schema, transcribed from the doc tables (1.3 requests, 1.4 responses, 1.5 basic types) --
# A field type is a scalar name, a message name, ("repeated", type) or ("map", key, value).
Schema = dict[str, dict[str, tuple[int, Any]]]

_REP_PROP = ("repeated", "Property")

SCHEMA: Schema = {
    # 1.3 requests
    "ProviderLoadedRequest": {"broker": (1, "BrokerInfo"), "meta": (2, "RequestMeta")},
    "ProviderUnloadedRequest": {"meta": (1, "RequestMeta")},
    "ClientConnectRequest": {
        "conninfo": (1, "ConnInfo"),
        "props": (2, _REP_PROP),
        "meta": (3, "RequestMeta"),
        "user_props": (4, _REP_PROP),
    },
    "ClientConnackRequest": {
        "conninfo": (1, "ConnInfo"),
        "result_code": (2, "string"),
        "props": (3, _REP_PROP),
        "meta": (4, "RequestMeta"),
        "user_props": (5, _REP_PROP),
    },
    "ClientConnectedRequest": {"clientinfo": (1, "ClientInfo"), "meta": (2, "RequestMeta")},
    "ClientDisconnectedRequest": {
        "clientinfo": (1, "ClientInfo"),
        "reason": (2, "string"),
        "meta": (3, "RequestMeta"),
    },
    "ClientAuthenticateRequest": {
        "clientinfo": (1, "ClientInfo"),
        "result": (2, "bool"),
        "meta": (3, "RequestMeta"),
    },
    "ClientAuthorizeRequest": {
        "clientinfo": (1, "ClientInfo"),
        "type": (2, "enum"),
        "topic": (3, "string"),
        "result": (4, "bool"),
        "meta": (5, "RequestMeta"),
    },
    "ClientSubscribeRequest": {
        "clientinfo": (1, "ClientInfo"),
        "props": (2, _REP_PROP),
        "topic_filters": (3, ("repeated", "TopicFilter")),
        "meta": (4, "RequestMeta"),
        "user_props": (5, _REP_PROP),
    },
    "ClientUnsubscribeRequest": {
        "clientinfo": (1, "ClientInfo"),
        "props": (2, _REP_PROP),
        "topic_filters": (3, ("repeated", "TopicFilter")),
        "meta": (4, "RequestMeta"),
        "user_props": (5, _REP_PROP),
    },
    "SessionCreatedRequest": {"clientinfo": (1, "ClientInfo"), "meta": (2, "RequestMeta")},
    "SessionSubscribedRequest": {
        "clientinfo": (1, "ClientInfo"),
        "topic": (2, "string"),
        "subopts": (3, "SubOpts"),
        "meta": (4, "RequestMeta"),
    },
    "SessionUnsubscribedRequest": {
        "clientinfo": (1, "ClientInfo"),
        "topic": (2, "string"),
        "meta": (3, "RequestMeta"),
    },
    "SessionResumedRequest": {"clientinfo": (1, "ClientInfo"), "meta": (2, "RequestMeta")},
    "SessionDiscardedRequest": {"clientinfo": (1, "ClientInfo"), "meta": (2, "RequestMeta")},
    "SessionTakenoverRequest": {"clientinfo": (1, "ClientInfo"), "meta": (2, "RequestMeta")},
    "SessionTerminatedRequest": {
        "clientinfo": (1, "ClientInfo"),
        "reason": (2, "string"),
        "meta": (3, "RequestMeta"),
    },
    "MessagePublishRequest": {
        "message": (1, "Message"),
        "meta": (2, "RequestMeta"),
        "props": (3, _REP_PROP),
        "user_props": (4, _REP_PROP),
    },
    "MessageDeliveredRequest": {
        "clientinfo": (1, "ClientInfo"),
        "message": (2, "Message"),
        "meta": (3, "RequestMeta"),
    },
    "MessageDroppedRequest": {"message": (1, "Message"), "reason": (2, "string"), "meta": (3, "RequestMeta")},
    "MessageAckedRequest": {
        "clientinfo": (1, "ClientInfo"),
        "message": (2, "Message"),
        "meta": (3, "RequestMeta"),
    },
    # 1.4 responses
    "LoadedResponse": {"hooks": (1, ("repeated", "HookSpec"))},
    "ValuedResponse": {"type": (1, "enum"), "bool_result": (3, "bool"), "message": (4, "Message")},
    "EmptySuccess": {},
    # 1.5 basic types
    "BrokerInfo": {
        "version": (1, "string"),
        "sysdescr": (2, "string"),
        "uptime": (3, "int64"),
        "datetime": (4, "string"),
    },
    "HookSpec": {"name": (1, "string"), "topics": (2, ("repeated", "string"))},
    "ConnInfo": {
        "node": (1, "string"),
        "clientid": (2, "string"),
        "username": (3, "string"),
        "peerhost": (4, "string"),
        "sockport": (5, "uint32"),
        "proto_name": (6, "string"),
        "proto_ver": (7, "string"),
        "keepalive": (8, "uint32"),
        "peerport": (9, "uint32"),
    },
    "ClientInfo": {
        "node": (1, "string"),
        "clientid": (2, "string"),
        "username": (3, "string"),
        "password": (4, "string"),
        "peerhost": (5, "string"),
        "sockport": (6, "uint32"),
        "protocol": (7, "string"),
        "mountpoint": (8, "string"),
        "is_superuser": (9, "bool"),
        "anonymous": (10, "bool"),
        "cn": (11, "string"),
        "dn": (12, "string"),
        "peerport": (13, "uint32"),
    },
    "Message": {
        "node": (1, "string"),
        "id": (2, "string"),
        "qos": (3, "uint32"),
        "from": (4, "string"),
        "topic": (5, "string"),
        "payload": (6, "bytes"),
        "timestamp": (7, "uint64"),
        "headers": (8, ("map", "string", "string")),
    },
    "Property": {"name": (1, "string"), "value": (2, "string")},
    "TopicFilter": {"name": (1, "string"), "subopts": (3, "SubOpts")},
    "SubOpts": {"qos": (1, "uint32"), "rh": (3, "uint32"), "rap": (4, "uint32"), "nl": (5, "uint32")},
    "RequestMeta": {
        "node": (1, "string"),
        "version": (2, "string"),
        "sysdescr": (3, "string"),
        "cluster_name": (4, "string"),
    },
}

#: Fields marked "(v3 only)" in table 1.3: never sent to an emqx.exhook.v2 service.
V3_ONLY: frozenset[tuple[str, str]] = frozenset(
    {
        ("ClientConnectRequest", "user_props"),
        ("ClientConnackRequest", "user_props"),
        ("ClientSubscribeRequest", "user_props"),
        ("ClientUnsubscribeRequest", "user_props"),
        ("MessagePublishRequest", "props"),
        ("MessagePublishRequest", "user_props"),
    }
)

_VARINT_SCALARS = frozenset({"bool", "enum", "uint32", "uint64", "int64"})
_LEN_SCALARS = frozenset({"string", "bytes"})


def _encode_value(field_number: int, ftype: Any, value: Any, package: str) -> bytes:
    if ftype in _VARINT_SCALARS:
        return encode_field(field_number, VARINT, value)
    if ftype in _LEN_SCALARS:
        # str is UTF-8 encoded; bytes go as given, so tests can send invalid UTF-8 in a string field.
        return encode_field(field_number, LEN, value)
    if isinstance(ftype, str):  # a message type; pre-encoded bytes are passed through
        body = value if isinstance(value, bytes | bytearray) else encode_message(ftype, value, package=package)
        return encode_field(field_number, LEN, body)
    kind = ftype[0]
    if kind == "repeated":
        return b"".join(_encode_value(field_number, ftype[1], item, package) for item in value)
    if kind == "map":
        # A map<K, V> is a repeated entry message {key = 1, value = 2}.
        _, ktype, vtype = ftype
        return b"".join(
            encode_field(field_number, LEN, _encode_value(1, ktype, k, package) + _encode_value(2, vtype, v, package))
            for k, v in value.items()
        )
    raise WireError(f"unknown field type {ftype!r}")


def encode_message(name: str, values: Mapping[str, Any], *, package: str = "v3") -> bytes:
    """Encode `values` (field name -> value) as message `name`, fields in field-number order."""
    schema = SCHEMA[name]
    unknown = set(values) - set(schema)
    if unknown:
        raise WireError(f"{name} has no field(s) {sorted(unknown)}")
    out = bytearray()
    for fname, (number, ftype) in sorted(schema.items(), key=lambda item: item[1][0]):
        if fname not in values:
            continue
        if package == "v2" and (name, fname) in V3_ONLY:
            raise WireError(f"{name}.{fname} does not exist in emqx.exhook.v2")
        out += _encode_value(number, ftype, values[fname], package)
    return bytes(out)


def _decode_value(ftype: Any, raw: Any) -> Any:
    if ftype == "bool":
        return bool(raw)
    if ftype in _VARINT_SCALARS:
        if ftype == "int64" and raw >= 1 << 63:
            return raw - (1 << 64)
        return raw
    if ftype == "string":
        return raw.decode("utf-8")
    if ftype == "bytes":
        return raw
    if isinstance(ftype, str):
        return decode_message(ftype, raw)
    raise WireError(f"cannot decode a single {ftype!r}")


def decode_message(name: str, data: bytes) -> dict[str, Any]:
    """Decode message `name` into {field name: value}; unknown field numbers go under their int key."""
    schema = SCHEMA[name]
    by_number = {number: (fname, ftype) for fname, (number, ftype) in schema.items()}
    out: dict[Any, Any] = {}
    for number, raws in decode(data).items():
        if number not in by_number:
            out[number] = raws
            continue
        fname, ftype = by_number[number]
        if isinstance(ftype, tuple) and ftype[0] == "repeated":
            out[fname] = [_decode_value(ftype[1], raw) for raw in raws]
        elif isinstance(ftype, tuple) and ftype[0] == "map":
            _, ktype, vtype = ftype
            entries = {}
            for raw in raws:
                entry = decode(raw)
                key = _decode_value(ktype, entry[1][-1]) if 1 in entry else _decode_value(ktype, b"")
                entries[key] = _decode_value(vtype, entry[2][-1]) if 2 in entry else _decode_value(vtype, b"")
            out[fname] = entries
        else:
            # Singular: the last occurrence wins (the server never splits one message field in parts).
            out[fname] = _decode_value(ftype, raws[-1])
    return out
