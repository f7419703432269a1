"""`sdv-fanout stats|inspect|request|requests|gc run` print the same from either store: the LMDB
data dir (`--data-dir`) or PostgreSQL (`--store-url`), both read through the `Reads` port.

The store is filled through its ports (the engines of test_store_parity_reads.py) and closed, then
the command runs in this process, as `main` with its arguments, its stdout captured.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from exhook_server.cli import main
from storage.lmdb.batches import sha1_of as sha1
from storage.lmdb.outcomes import Outcome
from tests.unit.test_store_parity_reads import Engine, Opener, lmdb_engine, pg_engine

#: A store to fill, and the flags that point the CLI at it.
Where = tuple[Opener, list[str]]


@pytest.fixture
def where(request: pytest.FixtureRequest, each_store: str, tmp_path: Path) -> Where:
    """Each store in turn, empty, and the CLI's flags for it."""
    if each_store == "lmdb":
        return (lambda: lmdb_engine(tmp_path / "lmdb")), ["--data-dir", str(tmp_path / "lmdb")]
    dsn: str = request.getfixturevalue("pg_dsn")
    return (lambda: pg_engine(dsn)), ["--store-url", dsn]


def fill(where: Where) -> None:
    """Two generations of one request (one delivered to V1), another request on V1, all at 1970 times."""

    async def go() -> None:
        async with where[0]() as e:
            await _fill(e)

    asyncio.run(go())


async def _fill(e: Engine) -> None:
    await e.writes.store_batch(["V1", "V2"], "task_x", b"x1", 1_000)
    await e.writes.store_batch(["V1"], "task_x", b"x2", 1_100)
    assert await e.ack("V1", "task_x", sha1(b"x2"), 1_200, Outcome.DELIVERED, 1)
    await e.writes.store_batch(["V1"], "task_y", b"y", 1_300)


Cli = Callable[..., tuple[int, Any]]


@pytest.fixture
def cli(where: Where, capsys: pytest.CaptureFixture[str]) -> Cli:
    """cli(command, *args): the exit status and the --json output of `sdv-fanout command` on the store."""

    def call(command: str, *args: str) -> tuple[int, Any]:
        status = main([command, *args, *where[1], "--json"])
        out = capsys.readouterr().out
        return status, json.loads(out) if out else None

    return call


def test_stats_inspect_request_and_requests_read_either_store(where: Where, cli: Cli) -> None:
    """The read commands answer from the store the flags name, the same numbers on both."""
    fill(where)
    status, stats = cli("stats")
    assert status == 0 and (stats["rows"], stats["blobs"], stats["logical_bytes"]) == (2, 3, 3)
    status, vehicle = cli("inspect", "V1")
    assert status == 0 and [p["request_id"] for p in vehicle["pending"]] == ["task_y"]
    assert [(o["request_id"], o["outcome"]) for o in vehicle["outcomes"]] == [
        ("task_x", "delivered"),
        ("task_x", "superseded"),
    ]
    status, request = cli("request", "task_x")
    assert status == 0 and [g["sha1"] for g in request["generations"]] == [sha1(b"x2").hex(), sha1(b"x1").hex()]
    assert cli("request", "task_never_1") == (1, None)
    status, listed = cli("requests", "--limit", "2")
    assert status == 0 and listed["total"] == 3
    assert [(g["request_id"], g["last_ms"]) for g in listed["generations"]] == [("task_y", 1_300), ("task_x", 1_200)]


def test_gc_run_collects_either_store(where: Where, cli: Cli) -> None:
    """`gc run --dry-run` counts and keeps; `gc run` expires the rows past retention (1970 rows all are)."""
    fill(where)
    status, dry = cli("gc", "run", "--dry-run")
    assert status == 0 and (dry["dry_run"], dry["rows_expired"]) == (True, 2)
    assert cli("stats")[1]["rows"] == 2
    status, done = cli("gc", "run")
    assert status == 0 and (done["dry_run"], done["rows_expired"], done["blobs_deleted"]) == (False, 2, 3)
    assert cli("stats")[1]["rows"] == 0
