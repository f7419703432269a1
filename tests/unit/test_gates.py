"""Gates under an injected clock: which requests are held (paused, before start_at, outside their
windows), re-checked at most once per recheck_ms, and each opening reported once."""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import pytest
import structlog.testing

from exhook_server.dispatch.gates import Gates
from exhook_server.policy import Policy, Window
from storage.errors import StorageError
from storage.model import StoredPolicy


def ms(*parts: int) -> int:
    return int(datetime.datetime(*parts, tzinfo=datetime.UTC).timestamp() * 1000)  # type: ignore[misc]


class Clock:
    def __init__(self, at: int) -> None:
        self.ms = at

    def __call__(self) -> int:
        return self.ms


def test_held_follows_pause_start_at_and_windows_and_reports_each_opening_once() -> None:
    clock = Clock(ms(2026, 11, 28, 1, 30))
    opened: list[str] = []
    gates = Gates(clock, on_open=opened.append, recheck_ms=1000)
    assert gates.held() == frozenset()
    gates.set("paused", Policy(paused=True))
    gates.set("later", Policy(start_at_ms=ms(2026, 11, 28, 1, 45)))
    gates.set("nightly", Policy(windows=(Window("0 2 * * *", 3600, "UTC"),)))
    gates.set("rated", Policy(max_per_minute=60))  # nothing that holds
    assert gates.held() == {"paused", "later", "nightly"}
    clock.ms = ms(2026, 11, 28, 1, 50)
    assert gates.held() == {"paused", "nightly"} and opened == ["later"]
    clock.ms = ms(2026, 11, 28, 2, 0) - 200
    assert gates.held() == {"paused", "nightly"}
    clock.ms += 500  # the window is open, but within recheck_ms of the last check: not recomputed yet
    assert gates.held() == {"paused", "nightly"}
    clock.ms += 600_000
    assert gates.held() == {"paused"} and opened == ["later", "nightly"]
    clock.ms = ms(2026, 11, 28, 3, 0)  # the window closed again
    assert gates.held() == {"paused", "nightly"}
    gates.set("paused", None)  # cleared: open at once
    assert gates.held() == {"nightly"} and opened == ["later", "nightly", "paused"]


def test_replace_all_reads_the_stored_policies_and_skips_one_it_cannot_read() -> None:
    clock = Clock(ms(2026, 11, 28, 12))
    gates = Gates(clock)
    gates.replace_all(
        [
            StoredPolicy("a", Policy(paused=True).encode(), 1),
            StoredPolicy("b", b"not json", 1),
            StoredPolicy("c", Policy(priority="high").encode(), 1),
        ]
    )
    assert gates.held() == {"a"}
    gates.replace_all([])
    assert gates.held() == frozenset()


def test_a_reload_decodes_only_the_policies_that_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The refresh loop reloads every policy each second: an unchanged one is not decoded (nor an
    unreadable one logged) again; a changed one is."""
    decoded: list[bytes] = []
    real = Policy.decode
    monkeypatch.setattr(Policy, "decode", staticmethod(lambda doc: decoded.append(doc) or real(doc)))
    gates = Gates(Clock(ms(2026, 11, 28, 12)))
    paused, bad = StoredPolicy("a", Policy(paused=True).encode(), 1), StoredPolicy("b", b"not json", 1)
    with structlog.testing.capture_logs() as logs:
        gates.replace_all([paused, bad])
        gates.replace_all([paused, bad])
    assert decoded == [paused.doc, bad.doc]
    assert [e["request_id"] for e in logs if e["event"] == "policy_unreadable"] == ["b"]
    assert gates.held() == {"a"}
    gates.replace_all([StoredPolicy("a", Policy(priority="high").encode(), 2), bad])
    assert len(decoded) == 3 and gates.held() == frozenset()


def test_run_logs_a_failing_store_once_and_keeps_the_last_policies() -> None:
    gates = Gates(Clock(ms(2026, 11, 28, 12)))
    answers: list[Any] = [
        [StoredPolicy("a", Policy(paused=True).encode(), 1)],
        StorageError("down"),
        StorageError("down"),
    ]

    async def load() -> list[StoredPolicy]:
        if not answers:
            raise asyncio.CancelledError  # the test's end
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[no-any-return]

    with structlog.testing.capture_logs() as logs, pytest.raises(asyncio.CancelledError):
        asyncio.run(gates.run(load, 0.0))
    assert gates.held() == {"a"}  # the last policies stay in force
    assert [e["event"] for e in logs if e["event"] == "policies_not_loaded"] == ["policies_not_loaded"]
