"""Defined answers at the edges of the wire: oversize messages, malformed protobuf, a full ingest budget."""

from __future__ import annotations

import json
import threading
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from exhook_server._proto import exhook_v3_pb2 as pb
from exhook_server.server import receive_limit_bytes
from testkit.harness import ExHookClient, InProcessServer, poll
from tests.wire import LEN, encode

STOP = pb.ValuedResponse.STOP_AND_RETURN


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def raw_call(client: ExHookClient, method: str, body: bytes) -> Any:
    """Send `body` as the request bytes of `method`, unchecked by any client-side encoder."""
    return client.channel.unary_unary(f"/emqx.exhook.v3.HookProvider/{method}")(body, timeout=10)


def batch_payload(size: int, request_id: str = "task_big_1") -> bytes:
    """A seed-format batch for one VIN whose JSON is about `size` bytes."""
    return json.dumps({"ids": ["VIN1"], "request_id": request_id, "data": "x" * size}).encode()


def test_payload_far_over_the_limit_is_rejected_with_reason(server: InProcessServer, client: ExHookClient) -> None:
    """A 10 MiB batch (limit 4 MiB) is answered payload_too_large, logged and counted, not a gRPC error."""
    before = sample("sdv_fanout_batches_rejected_total", reason="payload_too_large")
    with capture_logs() as logs:
        reply = client.publish("$SDV-FANOUT", batch_payload(10 << 20))
    assert reply.type == STOP and reply.message.headers["allow_publish"] == "false"
    assert [e["reason"] for e in logs if e["event"] == "batch_rejected"] == ["payload_too_large"]
    assert sample("sdv_fanout_batches_rejected_total", reason="payload_too_large") == before + 1
    assert server.store.stats().rows == 0


def test_message_over_the_hard_receive_limit_is_refused_by_grpc(make_server: Any) -> None:
    """Above 4 x max_payload_bytes + 1 MiB gRPC itself answers RESOURCE_EXHAUSTED, before any copy of ours."""
    srv = make_server(max_payload_bytes=64 << 10, max_ingest_inflight_bytes=64 << 10)
    limit = receive_limit_bytes(srv.cfg)
    assert limit == 4 * (64 << 10) + (1 << 20)
    client = ExHookClient(srv.port)
    try:
        with capture_logs() as logs, pytest.raises(grpc.RpcError) as err:
            client.publish("$SDV-FANOUT", batch_payload(limit))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in (err.value.details() or "")
        assert not [e for e in logs if e["event"] == "batch_rejected"]  # gRPC refused it: no handler ran
        reply = client.publish("$SDV-FANOUT", batch_payload(limit - 4096))  # envelope included, within
        assert reply.type == STOP
    finally:
        client.close()


def test_invalid_utf8_topic_is_invalid_argument_with_log_line(client: ExHookClient) -> None:
    """A Message.topic that is not UTF-8 gets INVALID_ARGUMENT naming the problem, a log line and a count."""
    bad = encode([(1, LEN, encode([(5, LEN, b"$SDV-FANOUT\xff"), (6, LEN, batch_payload(10))]))])
    before = sample("sdv_fanout_malformed_calls_total", hook="OnMessagePublish")
    with capture_logs() as logs, pytest.raises(grpc.RpcError) as err:
        raw_call(client, "OnMessagePublish", bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in (err.value.details() or "")
    [line] = [e for e in logs if e["event"] == "call_malformed"]
    assert (line["hook"], line["size"]) == ("OnMessagePublish", len(bad))
    assert sample("sdv_fanout_malformed_calls_total", hook="OnMessagePublish") == before + 1


@pytest.mark.parametrize("method", ["OnClientConnected", "OnClientAuthorize", "OnProviderLoaded"])
def test_garbage_bytes_to_any_hook_are_invalid_argument(client: ExHookClient, method: str) -> None:
    """Bytes that are not protobuf at all get INVALID_ARGUMENT and a log line on every hook, ours or not."""
    with capture_logs() as logs, pytest.raises(grpc.RpcError) as err:
        raw_call(client, method, b"\xff\xff\xff\xff not protobuf")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [e["hook"] for e in logs if e["event"] == "call_malformed"] == [method]


def test_batch_beyond_the_inflight_budget_is_refused_at_once(make_server: Any) -> None:
    """With the budget held by a batch waiting for its commit, the next batch is RESOURCE_EXHAUSTED at once."""
    srv = make_server(max_payload_bytes=1 << 20, max_ingest_inflight_bytes=1 << 20, ingest_timeout_s=30.0)
    first, second = ExHookClient(srv.port), ExHookClient(srv.port)
    refused = sample("sdv_fanout_batches_refused_total")
    held = threading.Event()
    release = threading.Event()

    def hold_writer() -> None:
        with srv.store.write():  # the group commit waits for LMDB's writer lock meanwhile
            held.set()
            release.wait(30)

    replies: list[Any] = []
    holder = threading.Thread(target=hold_writer)
    waiting = threading.Thread(target=lambda: replies.append(first.publish("$SDV-FANOUT", batch_payload(600_000))))
    holder.start()
    try:
        assert held.wait(10)
        waiting.start()
        poll(lambda: sample("sdv_fanout_ingest_inflight_bytes") > 600_000)
        with capture_logs() as logs, pytest.raises(grpc.RpcError) as err:
            second.publish("$SDV-FANOUT", batch_payload(600_000, "task_big_2"))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        [line] = [e for e in logs if e["event"] == "batch_refused_overload"]
        assert line["limit_bytes"] == 1 << 20 and line["in_progress_bytes"] > 600_000
        assert sample("sdv_fanout_batches_refused_total") == refused + 1
    finally:
        release.set()
        holder.join(10)
        if waiting.is_alive():
            waiting.join(30)
        first.close()
        second.close()
    assert [r.type for r in replies] == [STOP]
    assert [r.request_id for r in srv.store.pending("VIN1")] == ["task_big_1"]
    assert sample("sdv_fanout_ingest_inflight_bytes") == 0
