"""Byte layout of every LMDB key and value; the only place that knows it.

Keys sort the way the code walks them: a vehicle's rows are one prefix range,
the expiry index is in time order, early triggers group by data_id. Integers
are big-endian so that byte order is numeric order.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from collections.abc import Set as AbstractSet

from storage.model import COUNT_NAMES as COUNT_NAMES
from storage.model import FLAG_AWAIT_RESPONSE as FLAG_AWAIT_RESPONSE
from storage.model import FLAG_HIGH_PRIORITY as FLAG_HIGH_PRIORITY
from storage.model import Row as Row
from storage.model import delivery_order, generation_key

SEP = b"\x00"

#: ids value: row timestamp (ms), blob sha1, blob size in bytes ...
_ROW = struct.Struct(">Q20sI")
#: ... then, only for a row with an expiry or flags (schema 3): expires_at (ms, 0 = never), flags.
_ROW_EXT = struct.Struct(">Q20sIQB")
#: data value prefix: the blob's creation timestamp (ms); the blob bytes follow.
_BLOB_HEAD = struct.Struct(">Q")
#: aliases value: sha1, then the time the alias was (re)written (ms).
_ALIAS = struct.Struct(">20sQ")
_U64 = struct.Struct(">Q")
#: `tries` value (schema 4): the row's sha1 and how often it has been published; then (schema 8)
#: when it was first and last published (epoch ms; a value written before has neither: 0).
_TRIES = struct.Struct(">20sH")
_TRIES_SENT = struct.Struct(">20sHQQ")
#: `awaited` value (schema 4): sha1, attempts, when the vehicle PUBACKed it (ms); the session
#: that took it follows (node, clientid, host, port joined by `_SESSION_SEP`).
_AWAITED = struct.Struct(">20sHQ")
_SESSION_SEP = "\x1f"

BLOB_HEAD_SIZE = _BLOB_HEAD.size
#: `meta` key: batches that stored high-priority rows so far (u64), see `Store.high_rows_stored`.
HIGH_ROWS_STORED = b"high_rows_stored"


def row_key(vin: str, request_id: str) -> bytes:
    """`ids` key. VINs and request ids never contain NUL (validated), so the split is unique."""
    return vin.encode() + SEP + request_id.encode()


def vin_prefix(vin: str) -> bytes:
    """The range of `ids` keys that belong to one vehicle."""
    return vin.encode() + SEP


def decode_row(key: bytes | memoryview, value: bytes | memoryview) -> Row:
    """Turn an `ids` entry back into a Row."""
    vin, _, rid = bytes(key).partition(SEP)
    if len(value) == _ROW.size:
        ts_ms, sha1, size = _ROW.unpack(value)
        return Row(vin.decode(), rid.decode(), ts_ms, sha1, size)
    ts_ms, sha1, size, expires_ms, flags = _ROW_EXT.unpack(value)
    return Row(vin.decode(), rid.decode(), ts_ms, sha1, size, expires_ms, flags)


def row_value(ts_ms: int, sha1: bytes, size: int, expires_ms: int = 0, flags: int = 0) -> bytes:
    """The short form for a plain row (most of them), the long one with an expiry or flags."""
    if expires_ms or flags:
        return _ROW_EXT.pack(ts_ms, sha1, size, expires_ms, flags)
    return _ROW.pack(ts_ms, sha1, size)


def encoded_row(row: Row) -> bytes:
    return row_value(row.ts_ms, row.sha1, row.size, row.expires_ms, row.flags)


def row_expires(value: bytes | memoryview) -> int:
    """A row value's expires_at (ms, 0 = never) without decoding the rest."""
    return 0 if len(value) == _ROW.size else int(_U64.unpack(value[32:40])[0])


def row_awaits(value: bytes | memoryview) -> bool:
    """Whether a row value has FLAG_AWAIT_RESPONSE, without decoding the rest."""
    return len(value) != _ROW.size and bool(value[_ROW_EXT.size - 1] & FLAG_AWAIT_RESPONSE)


def row_high(value: bytes | memoryview) -> bool:
    """Whether a row value has FLAG_HIGH_PRIORITY, without decoding the rest."""
    return len(value) != _ROW.size and bool(value[_ROW_EXT.size - 1] & FLAG_HIGH_PRIORITY)


def row_order(
    request_id: bytes, value: bytes | memoryview, high: AbstractSet[bytes] | None = None
) -> tuple[bytes, bytes]:
    """A row's place in delivery order (`storage.model.delivery_order`) without decoding it: high
    priority by its flag, or its request id in `high`."""
    return delivery_order(row_high(value) or bool(high and request_id in high), bytes(value[:8]), request_id)


