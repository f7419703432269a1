"""Campaign policies through the Ingestor on either store: set, replaced, cleared, refused with a
reason, bounded, and kept by the store (the same bodies on LMDB and on a real PostgreSQL)."""

from __future__ import annotations

import json
from typing import Any

from exhook_server.batch import Kind
from exhook_server.ingest import Ingestor
from tests.integration.test_ingest_both_stores import Heard, Opener, batch, opener, publish, run

__all__ = ["opener"]  # the parametrised store fixture (LMDB, PostgreSQL)

TOPIC = "$SDV-FANOUT/policy"


def policy(request_id: str, **fields: Any) -> bytes:
    return json.dumps({"request_id": request_id, **fields}).encode()


async def stored(ingestor: Ingestor) -> dict[str, Any]:
    return {p.request_id: json.loads(p.doc) for p in await ingestor._writes.policies()}


def test_a_policy_is_stored_echoed_replaced_and_cleared(opener: Opener) -> None:
    """The `policy` event echoes what is in force; a later message replaces the whole policy (no
    merge); `{"request_id": R}` alone clears it. A policy may come before any batch of R."""

    async def body(ingestor: Ingestor, heard: Heard) -> None:
        first = policy("task_ota_1", max_per_minute=600, paused=True, correlation_id="c-1")
        assert await publish(ingestor, Kind.POLICY, TOPIC, first)
        assert await stored(ingestor) == {"task_ota_1": {"max_per_minute": 600, "paused": True}}
        assert await publish(ingestor, Kind.BATCH, "$SDV-FANOUT", batch(["V1"], "task_ota_1", "fw"))
        assert await publish(ingestor, Kind.POLICY, TOPIC, policy("task_ota_1", max_in_flight=5))
        assert await stored(ingestor) == {"task_ota_1": {"max_in_flight": 5}}
        assert await publish(ingestor, Kind.POLICY, TOPIC, policy("task_ota_1"))
        assert await stored(ingestor) == {}
        set1, set2, cleared = heard.of("policy")
        assert set1["policy"] == {"max_per_minute": 600, "paused": True} and set1["correlation_id"] == "c-1"
        assert set2["policy"] == {"max_in_flight": 5} and "cleared" not in set2
        assert cleared["cleared"] is True and "policy" not in cleared
        assert {e["request_id"] for e in heard.of("policy")} == {"task_ota_1"}

    run(opener, body)


def test_a_refused_policy_gets_rejected_with_its_reason_and_changes_nothing(opener: Opener) -> None:
    async def body(ingestor: Ingestor, heard: Heard) -> None:
        assert await publish(ingestor, Kind.POLICY, TOPIC, policy("task_ota_1", max_in_flight=5))
        bad = policy("task_ota_1", windows=[{"cron": "0 2 * *", "duration_s": 60, "tz": "UTC"}], correlation_id="c")
        assert not await publish(ingestor, Kind.POLICY, TOPIC, bad)
        [rejected] = heard.of("rejected")
        assert (rejected["request_id"], rejected["of"], rejected["reason"], rejected["field"]) == (
            "task_ota_1",
            "policy",
            "bad_policy",
            "windows",
        )
        assert rejected["correlation_id"] == "c" and "cron" in rejected["detail"]
        assert await stored(ingestor) == {"task_ota_1": {"max_in_flight": 5}}  # the one in force stays
        outsider = await ingestor.ingest(Kind.POLICY, TOPIC, policy("task_ota_1"), "vehicle-7", "v7")
        assert not outsider
        assert heard.of("rejected")[1]["reason"] == "publisher_not_allowed"
        assert await stored(ingestor) == {"task_ota_1": {"max_in_flight": 5}}

    run(opener, body, publisher_allowlist=("sdv-platform",))


def test_policies_are_bounded_by_max_policies(opener: Opener) -> None:
    """At max_policies a new request id's policy is refused `policies_full`; replacing or clearing
    one in force still works, and a clear makes room."""

    async def body(ingestor: Ingestor, heard: Heard) -> None:
        assert await publish(ingestor, Kind.POLICY, TOPIC, policy("r1", paused=True))
        assert await publish(ingestor, Kind.POLICY, TOPIC, policy("r2", paused=True))
        assert not await publish(ingestor, Kind.POLICY, TOPIC, policy("r3", paused=True))
        assert heard.of("rejected")[0]["reason"] == "policies_full"
        assert await publish(ingestor, Kind.POLICY, TOPIC, policy("r2", priority="high"))
        assert await publish(ingestor, Kind.POLICY, TOPIC, policy("r1"))
        assert await publish(ingestor, Kind.POLICY, TOPIC, policy("r3", paused=True))
        assert sorted(await stored(ingestor)) == ["r2", "r3"]

    run(opener, body, max_policies=2)
