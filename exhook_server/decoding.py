"""From the bytes of an ExHook call to its request message, or a `Malformed` with a defined answer.

gRPC runs a method's request deserializer before any handler; an exception raised there
becomes status UNKNOWN, reported only through grpc's stdlib logger, outside our structured
log and metrics. So the deserializers here never raise: bytes
that are not a valid message (garbage, invalid UTF-8 in a string field) become `Malformed`,
which every hook answers INVALID_ARGUMENT, logged (`call_malformed`) and counted. A large
OnMessagePublish that cannot fit the ingest budget becomes `Overloaded` without being parsed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
import structlog
from google.protobuf.message import DecodeError

from exhook_server import metrics

log = structlog.get_logger("sdv_fanout.decoding")


@dataclass(frozen=True, slots=True)
class Malformed:
    """A call whose request bytes did not parse as the method's request message."""

    message_type: str
    size: int
    detail: str


@dataclass(frozen=True, slots=True)
class Overloaded:
    """A large call turned away before parsing: its bytes alone do not fit the ingest budget now."""

    size: int


#: Below this a message is parsed whatever the budget says: heartbeats and small batches are cheap.
EARLY_REFUSAL_MIN_BYTES = 64 << 10


def deserializer(request_cls: Any, fits: Callable[[int], bool] | None = None) -> Callable[[bytes], Any]:
    """`request_cls.FromString` that returns a `Malformed` instead of raising; with `fits`, an
    `Overloaded` for a large message that `fits` says cannot be admitted now."""
    parse = request_cls.FromString
    name = request_cls.DESCRIPTOR.full_name

    def deserialize(raw: bytes) -> Any:
        if fits is not None and len(raw) >= EARLY_REFUSAL_MIN_BYTES and not fits(len(raw)):
            return Overloaded(len(raw))
        try:
            return parse(raw)
        except DecodeError as exc:
            return Malformed(name, len(raw), str(exc))

    return deserialize


async def refuse(hook: str, request: Malformed, context: grpc.aio.ServicerContext) -> NoReturn:
    """Answer a malformed call INVALID_ARGUMENT with the parser's reason; logs and counts it."""
    metrics.MALFORMED_CALLS.labels(hook).inc()
    log.warning(
        "call_malformed", hook=hook, message_type=request.message_type, size=request.size, detail=request.detail
    )
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {request.message_type}: {request.detail}")
    raise AssertionError("unreachable: abort raises")