def row_sha1(value: bytes | memoryview) -> bytes:
    return bytes(value[8:28])


def row_ts(value: bytes | memoryview) -> int:
    return int(_U64.unpack(value[:8])[0])


def row_keys(vins: Iterable[str], request_id: str) -> list[bytes]:
    """`ids` keys of many VINs for one request id (the batch path builds 200 at a time)."""
    tail = SEP + request_id.encode()
    return [vin.encode() + tail for vin in vins]


def expiry_entries(ts_ms: int, rkeys: Iterable[bytes]) -> list[tuple[bytes, bytes]]:
    """`expiry` (key, empty value) pairs of rows written at `ts_ms`, in `rkeys` order."""
    head = _U64.pack(ts_ms)
    return [(head + rkey, b"") for rkey in rkeys]


def expiry_key(ts_ms: int, rkey: bytes) -> bytes:
    """`expiry` key: the row's timestamp, then its `ids` key; walks rows oldest first."""
    return _U64.pack(ts_ms) + rkey


def blob_value(ts_ms: int, blob: bytes) -> bytes:
    return _BLOB_HEAD.pack(ts_ms) + blob


def blob_ts(value: bytes | memoryview) -> int:
    return int(_BLOB_HEAD.unpack_from(value)[0])


def alias_value(sha1: bytes, ts_ms: int) -> bytes:
    return _ALIAS.pack(sha1, ts_ms)


def decode_alias(value: bytes | memoryview) -> tuple[bytes, int]:
    sha1, ts_ms = _ALIAS.unpack(value)
    return sha1, ts_ms


def deadline_key(expires_ms: int, vin: str, request_id: str) -> bytes:
    """`deadlines` key: the row's expires_at, so the sweep walks rows in the order they expire
    and stops at the first one still valid; then request id and VIN (not VIN first), so the rows
    of one batch sit side by side even when many batches share one expires_at (VIN first
    scattered them over the index: ingest cost 31 % more CPU per row, bench/lifecycle.py)."""
    return _U64.pack(expires_ms) + request_id.encode() + SEP + vin.encode()


def deadline_entries(expires_ms: int, request_id: str, vins: Iterable[str]) -> list[tuple[bytes, bytes]]:
    """`deadlines` (key, empty value) pairs of one batch's rows (VINs sorted: keys sorted)."""
    head = _U64.pack(expires_ms) + request_id.encode() + SEP
    return [(head + vin.encode(), b"") for vin in vins]


def split_deadline_key(key: bytes) -> tuple[int, bytes]:
    """(expires_at ms, `ids` key of its row)."""
    rid, _, vin = key[8:].partition(SEP)
    return decode_u64(key[:8]), vin + SEP + rid


def request_index_entries(request_id: str, vins: Iterable[str]) -> list[tuple[bytes, bytes]]:
    """`by_request` (key, empty value) pairs: a request id's pending VINs are one prefix range,
    so cancelling a request for every vehicle costs O(its rows), not a scan of all rows."""
    head = request_id.encode() + SEP
    return [(head + vin.encode(), b"") for vin in vins]


def request_index_key(vin: str, request_id: str) -> bytes:
    return request_id.encode() + SEP + vin.encode()


def split_rkey(rkey: bytes) -> tuple[str, str]:
    vin, _, rid = rkey.partition(SEP)
    return vin.decode(), rid.decode()


def early_prefix(data_id: str) -> bytes:
    return data_id.encode() + SEP


def early_key(data_id: str, seq: int) -> bytes:
    """`early` key: triggers waiting for one data_id, in arrival order."""
    return early_prefix(data_id) + _U64.pack(seq)


def early_data_id(key: bytes) -> str:
    return bytes(key[:-9]).decode()


def encode_u64(value: int) -> bytes:
    return _U64.pack(value)


def decode_u64(value: bytes | memoryview) -> int:
    return int(_U64.unpack(value)[0])


# -- outcomes and generations (what the platform gets back) -------------------------------------
#: A generation is one (request_id, blob sha1): request ids are reused, so counts are kept per
#: generation. `gens` value: first and last change (ms), then the counts in `COUNT_NAMES` order.
_GEN = struct.Struct(">QQ8Q")
#: Schema 2 kept no `responded` count.
_GEN_2 = struct.Struct(">QQ7Q")
#: `outcomes` value: when it ended and when its row was stored (ms), delivery attempts, outcome
#: code; then (schema 9) when its row was first published (ms), only when known, which the code's
#: `_SENT` bit says; the vehicle's answer (its first max_response_bytes) follows for `responded`.
_OUTCOME = struct.Struct(">QQHB")
_SENT = 0x80


