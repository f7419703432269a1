"""structlog set-up: readable console lines for people, one JSON object per line for machines.

Events have stable snake_case names (`batch_stored`, `batch_rejected`, ...) and
carry their context as fields (`vin`, `request_id`, `reason`), never inside the
event name.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import orjson
import structlog

#: Whether debug events are rendered: `configure` sets it (structlog unconfigured renders every
#: level). A per-delivery debug event tests it first: a filtered call still costs a logger lookup.
debug_enabled = True


def _json_dumps(obj: object, default: object = None) -> str:
    return orjson.dumps(obj, default=default).decode()  # type: ignore[arg-type]


def configure(fmt: str = "console", level: str = "info", stream: TextIO | None = None, *, cache: bool = True) -> None:
    """Route every structlog event through one renderer, at `level` and above.

    `cache=False` keeps loggers re-configurable, which `structlog.testing.capture_logs` needs.
    """
    global debug_enabled
    threshold = logging.getLevelNamesMapping()[level.upper()]
    debug_enabled = threshold <= logging.DEBUG
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer(serializer=_json_dumps)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        # One write() per event (print() makes two): the processes of a group share stderr, and
        # their lines must not interleave.
        logger_factory=structlog.WriteLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=cache,
    )
