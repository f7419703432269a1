"""The shortest path through the product: one batch in, rows out."""

from exhook_server._proto import exhook_v3_pb2 as pb
from testkit.harness import ExHookClient, InProcessServer


def test_batch_is_stored_and_stopped(server: InProcessServer, client: ExHookClient) -> None:
    """A seed-000 batch becomes one row per VIN and is answered STOP_AND_RETURN, not routed."""
    reply = client.batch(["VIN1", "VIN2"], "task_ota_1", "hello")
    assert reply.type == pb.ValuedResponse.STOP_AND_RETURN
    assert reply.message.headers["allow_publish"] == "false"
    assert [r.request_id for r in server.store.pending("VIN1")] == ["task_ota_1"]
    assert server.store.blob(server.store.pending("VIN2")[0].sha1) == b"hello"