#: `gens` key: a request id's generations are one prefix range.
gen_key = generation_key


def gen_prefix(request_id: str) -> bytes:
    return request_id.encode() + SEP


def split_gen_key(key: bytes | memoryview) -> tuple[str, bytes]:
    raw = bytes(key)
    return raw[:-21].decode(), raw[-20:]


def gen_value(first_ms: int, last_ms: int, counts: Iterable[int]) -> bytes:
    return _GEN.pack(first_ms, last_ms, *counts)


def decode_gen(value: bytes | memoryview) -> tuple[int, int, list[int]]:
    if len(value) == _GEN_2.size:
        first_ms, last_ms, *counts = _GEN_2.unpack(value)
        return first_ms, last_ms, [*counts, 0]
    first_ms, last_ms, *counts = _GEN.unpack(value)
    return first_ms, last_ms, counts


def outcome_key(vin: str, request_id: str, sha1: bytes) -> bytes:
    """`outcomes` key: one per (VIN, generation), the row key and the sha1; a vehicle's
    outcomes are one prefix range."""
    return row_key(vin, request_id) + SEP + sha1


def split_outcome_key(key: bytes | memoryview) -> tuple[str, str, bytes]:
    raw = bytes(key)
    vin, _, rid = raw[:-21].partition(SEP)
    return vin.decode(), rid.decode(), raw[-20:]


def outcome_value(
    ts_ms: int, stored_ms: int, attempts: int, code: int, response: bytes = b"", sent_ms: int = 0
) -> bytes:
    """`sent_ms`: when the row was first published (0: never, or not known)."""
    if not sent_ms:
        return _OUTCOME.pack(ts_ms, stored_ms, min(attempts, 0xFFFF), code) + response
    return _OUTCOME.pack(ts_ms, stored_ms, min(attempts, 0xFFFF), code | _SENT) + _U64.pack(sent_ms) + response


def decode_outcome(value: bytes | memoryview) -> tuple[int, int, int, int]:
    """(ended ms, stored ms, attempts, outcome code)."""
    ts_ms, stored_ms, attempts, code = _OUTCOME.unpack_from(value)
    return ts_ms, stored_ms, attempts, code & ~_SENT


def outcome_sent(value: bytes | memoryview) -> int:
    """When the pair's row was first published (ms); 0: never, or not known."""
    if not value[_OUTCOME.size - 1] & _SENT:
        return 0
    return int(_U64.unpack_from(value, _OUTCOME.size)[0])


def outcome_response(value: bytes | memoryview) -> bytes:
    """The stored answer of a `responded` outcome (empty for the others)."""
    start = _OUTCOME.size + (_U64.size if value[_OUTCOME.size - 1] & _SENT else 0)
    return bytes(value[start:])


def timed_key(ts_ms: int, key: bytes) -> bytes:
    """A time index entry (`outcome_expiry`, `batch_expiry`): walks oldest first, like `expiry`."""
    return _U64.pack(ts_ms) + key


# -- delivery attempts (schema 4) ----------------------------------------------------------------
#: Both tables are keyed by the row's `ids` key; an entry counts only while its sha1 is the row's.


def tries_value(sha1: bytes, attempts: int, first_ms: int, last_ms: int) -> bytes:
    return _TRIES_SENT.pack(sha1, min(attempts, 0xFFFF), first_ms, last_ms)


def decode_tries(value: bytes | memoryview) -> tuple[bytes, int, int, int]:
    """(sha1, attempts, first published at ms, last published at ms; both 0 when not kept)."""
    if len(value) == _TRIES.size:
        sha1, attempts = _TRIES.unpack(value)
        return sha1, attempts, 0, 0
    sha1, attempts, first_ms, last_ms = _TRIES_SENT.unpack(value)
    return sha1, attempts, first_ms, last_ms


def awaited_value(sha1: bytes, attempts: int, acked_ms: int, session: tuple[str, str, str, int]) -> bytes:
    node, clientid, host, port = session
    return (
        _AWAITED.pack(sha1, min(attempts, 0xFFFF), acked_ms)
        + _SESSION_SEP.join((node, clientid, host, str(port))).encode()
    )


def decode_awaited(value: bytes | memoryview) -> tuple[bytes, int, int, tuple[str, str, str, int]]:
    """(sha1, attempts, PUBACKed at ms, (node, clientid, host, port) of the session that took it)."""
    sha1, attempts, acked_ms = _AWAITED.unpack_from(value)
    node, clientid, host, port = bytes(value[_AWAITED.size :]).decode().split(_SESSION_SEP)
    return sha1, attempts, acked_ms, (node, clientid, host, int(port))
